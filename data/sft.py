"""Chat data for supervised fine-tuning: conversations -> token rows with assistant-only labels.

A conversation is encoded by `data.chat.ChatFormat` (system turn "Reasoning Effort: {effort}"
first) into ids and a loss mask that is True on assistant content and its <|end_of_turn|>.
Position i of a row predicts token i + 1, so a conversation of L tokens gives L - 1 positions:
inputs ids[:-1], labels ids[1:] where mask[1:] (the *target* is an assistant token), else -100.
Rows of `seq_len` positions hold several conversations (first fit, in a fixed order), each its
own document in `doc_ids`, so attention never crosses conversations; the rest of a row is
padding (pad id, label -100, a document of its own). A conversation longer than a row is cut
to `seq_len` positions (counted, and warned about).

Sources: the built-in set (problems of an `tasks` task with worked reasoning whose length
grows with the effort; offline and deterministic) or files / a hub dataset read through
`datasets.load_dataset`. Every malformed row raises `DataError` naming its file and row.

Images (a model with a vision tower): a system, user or tool turn's `content` may be a list of parts,
{"type": "text", "text": ...} and {"type": "image", "image": <path | bytes | datasets Image>}, in
reading order; or a row's `images` column (sft.images_field; one image or a list) puts its images at
the `<image>` markers of the turns' text, in order (no marker: before the first user turn's text).
Relative paths are read from the data file's directory. Each image becomes its span
(data/images.py: the public preprocessing and layout), whose positions are never labels. Row plans
come from the images' sizes; the pixels are decoded when a batch is served. A conversation cut to
one row is cut before an image span that would not fit whole, never inside one.
"""
from __future__ import annotations

import glob
import json
import logging
import os
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

import numpy as np
import torch

from conf.model import TEXT
from data.chat import EFFORT_MAX, EFFORT_MIN, ROLES, ChatFormat, Message
from data.errors import DataError
from data.images import IMAGE_MARKER, interleave, plan_image, prepare_image
from data.packing import IGNORE_INDEX

if TYPE_CHECKING:
    from conf.model import ModelConfig
    from conf.sft import EffortTiers, SFTDataConfig

logger = logging.getLogger(__name__)

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
PACK_WINDOW = 64  # open rows first fit searches (bounds packing time on large sets)


@dataclass
class Conversation:
    messages: list[Message]
    effort: Optional[int]  # None: the conversation brings its own system turn
    where: str  # "<file> row <n>": for error messages

    @property
    def images(self) -> list[Any]:
        return [image for m in self.messages for image in m.images]


# ---------------------------------------------------------------------------------- efforts
def tier_efforts(tiers: EffortTiers, names: Sequence[str]) -> list[int]:
    """The effort values of the tier `names` (sft.tiers), checked."""
    known = {"low": tiers.low, "high": tiers.high, "max": tiers.max}
    for name, value in known.items():
        if not EFFORT_MIN <= value <= EFFORT_MAX:
            raise DataError(f"efforts.{name}={value} is outside {EFFORT_MIN}-{EFFORT_MAX}")
    if not names:
        raise DataError("sft.tiers is empty: no effort to give conversations without one")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise DataError(f"sft.tiers: unknown tier(s) {unknown} (known: {', '.join(known)})")
    return [known[n] for n in names]


def parse_effort(value: Any, tiers: EffortTiers, where: str) -> int:
    """A row's effort: an int 1-100 (or its string) or a tier name."""
    names = {"low": tiers.low, "high": tiers.high, "max": tiers.max}
    effort: Optional[int] = None
    if isinstance(value, str):
        text = value.strip()
        effort = names.get(text.lower(), int(text) if text.isdigit() else None)
    elif isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
        effort = int(value) if float(value).is_integer() else None
    if effort is None or not EFFORT_MIN <= effort <= EFFORT_MAX:
        raise DataError(f"{where}: effort {value!r} is not an integer {EFFORT_MIN}-{EFFORT_MAX} or a tier "
                        f"name ({', '.join(names)})")
    return effort


# ---------------------------------------------------------------------------------- rows
def _text(value: Any, what: str, where: str, optional: bool = False) -> Optional[str]:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        got = "missing" if value is None else f"a {type(value).__name__}"
        raise DataError(f"{where}: {what} is {got}, expected a string")
    return value


def image_source(value: Any, what: str, root: Optional[Path]) -> Any:
    """An image of a row as data/images.open_image reads it: a path (relative to `root`) as a {"path"}
    record, checked to exist; bytes, a datasets Image record or a PIL image as they are."""
    from PIL import Image

    path = value.get("path") if isinstance(value, dict) and not value.get("bytes") else value
    if isinstance(path, (str, os.PathLike)):
        full = Path(path).expanduser()
        full = full if full.is_absolute() or root is None else root / full
        if not full.is_file():
            raise DataError(f"{what}: image file {full} does not exist")
        return {"path": str(full)}
    if isinstance(value, (bytes, bytearray, Image.Image)) or (isinstance(value, dict) and value.get("bytes")):
        return value
    got = "missing" if value is None else f"a {type(value).__name__}"
    raise DataError(f"{what}: the image is {got}, expected a path, bytes or an image record")


def _content(value: Any, i: int, role: str, where: str, root: Optional[Path]) -> Union[str, list[Any]]:
    """A message's content: a string, or text and image parts -> segments (data/chat.py)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, (list, tuple)):
        got = "missing" if value is None else f"a {type(value).__name__}"
        raise DataError(f"{where}: message {i}'s content is {got}, expected a string or a list of text and "
                        "image parts")
    segments: list[Any] = []
    for j, part in enumerate(value):
        what = f"{where}: message {i} part {j}"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            segments.append(_text(part.get("text"), f"message {i} part {j}'s text", where))
        elif kind == "image":
            if role == "assistant":
                raise DataError(f"{what} is an image in an assistant turn: images go in system, user or tool "
                                "turns")
            segments.append(image_source(part.get("image", part.get("path")), what, root))
        elif isinstance(part, dict):
            raise DataError(f"{what} has type {kind!r} (expected text or image)")
        else:
            raise DataError(f"{what} is a {type(part).__name__}, expected an object with a type (text or "
                            "image)")
    if all(isinstance(seg, str) for seg in segments):  # text parts only: the text
        return "".join(segments)
    return segments


def parse_messages(value: Any, where: str, field_name: str, root: Optional[Path] = None) -> list[Message]:
    if value is None:
        raise DataError(f"{where}: no {field_name!r} field (sft.messages_field)")
    if not isinstance(value, (list, tuple)) or not value:
        raise DataError(f"{where}: {field_name!r} must be a non-empty list of messages")
    messages = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise DataError(f"{where}: message {i} is a {type(m).__name__}, expected an object with role and "
                            "content")
        role = m.get("role")
        if role not in ROLES:
            raise DataError(f"{where}: message {i} has role {role!r} (expected one of {', '.join(ROLES)})")
        content = _content(m.get("content"), i, role, where, root)
        reasoning = _text(m.get("reasoning"), f"message {i}'s reasoning", where, optional=True)
        if reasoning is not None and role != "assistant":
            raise DataError(f"{where}: message {i} ({role}) has reasoning; only assistant turns do")
        messages.append(Message(role, content, reasoning))
    return messages


def place_images(messages: list[Message], images: Any, where: str, root: Optional[Path]) -> list[Message]:
    """A row's images column at the IMAGE_MARKERs of its turns' text, in order; without markers,
    before the first user turn's text."""
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    if not images:
        return messages
    if any(m.images for m in messages):
        raise DataError(f"{where}: has both image parts in its messages and an images column; use one")
    images = [image_source(im, f"{where}: image {k}", root) for k, im in enumerate(images)]
    counts = [m.content.count(IMAGE_MARKER) for m in messages]
    if sum(counts) == 0:
        first = next((i for i, m in enumerate(messages) if m.role == "user"), None)
        if first is None:
            raise DataError(f"{where}: has {len(images)} images but no user turn to put them in")
        counts[first] = len(images)
        messages[first] = Message("user", IMAGE_MARKER * len(images) + messages[first].content)
    if sum(counts) != len(images):
        raise DataError(f"{where}: {sum(counts)} {IMAGE_MARKER} markers in its messages but {len(images)} "
                        "images")
    out, taken = [], 0
    for i, (m, n) in enumerate(zip(messages, counts)):
        if n and m.role == "assistant":
            raise DataError(f"{where}: message {i} (assistant) has an {IMAGE_MARKER} marker: images go in "
                            "system, user or tool turns")
        out.append(Message(m.role, interleave(m.content, images[taken:taken + n], f"{where}: message {i}"),
                           m.reasoning) if n else m)
        taken += n
    return out


def parse_row(row: dict[str, Any], cfg: SFTDataConfig, tiers: EffortTiers, where: str,
              draw_effort, root: Optional[Path] = None) -> Conversation:
    """One record (messages or flat schema) -> a Conversation; `draw_effort()` for rows without one.
    Relative image paths are read from `root`."""
    if cfg.prompt_field:
        prompt = _text(row.get(cfg.prompt_field), f"field {cfg.prompt_field!r} (sft.prompt_field)", where)
        response = _text(row.get(cfg.response_field), f"field {cfg.response_field!r} (sft.response_field)",
                         where)
        reasoning = (_text(row.get(cfg.reasoning_field), f"field {cfg.reasoning_field!r}", where,
                           optional=True)
                     if cfg.reasoning_field else None)
        messages = [Message("user", prompt), Message("assistant", response, reasoning)]
    else:
        messages = parse_messages(row.get(cfg.messages_field), where, cfg.messages_field, root)
    images = row.get(cfg.images_field) if cfg.images_field else None
    if images is not None:
        messages = place_images(messages, images, where, root)
    if not any(m.role == "assistant" for m in messages):
        raise DataError(f"{where}: no assistant turn (nothing to train on)")
    raw = row.get(cfg.effort_field) if cfg.effort_field else None
    has_system = any(m.role == "system" for m in messages)
    if has_system:
        if raw is not None:
            raise DataError(f"{where}: has both a system turn and an effort; the effort goes into the system "
                            "prompt")
        return Conversation(messages, None, where)
    effort = parse_effort(raw, tiers, where) if raw is not None else draw_effort()
    return Conversation(messages, effort, where)


# ---------------------------------------------------------------------------------- sources
def resolve_files(source: str) -> Optional[list[Path]]:
    """The files `source` names (a file, a directory, a glob), or None when it names none (a hub name)."""
    expanded = os.path.expanduser(source)
    if os.path.isdir(expanded):
        files = sorted(p for p in Path(expanded).rglob("*")
                       if p.suffix.lower() in FILE_BUILDERS and p.is_file())
        if not files:
            raise DataError(f"sft.source {source!r}: no {', '.join(FILE_BUILDERS)} files in that directory")
        return files
    if os.path.isfile(expanded):
        matches = [Path(expanded)]
    elif any(c in expanded for c in "*?["):
        matches = sorted(Path(m) for m in glob.glob(expanded, recursive=True) if os.path.isfile(m))
        if not matches:
            raise DataError(f"sft.source glob {source!r} matches no files")
    elif (expanded.lower().endswith(tuple(FILE_BUILDERS))
          or (os.sep in expanded and not _looks_like_hub(source))):
        raise DataError(f"sft.source {source!r} does not exist")
    else:
        return None
    bad = [str(m) for m in matches if m.suffix.lower() not in FILE_BUILDERS]
    if bad:
        raise DataError(f"{bad[0]}: unsupported file type for SFT data (supported: "
                        f"{', '.join(FILE_BUILDERS)})")
    return matches


def _looks_like_hub(source: str) -> bool:
    """`owner/name`: one slash, no leading dot or slash."""
    return source.count("/") == 1 and not source.startswith((".", "/", "~"))


def _first_bad_json_line(path: Path) -> Optional[str]:
    """Where a .jsonl / .json file stops being JSON (JSON Lines, or one array), if it does."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        return f"{path}: not valid UTF-8 ({e.reason})"
    if text.lstrip().startswith("["):
        try:
            json.loads(text)
        except json.JSONDecodeError as e:
            return f"{path}:{e.lineno}: not valid JSON ({e.msg})"
        return None
    for number, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            try:
                json.loads(line)
            except json.JSONDecodeError as e:
                return f"{path}:{number}: not valid JSON ({e.msg})"
    return None


def _one_line(error: BaseException) -> str:
    seen, e = [], error
    while e is not None and e not in seen:  # the innermost cause says most
        seen.append(e)
        e = e.__cause__ or e.__context__
    for err in reversed(seen):
        text = str(err).strip()
        if text:
            return f"{type(err).__name__}: {text.splitlines()[0]}"
    return type(error).__name__


def _load_file(path: Path, cache_dir: Optional[str]):
    import logging

    import datasets

    # the JSON builder logs its own parse error (with a 0-based row of its own counting) before it
    # raises; the error below names the file and line once
    quiet = logging.getLogger("datasets.packaged_modules.json.json")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    kind = FILE_BUILDERS[path.suffix.lower()]
    try:
        dataset = datasets.load_dataset(kind, data_files=str(path), split="train", cache_dir=cache_dir)
    except Exception as error:  # `datasets` wraps parse errors in several types: name the file, one line
        precise = _first_bad_json_line(path) if kind == "json" else None
        raise DataError(precise or f"{path}: datasets could not read it ({_one_line(error)})") from None
    finally:
        quiet.setLevel(level)
    if kind == "json" and _mixes_types(dataset.features):
        # a field that is a string in some rows and a list in others (message contents as text in
        # some turns, as text and image parts in others): datasets keeps it as JSON text and reads a
        # string such as "42" back as the number 42, so such a file is read as it is written
        return JsonRows.read(path)
    return dataset


def _mixes_types(feature) -> bool:
    """Whether a datasets feature holds a field of mixed types (datasets' Json feature)."""
    if type(feature).__name__ == "Json":
        return True
    if isinstance(feature, dict):
        return any(_mixes_types(f) for f in feature.values())
    inner = getattr(feature, "feature", None)
    return inner is not None and _mixes_types(inner)


class JsonRows(list):
    """The rows of a JSON Lines file or a JSON array, as written (dicts), with `column_names`."""

    @classmethod
    def read(cls, path: Path) -> JsonRows:
        text = path.read_text(encoding="utf-8")  # valid: datasets has read it
        if text.lstrip().startswith("["):
            rows = json.loads(text)
        else:
            rows = [json.loads(line) for line in text.split("\n") if line.strip()]
        out = cls(rows)
        bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), None)
        if bad is not None:
            raise DataError(f"{path} row {bad + 1}: a row must be a JSON object, got "
                            f"{type(rows[bad]).__name__}")
        out.column_names = list(dict.fromkeys(k for r in rows for k in r))
        return out


def _load_hub(cfg: SFTDataConfig, cache_dir: Optional[str]):
    import datasets

    try:
        return datasets.load_dataset(cfg.source, split=cfg.hub_split, cache_dir=cache_dir)
    except Exception as error:
        raise DataError(f"sft.source {cfg.source!r} (split {cfg.hub_split!r}) is not available: "
                        f"{_one_line(error)}") from None


def _rows(dataset) -> Iterator[dict[str, Any]]:
    if isinstance(dataset, JsonRows):
        yield from dataset
        return
    for batch in dataset.iter(batch_size=1000):
        keys = list(batch)
        for values in zip(*(batch[k] for k in keys)):
            yield dict(zip(keys, values))


def file_conversations(cfg: SFTDataConfig, tiers: EffortTiers,
                       cache_dir: Optional[str] = None) -> list[Conversation]:
    """Every conversation of sft.source (files or a `datasets` name), in source order."""
    efforts = tier_efforts(tiers, cfg.tiers)
    rng = random.Random(cfg.split_seed)

    def draw() -> int:
        return rng.choice(efforts)

    files = resolve_files(cfg.source)
    sources: Iterable[tuple[str, Any]] = (
        ((str(f), _load_file(f, cache_dir)) for f in files) if files is not None
        else [(f"{cfg.source} ({cfg.hub_split})", _load_hub(cfg, cache_dir))])
    out: list[Conversation] = []
    for name, dataset in sources:
        if not cfg.prompt_field and cfg.messages_field not in dataset.column_names:
            raise DataError(f"{name}: no column {cfg.messages_field!r} (sft.messages_field; or set "
                            f"sft.prompt_field for the flat schema); columns: {dataset.column_names}")
        root = Path(name).parent if files is not None else None  # relative image paths: beside the file
        for i, row in enumerate(_rows(dataset)):
            out.append(parse_row(row, cfg, tiers, f"{name} row {i + 1}", draw, root))
            if cfg.max_samples is not None and len(out) >= cfg.max_samples:
                return out
    if not out:
        raise DataError(f"sft.source {cfg.source!r} holds no conversations")
    return out


def load_sft_task(name: str, kwargs: Optional[dict[str, Any]] = None):
    """The tasks task `name` (a built-in name or a dotted path), as a DataError if it cannot be had."""
    try:
        from tasks import load_task
    except ImportError as e:
        raise DataError(f"the built-in SFT set needs tasks, which cannot be imported ({e})") from None
    try:
        return load_task(name, **dict(kwargs or {}))
    except (KeyError, ValueError) as e:
        raise DataError(f"sft.builtin_task={name!r}: {e}") from None


def heldout_problems(task, count: int, seed: int) -> list:
    """The first `count` distinct problems (by prompt) drawn from `seed`: the generation eval's
    problems, which the built-in set never contains. Fewer when the task has fewer."""
    problems, prompts = [], set()
    for i in range(100 * count):
        if len(problems) == count:
            break
        problem = task.sample(random.Random(seed * 1_000_003 + i))
        if problem.prompt not in prompts:
            prompts.add(problem.prompt)
            problems.append(problem)
    return problems


def builtin_conversations(task, count: int, seed: int, efforts: Sequence[int],
                          exclude: frozenset[str] = frozenset()) -> list[Conversation]:
    """`count` problems of `task`, each at an effort drawn from `efforts`: user prompt, then the
    task's worked reasoning (longer at higher effort) and its answer. Conversation i depends on
    (seed, i) and `exclude` (prompts held out, redrawn) only."""
    out = []
    for i in range(count):
        rng = random.Random(seed * 1_000_003 + i)
        problem = task.sample(rng)
        redraws = 0
        while problem.prompt in exclude:
            redraws += 1
            if redraws > 1000:
                raise DataError(f"sft.builtin_task={task_name(task)}: nearly every problem is held out for "
                                "the generation eval; lower eval.problems or widen the task")
            problem = task.sample(rng)
        effort = rng.choice(list(efforts))
        out.append(Conversation([Message("user", problem.prompt),
                                 Message("assistant", task.answer_text(problem),
                                         task.reasoning(problem, effort))],
                                effort, f"built-in {task_name(task)} sample {i}"))
    return out


def task_name(task) -> str:
    return getattr(task, "name", type(task).__name__)


def load_conversations(cfg: SFTDataConfig, tiers: EffortTiers, cache_dir: Optional[str] = None,
                       exclude: frozenset[str] = frozenset()) -> list[Conversation]:
    """The conversations of sft.source; `exclude`: prompts the built-in set must not contain."""
    if cfg.max_samples is not None and cfg.max_samples < 1:
        raise DataError(f"sft.max_samples must be at least 1 or None, got {cfg.max_samples}")
    if cfg.source == "builtin":
        if cfg.builtin_samples < 2:
            raise DataError(f"sft.builtin_samples={cfg.builtin_samples}: need at least 2 (train and "
                            "validation)")
        count = min(cfg.builtin_samples, cfg.max_samples or cfg.builtin_samples)
        return builtin_conversations(load_sft_task(cfg.builtin_task, cfg.builtin_task_kwargs), count,
                                     cfg.builtin_seed, tier_efforts(tiers, cfg.tiers), exclude)
    return file_conversations(cfg, tiers, cache_dir)


# ---------------------------------------------------------------------------------- encoding
def example(ids: Sequence[int], mask: Sequence[bool]) -> tuple[np.ndarray, np.ndarray]:
    """A conversation's (inputs, labels): position i reads ids[i] and is trained on ids[i + 1]
    exactly when that target is an assistant token."""
    ids_a = np.asarray(ids, dtype=np.int64)
    mask_a = np.asarray(mask, dtype=bool)
    return ids_a[:-1], np.where(mask_a[1:], ids_a[1:], IGNORE_INDEX)


@dataclass
class ImageSlot:
    """An image of a conversation: its source, where its span starts, its planned patch grid and its
    span's length."""
    source: Any
    start: int
    grid: tuple[int, int]
    span: int


@dataclass
class Vision:
    """What image conversations are encoded for: the model's vision settings and the span id."""
    model_cfg: ModelConfig
    image_token_id: int


@dataclass
class EncodedConversation:
    ids: list[int]
    mask: list[bool]  # in the loss (data/chat.py)
    types: list[int]  # conf.model's TEXT or an image-span type
    images: list[ImageSlot]


def encode_conversation(chat: ChatFormat, conv: Conversation,
                        vision: Optional[Vision]) -> EncodedConversation:
    """A conversation's ids, loss mask, token types and image slots; each image's span laid out from
    its size (data/images.plan_image), its positions never in the loss."""
    out = EncodedConversation([], [], [], [])
    for piece in chat.pieces(conv.messages, conv.effort):
        if isinstance(piece, tuple):
            ids, trained = piece
            out.ids += ids
            out.mask += [trained] * len(ids)
            out.types += [TEXT] * len(ids)
            continue
        if vision is None:
            raise DataError("has images, but the model has no vision tower (model.vision_n_layers=0)")
        grid, types = plan_image(piece, vision.model_cfg)
        out.images.append(ImageSlot(piece, len(out.ids), grid, len(types)))
        out.ids += [vision.image_token_id] * len(types)
        out.mask += [False] * len(types)
        out.types += types
    return out


def cut(conv: EncodedConversation, length: int) -> EncodedConversation:
    """The first `length` tokens, or fewer: an image span that would not lie whole within the inputs
    (all but the last token) is left out, and everything after it."""
    for image in conv.images:
        if image.start < length <= image.start + image.span:
            length = image.start
            break
    return EncodedConversation(conv.ids[:length], conv.mask[:length], conv.types[:length],
                               [im for im in conv.images if im.start < length])


@dataclass
class SFTStats:
    conversations: int = 0
    rows: int = 0
    truncated: int = 0  # conversations cut to one row
    dropped: int = 0  # cut so short that no assistant token was left
    positions: int = 0  # non-padding positions
    assistant_tokens: int = 0  # labelled positions
    images: int = 0  # images in the rows
    efforts: dict[int, int] = field(default_factory=dict)  # conversations per effort
    seq_len: int = 0

    @property
    def fill(self) -> float:
        """Share of the rows' positions that hold conversation tokens (the rest is padding)."""
        return self.positions / max(1, self.rows * self.seq_len)


@dataclass
class Example:
    inputs: np.ndarray  # [n] ids
    labels: np.ndarray  # [n]
    types: Optional[np.ndarray] = None  # [n] token types; None: all text
    images: list[ImageSlot] = field(default_factory=list)


@dataclass
class PackedRows:
    input_ids: np.ndarray  # [rows, seq_len] int32
    labels: np.ndarray
    doc_ids: np.ndarray
    token_types: Optional[np.ndarray]  # [rows, seq_len] int8, or None when no row has an image
    images: list[list[ImageSlot]]  # per row, each start the span's position in the row


class SFTDataset(torch.utils.data.Dataset):
    """Rows of `seq_len` positions: ``input_ids``, ``labels`` (int64) and ``doc_ids`` (int32), the
    interface `PackedDataset` offers (`__len__`, `get_batch`, `__getitem__`, `seq_len`). With images:
    also ``token_types`` and the images' patches, grids, rows and span starts (data/images.collate's
    fields), the images decoded and patched when their rows are served."""

    def __init__(self, rows: PackedRows, stats: SFTStats, model_cfg: Optional[ModelConfig] = None):
        self.input_ids, self.labels, self.doc_ids = rows.input_ids, rows.labels, rows.doc_ids
        self.token_types, self.images = rows.token_types, rows.images
        self.stats, self.model_cfg = stats, model_cfg
        self.seq_len = self.input_ids.shape[1]

    @property
    def has_images(self) -> bool:
        return self.token_types is not None

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {name: values[0] for name, values in self.get_batch([index]).items()
                if isinstance(values, torch.Tensor)}

    def get_batch(self, indices: Sequence[int]) -> dict[str, Any]:
        idx = np.asarray(list(indices), dtype=np.int64)
        batch: dict[str, Any] = {"input_ids": torch.from_numpy(self.input_ids[idx].astype(np.int64)),
                                 "labels": torch.from_numpy(self.labels[idx].astype(np.int64)),
                                 "doc_ids": torch.from_numpy(self.doc_ids[idx].astype(np.int32))}
        if self.token_types is None:
            return batch
        batch["token_types"] = torch.from_numpy(self.token_types[idx].astype(np.int64))
        patches, grids, rows, starts = [], [], [], []
        for row, i in enumerate(idx.tolist()):
            for slot in self.images[i]:
                image = prepare_image(slot.source, self.model_cfg)
                if image.grid != slot.grid:
                    raise DataError(f"an image of row {i} changed since the SFT data was read: patch grid "
                                    f"{image.grid}, planned {slot.grid}")
                patches.append(image.patches)
                grids.append(image.grid)
                rows.append(row)
                starts.append(slot.start)
        batch.update(image_patches=patches, image_grids=grids, image_rows=rows, image_starts=starts)
        return batch


def pack_examples(examples: Sequence[Example], seq_len: int, pad_id: int, pack: bool = True) -> PackedRows:
    """Place examples (each at most seq_len positions) into rows: first fit over the last
    PACK_WINDOW open rows, in the examples' order (pack=False: one per row)."""
    rows: list[list[int]] = []
    space: list[int] = []
    open_rows: list[int] = []
    for e, ex in enumerate(examples):
        n = len(ex.inputs)
        target = next((r for r in open_rows[-PACK_WINDOW:] if space[r] >= n), None) if pack else None
        if target is None:
            target = len(rows)
            rows.append([])
            space.append(seq_len)
            open_rows.append(target)
        rows[target].append(e)
        space[target] -= n
        if space[target] < 8:  # nothing useful fits any more
            open_rows.remove(target)
    input_ids = np.full((len(rows), seq_len), pad_id, dtype=np.int32)
    labels = np.full((len(rows), seq_len), IGNORE_INDEX, dtype=np.int32)
    doc_ids = np.zeros((len(rows), seq_len), dtype=np.int32)
    with_images = any(ex.types is not None for ex in examples)
    types = np.full((len(rows), seq_len), TEXT, dtype=np.int8) if with_images else None
    images: list[list[ImageSlot]] = [[] for _ in rows]
    for r, members in enumerate(rows):
        at = 0
        for d, e in enumerate(members):
            ex = examples[e]
            n = len(ex.inputs)
            input_ids[r, at:at + n] = ex.inputs
            labels[r, at:at + n] = ex.labels
            doc_ids[r, at:at + n] = d
            if ex.types is not None:
                types[r, at:at + n] = ex.types
            images[r] += [ImageSlot(im.source, at + im.start, im.grid, im.span) for im in ex.images]
            at += n
        doc_ids[r, at:] = len(members)  # padding: a document of its own
    return PackedRows(input_ids, labels, doc_ids, types, images)


def encode_split(conversations: Sequence[Conversation], chat: ChatFormat, seq_len: int, pack: bool,
                 split: str, vision: Optional[Vision] = None) -> SFTDataset:
    stats = SFTStats(conversations=len(conversations), seq_len=seq_len)
    examples = []
    for conv in conversations:
        try:
            enc = encode_conversation(chat, conv, vision)
        except DataError as e:
            raise DataError(f"{conv.where}: {e}") from None
        if len(enc.ids) > seq_len + 1:
            stats.truncated += 1
            enc = cut(enc, seq_len + 1)
        inputs, labels = example(enc.ids, enc.mask)
        if not (labels != IGNORE_INDEX).any():
            stats.dropped += 1
            continue
        # every span lies within the inputs: text follows it (the turn's <|end_of_turn|>), or the cut
        # left it out
        types = np.asarray(enc.types[:-1], dtype=np.int8) if enc.images else None
        examples.append(Example(inputs, labels, types, enc.images))
        stats.positions += len(inputs)
        stats.assistant_tokens += int((labels != IGNORE_INDEX).sum())
        stats.images += len(enc.images)
        if conv.effort is not None:
            stats.efforts[conv.effort] = stats.efforts.get(conv.effort, 0) + 1
    if not examples:
        raise DataError(f"the SFT {split} split has no conversation with an assistant token within "
                        f"sft.seq_len={seq_len}")
    rows = pack_examples(examples, seq_len, chat.tok.pad_id, pack)
    stats.rows = len(rows.input_ids)
    if stats.truncated:
        logger.warning("SFT %s split: %d of %d conversations are longer than sft.seq_len=%d and were "
                       "truncated%s",
                       split, stats.truncated, len(conversations), seq_len,
                       f" ({stats.dropped} dropped: no assistant token left)" if stats.dropped else "")
    return SFTDataset(rows, stats, vision.model_cfg if vision is not None else None)


def split_conversations(conversations: list[Conversation], val_fraction: float,
                        seed: int) -> tuple[list[Conversation], list[Conversation]]:
    if not 0 < val_fraction < 1:
        raise DataError(f"sft.val_fraction must be in (0, 1), got {val_fraction}")
    count = len(conversations)
    if count < 2:
        raise DataError(f"{count} conversation(s): a train/validation split needs at least 2")
    held_out = min(max(1, round(count * val_fraction)), count - 1)
    is_val = np.zeros(count, dtype=bool)
    is_val[np.random.default_rng(seed).permutation(count)[:held_out]] = True
    return ([c for c, v in zip(conversations, is_val) if not v],
            [c for c, v in zip(conversations, is_val) if v])


def build_sft_datasets(cfg: SFTDataConfig, tiers: EffortTiers, tokenizer, cache_dir: Optional[str] = None,
                       conversations: Optional[list[Conversation]] = None,
                       model_cfg: Optional[ModelConfig] = None) -> tuple[SFTDataset, SFTDataset]:
    """Train and validation rows of sft.source (or of `conversations`, already loaded), encoded
    with `tokenizer` (the pretraining one). `model_cfg`: a model with a vision tower, for image
    conversations (their spans' id: model.image_token_id, None: the tokenizer's pad id)."""
    if cfg.seq_len < 8:
        raise DataError(f"sft.seq_len must be at least 8, got {cfg.seq_len}")
    if conversations is None:
        conversations = load_conversations(cfg, tiers, cache_dir)
    train, val = split_conversations(conversations, cfg.val_fraction, cfg.split_seed)
    chat = ChatFormat(tokenizer)
    vision = None
    if model_cfg is not None and model_cfg.vision_n_layers > 0:
        span_id = tokenizer.pad_id if model_cfg.image_token_id is None else model_cfg.image_token_id
        vision = Vision(model_cfg, span_id)
    return (encode_split(train, chat, cfg.seq_len, cfg.pack, "train", vision),
            encode_split(val, chat, cfg.seq_len, cfg.pack, "validation", vision))
