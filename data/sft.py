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
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from data.chat import EFFORT_MAX, EFFORT_MIN, ROLES, ChatFormat, Message
from data.errors import DataError
from data.packing import IGNORE_INDEX

if TYPE_CHECKING:
    from conf.sft import EffortTiers, SFTDataConfig

logger = logging.getLogger(__name__)

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
PACK_WINDOW = 64  # open rows first fit searches (bounds packing time on large sets)


@dataclass
class Conversation:
    messages: list[Message]
    effort: Optional[int]  # None: the conversation brings its own system turn
    where: str  # "<file> row <n>": for error messages


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


def parse_messages(value: Any, where: str, field_name: str) -> list[Message]:
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
        content = _text(m.get("content"), f"message {i}'s content", where)
        reasoning = _text(m.get("reasoning"), f"message {i}'s reasoning", where, optional=True)
        if reasoning is not None and role != "assistant":
            raise DataError(f"{where}: message {i} ({role}) has reasoning; only assistant turns do")
        messages.append(Message(role, content, reasoning))
    return messages


def parse_row(row: dict[str, Any], cfg: SFTDataConfig, tiers: EffortTiers, where: str,
              draw_effort) -> Conversation:
    """One record (messages or flat schema) -> a Conversation; `draw_effort()` for rows without one."""
    if cfg.prompt_field:
        prompt = _text(row.get(cfg.prompt_field), f"field {cfg.prompt_field!r} (sft.prompt_field)", where)
        response = _text(row.get(cfg.response_field), f"field {cfg.response_field!r} (sft.response_field)",
                         where)
        reasoning = (_text(row.get(cfg.reasoning_field), f"field {cfg.reasoning_field!r}", where,
                           optional=True)
                     if cfg.reasoning_field else None)
        messages = [Message("user", prompt), Message("assistant", response, reasoning)]
    else:
        messages = parse_messages(row.get(cfg.messages_field), where, cfg.messages_field)
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
    try:
        return datasets.load_dataset(FILE_BUILDERS[path.suffix.lower()], data_files=str(path), split="train",
                                     cache_dir=cache_dir)
    except Exception as error:  # `datasets` wraps parse errors in several types: name the file, one line
        precise = _first_bad_json_line(path) if FILE_BUILDERS[path.suffix.lower()] == "json" else None
        raise DataError(precise or f"{path}: datasets could not read it ({_one_line(error)})") from None
    finally:
        quiet.setLevel(level)


def _load_hub(cfg: SFTDataConfig, cache_dir: Optional[str]):
    import datasets

    try:
        return datasets.load_dataset(cfg.source, split=cfg.hub_split, cache_dir=cache_dir)
    except Exception as error:
        raise DataError(f"sft.source {cfg.source!r} (split {cfg.hub_split!r}) is not available: "
                        f"{_one_line(error)}") from None


def _rows(dataset) -> Iterator[dict[str, Any]]:
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
        for i, row in enumerate(_rows(dataset)):
            out.append(parse_row(row, cfg, tiers, f"{name} row {i + 1}", draw))
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
class SFTStats:
    conversations: int = 0
    rows: int = 0
    truncated: int = 0  # conversations cut to one row
    dropped: int = 0  # cut so short that no assistant token was left
    positions: int = 0  # non-padding positions
    assistant_tokens: int = 0  # labelled positions
    efforts: dict[int, int] = field(default_factory=dict)  # conversations per effort
    seq_len: int = 0

    @property
    def fill(self) -> float:
        """Share of the rows' positions that hold conversation tokens (the rest is padding)."""
        return self.positions / max(1, self.rows * self.seq_len)


class SFTDataset(torch.utils.data.Dataset):
    """Rows of `seq_len` positions: ``input_ids``, ``labels`` (int64) and ``doc_ids`` (int32), the
    interface `PackedDataset` offers (`__len__`, `get_batch`, `__getitem__`, `seq_len`)."""

    def __init__(self, input_ids: np.ndarray, labels: np.ndarray, doc_ids: np.ndarray, stats: SFTStats):
        self.input_ids, self.labels, self.doc_ids, self.stats = input_ids, labels, doc_ids, stats
        self.seq_len = input_ids.shape[1]

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {name: values[0] for name, values in self.get_batch([index]).items()}

    def get_batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        idx = np.asarray(list(indices), dtype=np.int64)
        return {"input_ids": torch.from_numpy(self.input_ids[idx].astype(np.int64)),
                "labels": torch.from_numpy(self.labels[idx].astype(np.int64)),
                "doc_ids": torch.from_numpy(self.doc_ids[idx].astype(np.int32))}


def pack_examples(examples: Sequence[tuple[np.ndarray, np.ndarray]], seq_len: int, pad_id: int,
                  pack: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Place examples (each at most seq_len positions) into rows: first fit over the last
    PACK_WINDOW open rows, in the examples' order (pack=False: one per row)."""
    rows: list[list[int]] = []
    space: list[int] = []
    open_rows: list[int] = []
    for e, (inputs, _) in enumerate(examples):
        n = len(inputs)
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
    for r, members in enumerate(rows):
        at = 0
        for d, e in enumerate(members):
            inputs, targets = examples[e]
            input_ids[r, at:at + len(inputs)] = inputs
            labels[r, at:at + len(inputs)] = targets
            doc_ids[r, at:at + len(inputs)] = d
            at += len(inputs)
        doc_ids[r, at:] = len(members)  # padding: a document of its own
    return input_ids, labels, doc_ids


def encode_split(conversations: Sequence[Conversation], chat: ChatFormat, seq_len: int, pack: bool,
                 split: str) -> SFTDataset:
    stats = SFTStats(conversations=len(conversations), seq_len=seq_len)
    examples = []
    for conv in conversations:
        try:
            ids, mask = chat.encode(conv.messages, conv.effort)
        except DataError as e:
            raise DataError(f"{conv.where}: {e}") from None
        if len(ids) > seq_len + 1:
            stats.truncated += 1
            ids, mask = ids[:seq_len + 1], mask[:seq_len + 1]
        inputs, labels = example(ids, mask)
        if not (labels != IGNORE_INDEX).any():
            stats.dropped += 1
            continue
        examples.append((inputs, labels))
        stats.positions += len(inputs)
        stats.assistant_tokens += int((labels != IGNORE_INDEX).sum())
        if conv.effort is not None:
            stats.efforts[conv.effort] = stats.efforts.get(conv.effort, 0) + 1
    if not examples:
        raise DataError(f"the SFT {split} split has no conversation with an assistant token within "
                        f"sft.seq_len={seq_len}")
    arrays = pack_examples(examples, seq_len, chat.tok.pad_id, pack)
    stats.rows = len(arrays[0])
    if stats.truncated:
        logger.warning("SFT %s split: %d of %d conversations are longer than sft.seq_len=%d and were "
                       "truncated%s",
                       split, stats.truncated, len(conversations), seq_len,
                       f" ({stats.dropped} dropped: no assistant token left)" if stats.dropped else "")
    return SFTDataset(*arrays, stats)


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
                       conversations: Optional[list[Conversation]] = None) -> tuple[SFTDataset, SFTDataset]:
    """Train and validation rows of sft.source (or of `conversations`, already loaded), encoded
    with `tokenizer` (the pretraining one)."""
    if cfg.seq_len < 8:
        raise DataError(f"sft.seq_len must be at least 8, got {cfg.seq_len}")
    if conversations is None:
        conversations = load_conversations(cfg, tiers, cache_dir)
    train, val = split_conversations(conversations, cfg.val_fraction, cfg.split_seed)
    chat = ChatFormat(tokenizer)
    return (encode_split(train, chat, cfg.seq_len, cfg.pack, "train"),
            encode_split(val, chat, cfg.seq_len, cfg.pack, "validation"))
