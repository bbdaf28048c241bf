"""Image-text data: image preprocessing, image spans in token sequences, packing, and the default
image-text corpus (rendered digits, made on the fly, no download).

Preprocessing computes what the public DeepSeek-V4.1-Flash image processor computes:
* RGB. An image wider than `vision_max_wh_ratio` x its height is treated as that wide; one with fewer
  than `vision_min_pixels` pixels is scaled up (both sides by the same factor, truncated) to about
  that many. Each side is rounded up to a multiple of the patch size; if the image's span would then
  exceed `vision_max_n_token`, the size shrinks (aspect kept) to the largest whose span fits.
* The image is letterboxed (centred, aspect kept) onto that size over gray (127, 127, 127), or
  stretched when it is at least `vision_max_wh_ratio` times as wide as tall.
* Pixel values x / 255 normalised with mean 0.5 and std 0.5 (to [-1, 1]), cut into raster-order
  patches [n_h * n_w, 3, p, p].
* Its span: IMAGE_START, per row of the ceil(n_h / 3) x ceil(n_w / 3) token grid that row's IMAGE
  tokens and an IMAGE_NEW_LINE, IMAGE_END. Every span position carries `image_token_id` in the ids;
  only the token types (conf.model) tell them apart. Span positions are never labels.

A sample is a document: text and images interleaved. Packing puts whole documents ([BOS] content
[EOS]) into rows of seq_len + 1 tokens, the next document going to a new row when it does not fit,
the rest of a row padded (pad labels are ignored): an image span is never cut, which the text
pipeline's stream cutting (data/packing.py) would do.
"""
from __future__ import annotations

import io
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import datasets
import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont, ImageOps

from conf.data import DataConfig
from conf.model import IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START, TEXT, ModelConfig
from data.errors import DataError
from data.packing import split_documents

IGNORE_INDEX = -100
PAD_GRAY = (127, 127, 127)


# ------------------------------------------------------------------ preprocessing
def span_length(n_llm_h: int, n_llm_w: int) -> int:
    return n_llm_h * (n_llm_w + 1) + 2


def token_grid(height: int, width: int, patch: int, ratio: int) -> tuple[int, int]:
    """The aligner's token grid of an image of this pixel size (a multiple of the patch)."""
    return math.ceil(height // patch / ratio), math.ceil(width // patch / ratio)


def _shrink_to_fit(height: float, width: float, patch: int, ratio: int, max_tokens: int) -> tuple[int, int]:
    """The largest aspect-preserving pixel size (multiples of the patch) whose span fits max_tokens:
    with w cells across and h = w * aspect down, the span is h (w + 1) + 2."""
    aspect = height / width
    cells_w = math.sqrt((max_tokens - 2) / aspect + 0.25) - 0.5
    cells_h = cells_w * aspect
    cell = patch * ratio
    if cells_w < 1.0:  # too tall for even one column of cells: a single column
        return (max_tokens - 2) // 2 * cell, cell
    if cells_h < 1.0:  # too wide: a single row
        return cell, (max_tokens - 3) * cell
    scale = min(math.floor(cells_w) * cell / width, math.floor(cells_h) * cell / height)
    return math.floor(height * scale / patch) * patch, math.floor(width * scale / patch) * patch


def plan_image_grid(width: int, height: int, cfg: ModelConfig) -> tuple[int, int, int, int]:
    """Original pixel size -> (n_llm_h, n_llm_w, pixel height, pixel width) the image is resized to."""
    p, r = cfg.vision_patch_size, cfg.vision_downsample_ratio
    if cfg.vision_max_wh_ratio is not None and width > height * cfg.vision_max_wh_ratio:
        width = height * cfg.vision_max_wh_ratio
    if 0 < width * height < cfg.vision_min_pixels:
        scale = (cfg.vision_min_pixels / (width * height)) ** 0.5
        width, height = int(width * scale), int(height * scale)
    best_h, best_w = math.ceil(height / p) * p, math.ceil(width / p) * p
    grid = token_grid(best_h, best_w, p, r)
    if span_length(*grid) > cfg.vision_max_n_token:
        best_h, best_w = _shrink_to_fit(height, width, p, r, cfg.vision_max_n_token)
        grid = token_grid(best_h, best_w, p, r)
    return grid[0], grid[1], best_h, best_w


def open_image(source: Any) -> Image.Image:
    """A PIL image from a PIL image, a path, bytes, or a `datasets` Image record ({bytes, path})."""
    if isinstance(source, Image.Image):
        return source
    if isinstance(source, dict):
        source = source.get("bytes") or source.get("path")
    if isinstance(source, (bytes, bytearray)):
        try:
            return Image.open(io.BytesIO(source))
        except OSError as e:
            raise DataError(f"cannot read an image of {len(source)} bytes: {e}") from e
    if isinstance(source, str):
        try:
            return Image.open(source)
        except OSError as e:
            raise DataError(f"cannot read image {source}: {e}") from e
    raise DataError(f"an image must be a PIL image, a path, bytes or a datasets Image record, "
                    f"got {type(source).__name__}")


def span_types(n_llm_h: int, n_llm_w: int) -> list[int]:
    """The token types of the span of an n_llm_h x n_llm_w token grid (module docstring)."""
    return [IMAGE_START] + ([IMAGE] * n_llm_w + [IMAGE_NEW_LINE]) * n_llm_h + [IMAGE_END]


def plan_image(source: Any, cfg: ModelConfig) -> tuple[tuple[int, int], list[int]]:
    """(patch grid (n_h, n_w), span types) of an image, from its size alone: the file's header is
    read, the pixels are not decoded (prepare_image does that, to the same plan)."""
    image = open_image(source)
    try:
        width, height = image.size
    finally:
        if image is not source:
            image.close()
    n_llm_h, n_llm_w, best_h, best_w = plan_image_grid(width, height, cfg)
    p = cfg.vision_patch_size
    return (best_h // p, best_w // p), span_types(n_llm_h, n_llm_w)


@dataclass
class PreparedImage:
    patches: torch.Tensor  # [n_h * n_w, 3, p, p] fp32 in [-1, 1]
    grid: tuple[int, int]  # (n_h, n_w) patches
    types: list[int]  # the span's token types


def prepare_image(source: Any, cfg: ModelConfig) -> PreparedImage:
    """Resize, normalise and patch one image (module docstring) and lay out its span."""
    image = open_image(source).convert("RGB")
    n_llm_h, n_llm_w, height, width = plan_image_grid(image.width, image.height, cfg)
    p = cfg.vision_patch_size
    if cfg.vision_max_wh_ratio is not None and image.width >= cfg.vision_max_wh_ratio * image.height:
        image = image.resize((width, height))
    else:
        image = ImageOps.pad(image, (width, height), color=PAD_GRAY)
    x = torch.from_numpy(np.asarray(image, dtype=np.float32)).permute(2, 0, 1) / 255  # [3, H, W]
    x = (x - 0.5) / 0.5
    n_h, n_w = height // p, width // p
    patches = x.reshape(3, n_h, p, n_w, p).permute(1, 3, 0, 2, 4).reshape(n_h * n_w, 3, p, p)
    return PreparedImage(patches, (n_h, n_w), span_types(n_llm_h, n_llm_w))


# ------------------------------------------------------------------ documents and packing
@dataclass
class EncodedDocument:
    """One image-text document as model inputs: ids, token types and which ids are trained on."""
    ids: list[int] = field(default_factory=list)
    types: list[int] = field(default_factory=list)
    trained: list[bool] = field(default_factory=list)
    images: list[PreparedImage] = field(default_factory=list)
    image_starts: list[int] = field(default_factory=list)  # span start of each image in ids

    def add_text(self, ids: Sequence[int], trained: bool = True) -> None:
        self.ids += ids
        self.types += [TEXT] * len(ids)
        self.trained += [trained] * len(ids)

    def add_image(self, image: PreparedImage, image_token_id: int) -> None:
        self.image_starts.append(len(self.ids))
        self.images.append(image)
        self.ids += [image_token_id] * len(image.types)
        self.types += image.types
        self.trained += [False] * len(image.types)


def encode_document(segments: Sequence[Any], tokenizer, cfg: ModelConfig, bos_id: int, eos_id: int,
                    image_token_id: int) -> EncodedDocument:
    """segments: strings and images (anything `open_image` reads), in reading order ->
    [BOS] segments [EOS]."""
    doc = EncodedDocument()
    doc.add_text([bos_id])
    for segment in segments:
        if isinstance(segment, str):
            doc.add_text(tokenizer.encode(segment))
        else:
            doc.add_image(prepare_image(segment, cfg), image_token_id)
    doc.add_text([eos_id])
    return doc


def pack_documents(docs: Sequence[EncodedDocument], seq_len: int, pad_id: int) -> list[dict[str, Any]]:
    """Whole documents into rows of seq_len inputs (module docstring) -> one dict per row:
    input_ids, labels, doc_ids, token_types ([seq_len] tensors) and images [(patches, grid, start)]."""
    rows, current = [], []
    for doc in docs:
        if len(doc.ids) > seq_len + 1:
            raise DataError(f"an image-text document of {len(doc.ids)} tokens does not fit data.seq_len="
                            f"{seq_len} (+1): images are never cut, so raise seq_len or shrink the images")
        if current and sum(len(d.ids) for d in current) + len(doc.ids) > seq_len + 1:
            rows.append(current)
            current = []
        current.append(doc)
    if current:
        rows.append(current)
    return [_row(docs_, seq_len, pad_id) for docs_ in rows]


def _row(docs: Sequence[EncodedDocument], seq_len: int, pad_id: int) -> dict[str, Any]:
    ids, types, trained, doc_ids, images = [], [], [], [], []
    for n, doc in enumerate(docs):
        images += [(img.patches, img.grid, len(ids) + s) for img, s in zip(doc.images, doc.image_starts)]
        ids += doc.ids
        types += doc.types
        trained += doc.trained
        doc_ids += [n] * len(doc.ids)
    fill = seq_len + 1 - len(ids)
    ids += [pad_id] * fill
    types += [TEXT] * fill
    trained += [False] * fill
    doc_ids += [len(docs)] * fill
    ids_t, docs_t = torch.tensor(ids), torch.tensor(doc_ids, dtype=torch.int32)
    # label of input t is token t+1, trained unless it is a BOS (the next document), filler or a span
    same_doc = docs_t[1:] == docs_t[:-1]
    labels = torch.where(torch.tensor(trained[1:]) & same_doc, ids_t[1:], IGNORE_INDEX)
    return {"input_ids": ids_t[:-1], "labels": labels, "doc_ids": docs_t[:-1],
            "token_types": torch.tensor(types[:-1]), "images": images}


def collate(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Rows -> a batch: stacked tensors, and the images as the model's (patches, grid, row, start)
    lists in batch order (model.vision.ImageBatch's fields)."""
    batch = {k: torch.stack([r[k] for r in rows]) for k in ("input_ids", "labels", "doc_ids", "token_types")}
    batch["image_patches"] = [p for r in rows for p, _, _ in r["images"]]
    batch["image_grids"] = [g for r in rows for _, g, _ in r["images"]]
    batch["image_rows"] = [i for i, r in enumerate(rows) for _ in r["images"]]
    batch["image_starts"] = [s for r in rows for _, _, s in r["images"]]
    return batch


# ------------------------------------------------------------------ the default corpus: rendered digits
def render_digits(digits: str, rng: random.Random, height: int = 28,
                  width: Optional[int] = None) -> Image.Image:
    """The digits drawn in dark ink on a light background, at a random size, offset and shade, so that
    reading them needs the pixels. Each digit gets about a height x height cell (width None: that many
    cells) and a glyph over two thirds of the height tall (19-24 px of 28): about the 21 x 21 px that
    one of the tiny tower's aligner tokens sees (3 x 3 patches of 7 px), so that a 2-layer tower learns
    the shapes within a CPU run."""
    width = width or height * len(digits)
    background = rng.randint(200, 255)
    image = Image.new("RGB", (width, height), (background,) * 3)
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=rng.randint(height, height * 5 // 4))
    left, top, right, bottom = draw.textbbox((0, 0), digits, font=font)
    x = rng.randint(0, max(width - (right - left), 0)) - left
    y = rng.randint(0, max(height - (bottom - top), 0)) - top
    ink = rng.randint(0, 80)
    draw.text((x, y), digits, fill=(ink,) * 3, font=font)
    return image


def digit_document(seed: int, index: int, n_digits: int = 2) -> list[Any]:
    """Document `index` of the digits corpus `seed`: [image, " digits: 4 7"], the caption stating the
    digits drawn in the image; a pure function of (seed, index)."""
    rng = random.Random(f"{seed}-{index}")
    digits = "".join(rng.choice("0123456789") for _ in range(n_digits))
    return [render_digits(digits, rng), " digits: " + " ".join(digits)]


def digit_documents(count: int, seed: int, n_digits: int = 2) -> Iterator[list[Any]]:
    """The first `count` documents of the digits corpus `seed`."""
    for index in range(count):
        yield digit_document(seed, index, n_digits)


class DigitCorpus:
    """The digits corpus as an indexable sequence of documents (segments lists)."""

    def __init__(self, count: int, seed: int):
        self.count, self.seed = count, seed

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> list[Any]:
        return digit_document(self.seed, index)


# ------------------------------------------------------------------ corpora from files and the hub
IMAGE_MARKER = "<image>"  # where an image sits in a document's text; none: the images come first


def interleave(text: str, images: Sequence[Any], where: str) -> list[Any]:
    """Segments of a text with an image at each IMAGE_MARKER, in order (no marker: images first)."""
    pieces = text.split(IMAGE_MARKER)
    if len(pieces) == 1:
        return [*images, text]
    if len(pieces) - 1 != len(images):
        raise DataError(f"{where} has {len(pieces) - 1} {IMAGE_MARKER} markers but {len(images)} images")
    segments: list[Any] = [pieces[0]]
    for image, piece in zip(images, pieces[1:]):
        segments += [image, piece]
    return [seg for seg in segments if not isinstance(seg, str) or seg]


class RecordCorpus:
    """Documents from `datasets` rows: a text column and an image column (one image or a list), the
    images placed at the IMAGE_MARKERs of the text. Relative image paths are read from `root`."""

    def __init__(self, rows, text_field: str, image_field: str, root: Optional[Path] = None):
        missing = [f for f in (text_field, image_field) if f not in rows.column_names]
        if missing:
            raise DataError(f"the image-text corpus has columns {rows.column_names}, not {missing} "
                            "(data.text_field / data.image_field)")
        self.rows, self.text_field, self.image_field, self.root = rows, text_field, image_field, root

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> list[Any]:
        row = self.rows[index]
        text, images = row[self.text_field] or "", row[self.image_field]
        images = [] if images is None else list(images) if isinstance(images, (list, tuple)) else [images]
        # a path becomes a {"path"} record, so that only text is a str among the segments
        root = self.root or Path()
        images = [{"path": str(root / im)} if isinstance(im, str) else im for im in images]
        return interleave(text, images, f"image-text document {index}")


def load_image_corpus(cfg: DataConfig):
    """(train, validation) documents of data.image_source (conf/data.py)."""
    if cfg.image_source == "digits":
        held_out = max(1, round(cfg.image_documents * cfg.val_fraction))
        return DigitCorpus(cfg.image_documents, cfg.split_seed), DigitCorpus(held_out, cfg.split_seed + 1)
    source = Path(cfg.image_source).expanduser()
    root = None
    if source.is_dir() and not any(source.glob("*.jsonl")) and not any(source.glob("*.parquet")):
        rows = datasets.load_dataset("imagefolder", data_dir=str(source), split="train")
        image_field = "image"
    elif source.exists():
        files = [source]
        if source.is_dir():
            files = sorted(source.glob("*.jsonl")) + sorted(source.glob("*.parquet"))
        kind = "parquet" if files[0].suffix == ".parquet" else "json"
        rows = datasets.load_dataset(kind, data_files=[str(f) for f in files], split="train")
        image_field, root = cfg.image_field, files[0].parent
    else:
        rows = datasets.load_dataset(cfg.image_source, split=cfg.hub_split)
        image_field = cfg.image_field
    train, val = split_documents(rows, cfg)
    return (RecordCorpus(train, cfg.text_field, image_field, root),
            RecordCorpus(val, cfg.text_field, image_field, root))


class ImageTextDataset:
    """Packed rows of image-text documents (module docstring), served like data.packing.PackedDataset:
    `get_batch(indices)` -> a collated batch. The rows are planned from the documents' lengths (text
    tokens, and span lengths from the images' sizes); images are decoded and patched when served."""

    def __init__(self, corpus, tokenizer, model_cfg: ModelConfig, seq_len: int):
        self.corpus, self.tokenizer, self.model_cfg, self.seq_len = corpus, tokenizer, model_cfg, seq_len
        self.image_token_id = (tokenizer.pad_id if model_cfg.image_token_id is None
                               else model_cfg.image_token_id)
        self.rows: list[list[int]] = []
        used = seq_len + 1
        for index in range(len(corpus)):
            n = self._length(corpus[index])
            if n > seq_len + 1:
                raise DataError(f"image-text document {index} has {n} tokens, more than data.seq_len="
                                f"{seq_len} + 1: images are never cut, so raise seq_len or shrink the images")
            if used + n > seq_len + 1:
                self.rows.append([])
                used = 0
            self.rows[-1].append(index)
            used += n

    def _length(self, segments: Sequence[Any]) -> int:
        n = 2  # BOS, EOS
        for seg in segments:
            if isinstance(seg, str):
                n += len(self.tokenizer.encode(seg))
            else:
                n += len(plan_image(seg, self.model_cfg)[1])
        return n

    def __len__(self) -> int:
        return len(self.rows)

    def get_batch(self, indices: Sequence[int]) -> dict[str, Any]:
        tok = self.tokenizer
        rows = []
        for i in indices:
            docs = [encode_document(self.corpus[j], tok, self.model_cfg, tok.bos_id, tok.eos_id,
                                    self.image_token_id) for j in self.rows[i]]
            rows += pack_documents(docs, self.seq_len, tok.pad_id)
        return collate(rows)
