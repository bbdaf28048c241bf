"""Reading a corpus into a `datasets.Dataset` of documents: one column ``text``, one row per document.

Local corpora (``stdlib`` and ``files``) are read by a generator through `Dataset.from_generator`, which
lets every record be validated with an error naming its file and line, and caches the result as Arrow
under ``<cache_dir>/hf``. Hub corpora go through `datasets.load_dataset` and its own cache.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
from datasets.exceptions import DatasetGenerationError

from data.errors import DataError

if TYPE_CHECKING:
    from conf.data import DataConfig

# Files whose whole content is one document, and files holding one document per record.
TEXT_SUFFIXES = (".txt", ".py", ".md")
RECORD_SUFFIXES = (".jsonl", ".json", ".parquet")
SUPPORTED_SUFFIXES = TEXT_SUFFIXES + RECORD_SUFFIXES

# Third-party packages and the test suites are not "the standard library" and would dominate it.
_STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib"})

_FEATURES = datasets.Features({"text": datasets.Value("string")})

# Bump when the mapping from files to documents changes, so that cached corpora are rebuilt.
_FORMAT_VERSION = 1


def stable_hash(value: Any) -> str:
    """Short hex digest of a JSON-serialisable value, identical across processes and machines.

    Every cache key of the pipeline (corpus, tokenizer, tokenized and packed splits) is built with it.
    """
    payload = json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(payload).hexdigest()[:16]


@contextlib.contextmanager
def cache_lock(path: Path, timeout_s: float, what: str):
    """Hold the lock that makes one process build cache entry `path` while the others wait. An OS
    file lock: a killed holder releases it at once. A holder that is alive but stuck is waited for
    `timeout_s` at most, then the wait ends in one line naming the lock."""
    from filelock import FileLock, Timeout

    lock = f"{path}.lock"
    try:
        with FileLock(lock, timeout=timeout_s):
            yield
    except Timeout:
        raise DataError(f"waited {timeout_s:g} s for {lock}: another process holds it while it builds the "
                        f"{what}; stop that process or raise data.lock_timeout_s") from None


def load_documents(cfg: DataConfig) -> datasets.Dataset:
    """The corpus described by `cfg` as a dataset with one non-empty ``text`` per row, in a fixed order.

    Whitespace-only documents are dropped (they carry nothing to learn), then `cfg.max_documents` keeps
    the first documents of that order. The dataset's fingerprint identifies the content and keys caches.
    """
    if cfg.max_documents is not None and cfg.max_documents < 1:
        raise DataError(f"data.max_documents must be at least 1 or None, got {cfg.max_documents}")
    if cfg.name == "stdlib":
        if cfg.path:  # a path with the default corpus kind: reading stdlib would silently ignore it
            raise DataError(f"data.path={cfg.path!r} is set but data.name is 'stdlib', which reads no path: "
                            "choose the corpus kind with data=files (local files) or data=hub")
        root = Path(sysconfig.get_paths()["stdlib"])
        return _load_files(_files_under(root, (".py",), _STDLIB_EXCLUDED_DIRS), cfg, source=str(root))
    if cfg.name == "files":
        path = _required_path(cfg)
        return _load_files(_resolve_files(path), cfg, source=path)
    if cfg.name == "hub":
        return _load_hub(cfg)
    raise DataError(f"data.name must be 'stdlib', 'files' or 'hub', got {cfg.name!r}")


def _required_path(cfg: DataConfig) -> str:
    if not cfg.path:
        raise DataError(f"data.path is required when data.name is {cfg.name!r}")
    return cfg.path


def _files_under(
    root: Path, suffixes: tuple[str, ...], excluded_dirs: frozenset[str] = frozenset()
) -> list[Path]:
    """Files under `root` with one of `suffixes`, sorted by relative path (not by directory listing order)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place keeps os.walk out of excluded and hidden trees (.git, site-packages) entirely.
        dirnames[:] = [d for d in dirnames if d not in excluded_dirs and not d.startswith(".")]
        found += [
            Path(dirpath, name)
            for name in filenames
            if name.lower().endswith(suffixes) and not name.startswith(".")
        ]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _resolve_files(path: str) -> list[Path]:
    """The corpus files named by `path`: a file, a directory (searched recursively) or a glob."""
    expanded = os.path.expanduser(path)
    if os.path.exists(expanded):  # checked first: a real name may contain "[" or "*"
        matches = [Path(expanded)]
    elif any(char in expanded for char in "*?["):
        matches = [Path(match) for match in sorted(glob.glob(expanded, recursive=True))]
        if not matches:
            raise DataError(f"data.path glob {path!r} matches no files")
    else:
        raise DataError(f"data.path {path!r} does not exist")

    files: list[Path] = []
    for match in matches:
        if match.is_dir():
            files += _files_under(match, SUPPORTED_SUFFIXES)
        elif match.name.lower().endswith(SUPPORTED_SUFFIXES):
            files.append(match)
        else:
            raise DataError(f"{match}: unsupported file type (supported: {', '.join(SUPPORTED_SUFFIXES)})")
    if not files:
        raise DataError(f"data.path {path!r} contains no {', '.join(SUPPORTED_SUFFIXES)} files")
    # A glob can reach one file twice (directly and through its directory); read it once.
    return list(dict.fromkeys(f.resolve() for f in files))


def _load_files(files: list[Path], cfg: DataConfig, source: str) -> datasets.Dataset:
    # Keyed by file metadata rather than content: hashing a large corpus on every start would cost
    # as much as reading it, and (size, mtime) changes whenever a file is rewritten.
    stats = [(str(f), st.st_size, st.st_mtime_ns) for f in files for st in (f.stat(),)]
    fingerprint = stable_hash(
        {
            "version": _FORMAT_VERSION,
            "files": stats,
            "text_field": cfg.text_field,
            "max_documents": cfg.max_documents,
        }
    )
    try:
        return datasets.Dataset.from_generator(
            _generate_documents,
            features=_FEATURES,
            # A tuple, not a list: `datasets` would shard a list across generator calls, and the
            # document cap and the empty-corpus check need to see all files in one pass.
            gen_kwargs={
                "files": tuple(str(f) for f in files),
                "text_field": cfg.text_field,
                "limit": cfg.max_documents,
                "source": source,
            },
            cache_dir=str(Path(cfg.cache_dir).expanduser() / "hf"),
            fingerprint=fingerprint,
        )
    except DatasetGenerationError as error:
        # `datasets` wraps whatever the generator raises; surface our own one-line message.
        if isinstance(error.__cause__, DataError):
            raise error.__cause__ from None
        raise


def _generate_documents(
    files: tuple[str, ...], text_field: str, limit: int | None, source: str
) -> Iterator[dict[str, str]]:
    count = 0
    for file in files:
        for text in _read_texts(Path(file), text_field):
            if not text.strip():
                continue
            yield {"text": text}
            count += 1
            if count == limit:
                return
    if count == 0:
        raise DataError(f"corpus {source} contains no non-empty documents")


def _read_texts(path: Path, text_field: str) -> Iterator[str]:
    """The documents of one file (possibly empty strings, which the caller drops)."""
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        yield "".join(_utf8_lines(path))
    elif suffix == ".jsonl":
        yield from _json_lines(path, _utf8_lines(path), text_field)
    elif suffix == ".json":
        yield from _json_texts(path, text_field)
    else:
        yield from _parquet_texts(path, text_field)


def _utf8_lines(path: Path) -> Iterator[str]:
    try:
        with path.open(encoding="utf-8") as file:
            yield from file
    except UnicodeDecodeError as error:
        raise DataError(f"{path}: not valid UTF-8 ({error.reason})") from None


def _json_lines(path: Path, lines: Iterable[str], text_field: str) -> Iterator[str]:
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue  # blank lines, e.g. a trailing newline, are not records
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(f"{path}:{number}: not valid JSON ({error.msg})") from None
        yield _text_of(record, text_field, f"{path}:{number}")


def _json_texts(path: Path, text_field: str) -> Iterator[str]:
    """A ``.json`` file is either one array of records or, as often on the Hub, JSON Lines."""
    content = "".join(_utf8_lines(path))
    if not content.lstrip().startswith("["):
        yield from _json_lines(path, content.split("\n"), text_field)
        return
    try:
        records = json.loads(content)
    except json.JSONDecodeError as error:
        raise DataError(f"{path}:{error.lineno}: not valid JSON ({error.msg})") from None
    for index, record in enumerate(records):
        yield _text_of(record, text_field, f"{path}[{index}]")


def _text_of(record: object, text_field: str, where: str) -> str:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if text_field not in record:
        raise DataError(f"{where}: no field {text_field!r} (data.text_field)")
    value = record[text_field]
    if value is None:
        return ""  # an explicit null is an empty document, dropped like one
    if not isinstance(value, str):
        raise DataError(f"{where}: field {text_field!r} is a {type(value).__name__}, not a string")
    return value


def _parquet_texts(path: Path, text_field: str) -> Iterator[str]:
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as error:
        raise DataError(f"{path}: not a readable parquet file ({error})") from None
    schema = parquet.schema_arrow
    if text_field not in schema.names:
        raise DataError(f"{path}: no column {text_field!r} (data.text_field); columns: {schema.names}")
    column_type = schema.field(text_field).type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
        raise DataError(f"{path}: column {text_field!r} has type {column_type}, not string")
    for batch in parquet.iter_batches(columns=[text_field]):
        yield from (value or "" for value in batch.column(0).to_pylist())


def _load_hub(cfg: DataConfig) -> datasets.Dataset:
    path = _required_path(cfg)
    try:
        dataset = datasets.load_dataset(path, split=cfg.hub_split)
    except (FileNotFoundError, ConnectionError) as error:
        # ConnectionError includes `datasets`' offline-mode error for a dataset that is not cached.
        raise DataError(f"hub dataset {path!r} is not available: {error}") from None
    field = cfg.text_field
    if field not in dataset.column_names:
        raise DataError(
            f"hub dataset {path!r} (split {cfg.hub_split!r}) has no column {field!r} (data.text_field); "
            f"columns: {dataset.column_names}"
        )
    feature = dataset.features[field]
    if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")):
        raise DataError(f"hub dataset {path!r}: column {field!r} is {feature}, not a string column")

    # `_fingerprint` is how `datasets` identifies a dataset's content and history (it has no public
    # accessor). The transforms below get fingerprints derived from it, so that downstream cache keys
    # do not depend on how `datasets` would hash the lambda.
    key = stable_hash({"version": _FORMAT_VERSION, "hub": dataset._fingerprint, "field": field})
    texts = dataset.select_columns([field], new_fingerprint=f"{key}-column")
    if field != "text":
        texts = texts.rename_column(field, "text", new_fingerprint=f"{key}-renamed")
    texts = texts.filter(
        lambda batch: [bool(text and text.strip()) for text in batch],
        batched=True,
        input_columns="text",
        new_fingerprint=f"{key}-nonempty",
        desc="Dropping empty documents",
    )
    if len(texts) == 0:
        raise DataError(f"hub dataset {path!r} (split {cfg.hub_split!r}) has no non-empty {field!r} values")
    if cfg.max_documents is not None and cfg.max_documents < len(texts):
        texts = texts.select(range(cfg.max_documents), new_fingerprint=f"{key}-first{cfg.max_documents}")
    return texts
