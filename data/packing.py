"""From documents to fixed-length training samples.

Each split is tokenized document by document (``[BOS] + tokens + [EOS]``), concatenated in document order
into one token stream and cut into samples of ``seq_len + 1`` tokens taken every ``seq_len`` tokens:
consecutive samples share one token, so every stream position except the last is the input of exactly
one sample and has its next token as label. Nothing is padded; the incomplete tail is dropped.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from data.corpus import cache_lock, load_documents, stable_hash
from data.errors import DataError
from data.tokenizer import TextTokenizer, load_or_train_tokenizer

if TYPE_CHECKING:
    from conf.data import DataConfig

logger = logging.getLogger(__name__)

SPLITS = ("train", "validation")

# Label value ignored by `torch.nn.functional.cross_entropy`.
IGNORE_INDEX = -100

# Bump when tokenization or packing changes so that cached samples are rebuilt.
_FORMAT_VERSION = 1


class PackedDataset(torch.utils.data.Dataset):
    """Packed samples of one split, served as model inputs.

    `samples` has one column ``tokens`` of ``seq_len + 1`` token ids per row. Each item is a dict of
    ``input_ids`` and ``labels`` (int64, [seq_len]) and ``doc_ids`` (int32, [seq_len]), computed with
    whole-array numpy operations from the stored tokens.
    """

    def __init__(self, samples: datasets.Dataset, bos_id: int, pad_id: int) -> None:
        self.samples = samples.with_format("numpy")
        self.seq_len = samples.features["tokens"].length - 1
        self.bos_id = bos_id
        self.pad_id = pad_id

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {name: values[0] for name, values in self.get_batch([index]).items()}

    def get_batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """The samples at `indices`, stacked into [len(indices), seq_len] tensors."""
        tokens = self.samples[list(indices)]["tokens"]
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        # A BOS label is the first token of the next document, which cannot be predicted from this
        # one; PAD labels are filler. Neither is trained on.
        labels = np.where((targets == self.bos_id) | (targets == self.pad_id), IGNORE_INDEX, targets)
        # Every BOS opens a new document. Subtracting the first position's flag numbers the first
        # document of each sample 0, whether the sample starts mid-document or exactly on a BOS.
        starts = inputs == self.bos_id
        doc_ids = np.cumsum(starts, axis=1) - starts[:, :1]
        return {
            "input_ids": torch.from_numpy(inputs.astype(np.int64)),
            "labels": torch.from_numpy(labels.astype(np.int64)),
            "doc_ids": torch.from_numpy(doc_ids.astype(np.int32)),
        }


def build_datasets(cfg: DataConfig) -> tuple[PackedDataset, PackedDataset, TextTokenizer]:
    """Train and validation samples of the configured corpus, and the tokenizer that produced them.

    The packed splits are cached under ``<cache_dir>/packed/<key>/``, the key hashing the documents of
    both splits, the tokenizer and `seq_len`; a file lock makes concurrent processes build them once.
    """
    if cfg.seq_len < 1:
        raise DataError(f"data.seq_len must be positive, got {cfg.seq_len}")
    documents = load_documents(cfg)
    splits = dict(zip(SPLITS, split_documents(documents, cfg)))
    tokenizer = load_or_train_tokenizer(cfg, splits["train"])

    key = stable_hash(
        {
            "version": _FORMAT_VERSION,
            "documents": {name: split._fingerprint for name, split in splits.items()},
            "tokenizer": tokenizer.fingerprint,
            "seq_len": cfg.seq_len,
        }
    )
    path = Path(cfg.cache_dir).expanduser() / "packed" / key
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with cache_lock(path, cfg.lock_timeout_s, "packed dataset"):
            if not path.exists():  # another process may have built it while we waited
                packed = datasets.DatasetDict(
                    {
                        name: _pack(_tokenize(split, tokenizer), cfg.seq_len, name)
                        for name, split in splits.items()
                    }
                )
                # Saved aside and renamed: a directory at `path` is always complete.
                partial = path.with_name(f"{key}.partial")
                shutil.rmtree(partial, ignore_errors=True)
                packed.save_to_disk(str(partial))
                os.replace(partial, path)
    packed = datasets.load_from_disk(str(path))
    train, val = (PackedDataset(packed[name], tokenizer.bos_id, tokenizer.pad_id) for name in SPLITS)
    return train, val, tokenizer


def split_documents(
    documents: datasets.Dataset, cfg: DataConfig
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Hold out `cfg.val_fraction` of the documents (at least one) for validation, chosen by `cfg.split_seed`.

    Splitting whole documents keeps validation text unseen in training. Both splits keep corpus order.
    """
    if not 0 <= cfg.val_fraction < 1:
        raise DataError(f"data.val_fraction must be in [0, 1), got {cfg.val_fraction}")
    count = len(documents)
    if count < 2:
        raise DataError(f"the corpus has {count} document(s); a train/validation split needs at least 2")
    held_out = min(max(1, round(count * cfg.val_fraction)), count - 1)
    is_val = np.zeros(count, dtype=bool)
    is_val[np.random.default_rng(cfg.split_seed).permutation(count)[:held_out]] = True

    key = stable_hash(
        {"documents": documents._fingerprint, "val_fraction": cfg.val_fraction, "seed": cfg.split_seed}
    )
    train = documents.select(np.flatnonzero(~is_val), new_fingerprint=f"{key}-train")
    val = documents.select(np.flatnonzero(is_val), new_fingerprint=f"{key}-validation")
    return train, val


def _tokenize(documents: datasets.Dataset, tokenizer: TextTokenizer) -> datasets.Dataset:
    """One row of ``[BOS] + tokens + [EOS]`` per document, cached by `datasets` next to the corpus.

    This cache outlives the packed one: changing only `seq_len` re-packs without re-tokenizing.
    """
    bos, eos = tokenizer.bos_id, tokenizer.eos_id

    def encode(texts: list[str]) -> dict[str, list[list[int]]]:
        return {"ids": [[bos, *ids, eos] for ids in tokenizer.encode_batch(texts)]}

    return documents.map(
        encode,
        batched=True,
        input_columns="text",
        remove_columns=["text"],
        features=datasets.Features({"ids": datasets.List(datasets.Value("int32"))}),
        # Explicit, because `datasets` cannot hash the closure reliably: it captures a Rust tokenizer.
        new_fingerprint=stable_hash(
            {
                "version": _FORMAT_VERSION,
                "documents": documents._fingerprint,
                "tokenizer": tokenizer.fingerprint,
            }
        ),
        desc="Tokenizing",
    )


def _pack(tokenized: datasets.Dataset, seq_len: int, split: str) -> datasets.Dataset:
    """Cut the concatenated documents into samples of ``seq_len + 1`` tokens with stride ``seq_len``."""
    stream = pc.list_flatten(tokenized.with_format("arrow")[:]["ids"]).to_numpy()
    count = (len(stream) - 1) // seq_len
    if count < 1:
        raise DataError(
            f"the {split} split has {len(stream)} tokens, fewer than one sample of data.seq_len + 1 = "
            f"{seq_len + 1}; use more documents or a shorter seq_len"
        )
    # Window k is stream[k * seq_len : k * seq_len + seq_len + 1]; the view is copied only once, below.
    windows = np.lib.stride_tricks.sliding_window_view(stream, seq_len + 1)[::seq_len]
    tokens = pa.FixedSizeListArray.from_arrays(pa.array(windows.reshape(-1)), seq_len + 1)
    logger.info("packed the %s split: %d tokens into %d samples", split, len(stream), count)
    return datasets.Dataset.from_dict({"tokens": tokens})
