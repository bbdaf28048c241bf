"""Prefix cache: the global KV of finished sequences, least recently used evicted by bytes.

Window rows are not kept (they are most of a short sequence's cache and cheap to rebuild).
On a hit the restored cache holds the prefix's global entries (and the inputs of its
unfinished m-block), and a bounded replay of the prefix's last tokens through every layer
rebuilds the window rows, after which decoding goes on as usual. Exact when the prefix fits in
the replay; beyond it, the same approximation as CED's bounded replay (docs/DESIGN.md).
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass

import torch

from inference.cache import DecodeCache
from model.runtime import HISTORY_TOKENS


@dataclass
class _Entry:
    entries: dict
    pending: dict
    nbytes: int


class PrefixCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._lru: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()
        self.hits = self.misses = 0

    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._lru.values())

    def put(self, tokens: list[int], cache: DecodeCache) -> None:
        """Keep the global state of a single-sequence cache that has consumed `tokens`."""
        if cache.batch != 1 or cache.length != len(tokens):
            raise ValueError(f"expected a 1-sequence cache of {len(tokens)} tokens, got {cache.batch} x "
                             f"{cache.length}")
        size = cache.nbytes()
        entry = _Entry(copy.deepcopy(cache.entries), {k: v.clone() for k, v in cache.pending.items()},
                       size["global"] + size["pending"])
        self._lru[tuple(tokens)] = entry
        self._lru.move_to_end(tuple(tokens))
        while self._lru and self.nbytes() > self.max_bytes:
            self._lru.popitem(last=False)

    def longest_prefix(self, prompt: list[int]) -> tuple[int, ...] | None:
        """The longest cached token sequence that is a proper prefix of prompt (at least one new token)."""
        best = None
        for key in self._lru:
            if (len(key) < len(prompt) and tuple(prompt[:len(key)]) == key
                    and (best is None or len(key) > len(best))):
                best = key
        return best

    def restore(self, model, key: tuple[int, ...], replay: int, packed: bool, device) -> DecodeCache:
        """A cache holding `key`'s global state, its window rows rebuilt by replaying its last tokens."""
        entry = self._lru[key]
        self._lru.move_to_end(key)
        cache = DecodeCache(1, packed=packed)
        cache.entries = copy.deepcopy(entry.entries)
        cache.pending = {k: v.clone() for k, v in entry.pending.items()}
        P = len(key)
        R = min(P, replay)  # any start: the replay adds no entries, so block alignment does not matter
        ids = torch.tensor([key], device=device)
        cache.length = P
        cache.replay(P - R, P, set(cache.entries), ids)
        with torch.no_grad():
            model(ids[:, P - R:], shard=cache)
        cache.replaying = set()
        cache.ids = ids[:, -HISTORY_TOKENS:]
        cache.token_layer_passes += R * len(model.layers)
        return cache
