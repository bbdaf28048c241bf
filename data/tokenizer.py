"""Byte-level BPE tokenizer: trained once per corpus, cached, and wrapped in a small interface."""

from __future__ import annotations

import hashlib
import logging
import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import datasets
import pyarrow.compute as pc
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from data.corpus import cache_lock, stable_hash
from data.errors import DataError

if TYPE_CHECKING:
    from conf.data import DataConfig

logger = logging.getLogger(__name__)

# Ids 0.. in this order in every trained tokenizer. The first three frame packed documents; the rest
# are reserved for chat and reasoning formats so that fine-tuning never has to grow the vocabulary.
SPECIAL_TOKENS = (
    "<|bos|>",
    "<|eos|>",
    "<|pad|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
    "<|end_of_turn|>",
    "<|think|>",
    "<|/think|>",
)

# BPE training time grows with the text it sees while merges stabilise long before; beyond this many
# bytes an evenly spread subset of the documents is used.
MAX_TRAIN_BYTES = 20 * 2**20

# Every byte must be a token for the byte-level model to encode arbitrary text.
_MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256

# Bump when training changes (pre-tokenizer, trainer options, sampling) so cached tokenizers are retrained.
_FORMAT_VERSION = 1


class TextTokenizer:
    """A `tokenizers.Tokenizer` with the special tokens of this project and a list-of-ids interface.

    Text is encoded literally: a special-token string inside a document (say ``"<|bos|>"`` in a file
    about tokenizers) becomes ordinary byte-level tokens, so data can never forge a document boundary
    or a chat role. Special tokens are inserted by id (`token_id`, `bos_id`, ...).
    """

    def __init__(self, tokenizer: Tokenizer, path: Path | None = None) -> None:
        missing = [token for token in SPECIAL_TOKENS if tokenizer.token_to_id(token) is None]
        if missing:
            raise DataError(f"tokenizer {path or '(in memory)'} lacks the special tokens {missing}")
        tokenizer.encode_special_tokens = True
        self.tokenizer = tokenizer
        self.path = path
        self.bos_id = self.token_id("<|bos|>")
        self.eos_id = self.token_id("<|eos|>")
        self.pad_id = self.token_id("<|pad|>")

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> TextTokenizer:
        """Load a ``tokenizer.json``."""
        path = Path(path).expanduser()
        if not path.is_file():
            raise DataError(f"tokenizer file {path} does not exist")
        return cls(Tokenizer.from_file(str(path)), path)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def fingerprint(self) -> str:
        """Digest of the serialised tokenizer: equal fingerprints encode text identically."""
        return hashlib.sha256(self.tokenizer.to_str().encode()).hexdigest()[:16]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encode many texts at once, in parallel across CPU cores."""
        return [encoding.ids for encoding in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int:
        token_id = self.tokenizer.token_to_id(token)
        if token_id is None:
            raise KeyError(f"{token!r} is not in the vocabulary")
        return token_id

    def id_to_token(self, token_id: int) -> str:
        token = self.tokenizer.id_to_token(token_id)
        if token is None:
            raise KeyError(f"token id {token_id} is outside the vocabulary of {self.vocab_size}")
        return token

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write ``tokenizer.json`` to `path`, which becomes this tokenizer's `path`."""
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(path))
        self.path = path


def load_or_train_tokenizer(cfg: DataConfig, documents: datasets.Dataset) -> TextTokenizer:
    """The tokenizer at `cfg.tokenizer_path`, or one trained on `documents` and cached by content.

    The cache file is ``<cache_dir>/tokenizers/<key>.json``, the key hashing the corpus fingerprint,
    the vocabulary size and the special tokens. A file lock makes concurrent processes (all ranks of a
    job starting at once) train it once; the others wait (data.lock_timeout_s at most) and load the result.
    """
    if cfg.tokenizer_path:
        tokenizer = TextTokenizer.from_file(cfg.tokenizer_path)
    else:
        key = stable_hash(
            {
                "version": _FORMAT_VERSION,
                "corpus": documents._fingerprint,
                "vocab_size": cfg.vocab_size,
                "special_tokens": SPECIAL_TOKENS,
                "max_train_bytes": MAX_TRAIN_BYTES,
            }
        )
        path = Path(cfg.cache_dir).expanduser() / "tokenizers" / f"{key}.json"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with cache_lock(path, cfg.lock_timeout_s, "tokenizer"):
                if not path.exists():  # another process may have trained it while we waited
                    trained = _train(documents, cfg.vocab_size)
                    # Written aside and renamed: a reader that skips the lock never sees half a file.
                    partial = path.with_suffix(".partial")
                    trained.save(str(partial))
                    os.replace(partial, path)
        tokenizer = TextTokenizer.from_file(path)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise DataError(
            f"tokenizer {tokenizer.path} has {tokenizer.vocab_size} tokens, more than data.vocab_size="
            f"{cfg.vocab_size} (the model's embedding size)"
        )
    return tokenizer


def _train(documents: datasets.Dataset, vocab_size: int) -> Tokenizer:
    """Train byte-level BPE; the same documents always give a byte-identical ``tokenizer.json``."""
    if vocab_size < _MIN_VOCAB_SIZE:
        raise DataError(
            f"data.vocab_size={vocab_size} is too small: the special tokens and 256 bytes need "
            f"{_MIN_VOCAB_SIZE}"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    sample = _training_sample(documents)
    logger.info("training a %d-token BPE tokenizer on %d documents", vocab_size, len(sample))
    tokenizer.train_from_iterator((batch["text"] for batch in sample.iter(batch_size=1000)), trainer=trainer)
    return tokenizer


def _training_sample(documents: datasets.Dataset) -> datasets.Dataset:
    """All documents, or every k-th one when they exceed `MAX_TRAIN_BYTES`.

    Striding rather than taking a prefix spreads the sample over the whole corpus, whose order
    (sorted paths, hub row order) often groups similar documents together.
    """
    total_bytes = sum(
        pc.sum(pc.binary_length(batch["text"])).as_py()
        for batch in documents.with_format("arrow").iter(batch_size=10_000)
    )
    stride = math.ceil(total_bytes / MAX_TRAIN_BYTES)
    if stride <= 1:
        return documents
    return documents.shard(num_shards=stride, index=0, contiguous=False)
