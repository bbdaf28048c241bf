"""Decode cache: what a layer needs from earlier tokens, kept between forwards.

Per attention layer the model reads, through the SequenceShard hooks (model/runtime.py):
  window   the last W-1 window-KV rows (every layer has its own)
  global   the compressed latent and index keys of every finished m-block (owner layers)
  pending  the layer inputs of an unfinished m-block, which its next tokens complete
and Engram reads the token ids just before the new ones. A forward over new tokens at
positions [length, length + T) then computes exactly what the training forward computes for
those positions of the whole sequence (tests/test_generate.py).

Rows of one batch share a length (sequences are prefilled and decoded in lockstep).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from model.runtime import HISTORY_TOKENS, SequenceShard


class DecodeCache(SequenceShard):
    def __init__(self, batch: int):
        super().__init__(offset=0, total_len=0, parts=1)
        self.batch, self.length = batch, 0
        self.ids: Optional[torch.Tensor] = None  # [B, <= HISTORY_TOKENS] the newest token ids
        self.window: dict[int, torch.Tensor] = {}  # layer -> [B, W-1, C]
        self.entries: dict[tuple[int, str], torch.Tensor] = {}  # (layer, "kv" | "index_k") -> [B, S, .]
        self.pending: dict[int, torch.Tensor] = {}  # owner layer -> [B, r < m, D]

    def begin(self, input_ids: torch.Tensor) -> None:
        """Before a forward over input_ids [B, T] that follow the cached tokens."""
        B, T = input_ids.shape
        if B != self.batch:
            raise ValueError(f"the cache holds {self.batch} sequences, got a batch of {B}")
        self.offset, self.total_len = self.length, self.length + T
        self.doc_start = torch.zeros(B, T, dtype=torch.long, device=input_ids.device)  # one document
        self.history = self.ids

    def end(self, input_ids: torch.Tensor) -> None:
        """After the forward: the new tokens are part of the cached prefix."""
        ids = input_ids if self.ids is None else torch.cat((self.ids, input_ids), dim=1)
        self.ids = ids[:, -HISTORY_TOKENS:]
        self.length += input_ids.shape[1]

    # --- the hooks the model calls ---

    def gather(self, t: torch.Tensor, layer: int = -1, name: str = "") -> torch.Tensor:
        old = self.entries.get((layer, name))
        full = t if old is None else torch.cat((old, t.to(old.dtype)), dim=1)
        self.entries[(layer, name)] = full
        return full

    def halo(self, t: torch.Tensor, n: int, layer: int = -1) -> Optional[torch.Tensor]:
        old = self.window.get(layer)
        rows = t if old is None else torch.cat((old, t.to(old.dtype)), dim=1)
        if rows.shape[1] < n:
            rows = F.pad(rows, (0, 0, n - rows.shape[1], 0))  # rows before position 0: masked anyway
        self.window[layer] = rows[:, -n:]
        return old

    def block_input(self, x: torch.Tensor, layer: int, m: int) -> tuple[torch.Tensor, int]:
        old = self.pending.get(layer)
        full = x if old is None else torch.cat((old, x), dim=1)
        done = full.shape[1] // m * m
        self.pending[layer] = full[:, done:]
        start = self.offset - (0 if old is None else old.shape[1])  # a block boundary
        return full, start // m

    def nbytes(self) -> dict[str, int]:
        """Bytes held, by kind (unpacked tensors: the packed-format cache comes next)."""
        size = lambda ts: sum(t.numel() * t.element_size() for t in ts)
        return {"window": size(self.window.values()), "global": size(self.entries.values()),
                "pending": size(self.pending.values())}
