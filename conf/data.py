"""Data configs: where the corpus comes from, how it is tokenized and packed."""
from dataclasses import dataclass
from typing import Optional


@dataclass
class DataConfig:
    # Corpus kind: "stdlib" (this Python's standard-library sources, no download),
    # "files" (local .txt/.py/.md, .jsonl/.json or .parquet files, a directory or a glob),
    # "hub" (a `datasets` name or a path `datasets.load_dataset` understands).
    name: str = "stdlib"
    path: Optional[str] = None
    text_field: str = "text"  # column holding the document text (jsonl/parquet/hub)
    hub_split: str = "train"  # split of a hub dataset to read
    seq_len: int = 256  # tokens per packed training sequence
    vocab_size: int = 4096  # BPE vocabulary, special tokens included
    tokenizer_path: Optional[str] = None  # an existing tokenizer.json instead of training one
    val_fraction: float = 0.02  # documents held out for validation
    max_documents: Optional[int] = None  # cap on documents read (None = all)
    cache_dir: str = "~/.cache/flashtrain"  # tokenizers and packed datasets live here
    # How long a run waits for another process that holds the lock on a tokenizer or packed dataset it
    # is building in cache_dir. A killed holder releases the lock at once (an OS file lock); a stuck
    # one would otherwise be waited for forever.
    lock_timeout_s: float = 1800.0
    split_seed: int = 1234  # seed of the train/validation document split
    # Image-text documents mixed into pretraining (needs model.vision_n_layers > 0; data/images.py):
    # this share of the micro-batches comes from the image-text corpus, the rest from the text one.
    image_text_ratio: float = 0.0
    # "digits": rendered two-digit numbers with their captions, made on the fly (no download);
    # otherwise a .jsonl/.parquet file (or a directory of them) with text and image paths, an image
    # folder (`datasets` imagefolder, captions in its metadata.jsonl), or a hub dataset name
    image_source: str = "digits"
    image_field: str = "images"  # column with the document's image(s): paths, bytes or `datasets` Images
    image_documents: int = 20_000  # documents of the digits corpus (val_fraction of them held out)


@dataclass
class StdlibDataConfig(DataConfig):
    name: str = "stdlib"


@dataclass
class FilesDataConfig(DataConfig):
    name: str = "files"  # needs data.path


@dataclass
class HubDataConfig(DataConfig):
    name: str = "hub"  # needs data.path
