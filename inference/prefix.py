"""Prefix cache: the decode state of finished sequences, least recently used evicted by bytes.

An entry is a whole 1-sequence cache (inference/cache.py): global entries, the inputs of its
unfinished m-block, its window rows and the newest ids. A prompt that extends a cached sequence
restores that state and runs only its new tokens, so it continues exactly as the sequence would
have if decoding had gone on with those tokens: no prefix token runs again. A caller that needs
the layers' outputs at the prefix's last tokens (speculative decoding: the drafter's context is the
target's hidden states there) asks for a bounded replay of them instead, which rebuilds the window
rows from the cached global entries: exact when the prefix fits in the replay, beyond it the same
approximation as CED's bounded replay (docs/DESIGN.md).
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import torch

from inference.cache import DecodeCache
from model.runtime import HISTORY_TOKENS


@dataclass
class _Entry:
    entries: dict
    pending: dict
    window: dict
    ids: Optional[torch.Tensor]
    nbytes: int


class PrefixCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._lru: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()
        self.hits = self.misses = 0

    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._lru.values())

    def put(self, tokens: list[int], cache: DecodeCache) -> None:
        """Keep the state of a single-sequence cache that has consumed `tokens`."""
        if cache.batch != 1 or cache.length != len(tokens):
            raise ValueError(f"expected a 1-sequence cache of {len(tokens)} tokens, got {cache.batch} x "
                             f"{cache.length}")
        ids = None if cache.ids is None else cache.ids.clone()
        entry = _Entry(copy.deepcopy(cache.entries), {k: v.clone() for k, v in cache.pending.items()},
                       copy.deepcopy(cache.window), ids, sum(cache.nbytes().values()))
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

    def restore(self, model, key: tuple[int, ...], packed: bool, device,
                replay: Optional[int] = None) -> DecodeCache:
        """A cache holding `key`'s state. `replay`: rebuild its window rows instead, by replaying the
        prefix's last `replay` tokens through every layer (the caller reads their outputs)."""
        entry = self._lru[key]
        self._lru.move_to_end(key)
        cache = DecodeCache(1, packed=packed)
        cache.entries = copy.deepcopy(entry.entries)
        cache.pending = {k: v.clone() for k, v in entry.pending.items()}
        P = cache.length = len(key)
        if replay is None:
            cache.window = copy.deepcopy(entry.window)
            cache.ids = None if entry.ids is None else entry.ids.clone()
            return cache
        R = min(P, replay)  # any start: the replay adds no entries, so block alignment does not matter
        ids = torch.tensor([key], device=device)
        cache.replay(P - R, P, set(cache.entries), ids)
        with torch.no_grad():
            model(ids[:, P - R:], shard=cache)
        cache.replaying = set()
        cache.ids = ids[:, -HISTORY_TOKENS:]
        cache.token_layer_passes += R * len(model.layers)
        return cache
