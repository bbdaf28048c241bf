"""Corpus reading, tokenizer training, sequence packing and distributed batch loading.

`build_datasets(cfg)` turns a `conf.data.DataConfig` into packed train and validation splits plus the
tokenizer; `DistributedBatchLoader` serves them to data-parallel ranks. Every bad-input case raises
`DataError` with a one-line message.
"""

from data.corpus import load_documents
from data.errors import DataError
from data.loader import DistributedBatchLoader
from data.packing import PackedDataset, build_datasets
from data.tokenizer import SPECIAL_TOKENS, TextTokenizer, load_or_train_tokenizer

__all__ = [
    "SPECIAL_TOKENS",
    "DataError",
    "DistributedBatchLoader",
    "PackedDataset",
    "TextTokenizer",
    "build_datasets",
    "load_documents",
    "load_or_train_tokenizer",
]
