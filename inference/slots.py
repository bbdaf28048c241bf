"""Slot cache: the decode state of up to `slots` sequences of different lengths, decoded together.

Continuous batching (inference/generate.py) prefills each prompt on its own into a DecodeCache
(inference/cache.py), moves that state into a free slot here, and then runs one forward per step
over the new token of every busy slot. Rows of a step sit at different positions, so everything
that DecodeCache keeps per batch is kept per slot:

  global   entries of every owner layer in fixed-size pages of one pool per tensor (a page table
           per slot), packed as DecodeCache packs them; a step reads the busy slots' pages as one
           [B, S_max, .] tensor, and entries past a row's own count are invisible to it by
           causality ((j+1)*m > t+1), so the padding needs no mask
  window   the last W-1 window rows of every slot [slots, W-1, .]
  pending  an m-row block buffer per slot and owner layer, and how many of its rows are filled;
           every step compresses every busy row's block and keeps the entry of the rows it completes
  ids      the newest token ids (Engram's n-gram history)

A finished slot's pages go back to the pool; `extract` copies a slot out as a DecodeCache (what the
prefix cache keeps).
"""
from __future__ import annotations

from typing import Optional

import torch

from inference.cache import DecodeCache, _Store, pack, unpack
from model.runtime import HISTORY_TOKENS, SequenceShard


class PagedStore:
    """Rows of many sequences in pages of `page` rows. Page 0 stays zero: the padding of short
    page tables reads it (finite values, so masked attention weights of 0 stay 0)."""

    def __init__(self, kind: str, packed: bool, slots: int, page: int):
        self.kind, self.packed, self.page = kind, packed, page
        self.pool: Optional[tuple[torch.Tensor, ...]] = None  # per part [pages, page, ...]
        self.tables: list[list[int]] = [[] for _ in range(slots)]
        self.counts = [0] * slots
        self.free: list[int] = []

    def _grow(self, like: tuple[torch.Tensor, ...]) -> None:
        if self.pool is None:
            self.pool = tuple(p.new_zeros(2, self.page, *p.shape[2:]) for p in like)
            self.free = [1]
            return
        n = self.pool[0].shape[0]
        self.pool = tuple(torch.cat((p, torch.zeros_like(p)), dim=0) for p in self.pool)
        self.free.extend(range(n, 2 * n))

    def write(self, slot: int, parts: tuple[torch.Tensor, ...]) -> None:
        """Append rows: parts as cache.pack makes them, each [1, S, ...]."""
        S = parts[0].shape[1]
        at = 0
        while at < S:
            c = self.counts[slot]
            if c % self.page == 0:  # the slot's last page is full
                if not self.free:
                    self._grow(parts)
                self.tables[slot].append(self.free.pop())
            page, row = self.tables[slot][c // self.page], c % self.page
            n = min(self.page - row, S - at)
            for dst, src in zip(self.pool, parts):
                dst[page, row:row + n] = src[0, at:at + n]
            self.counts[slot] += n
            at += n

    def read_parts(self, slots: list[int], rows: int) -> tuple[torch.Tensor, ...]:
        """The first `rows` rows of each slot, packed: parts [B, rows, ...]."""
        pages = -(-rows // self.page)
        table = [(self.tables[s] + [0] * pages)[:pages] for s in slots]  # page 0: zero padding
        table = torch.tensor(table, dtype=torch.long, device=self.pool[0].device)  # [B, pages]
        return tuple(p[table].flatten(1, 2)[:, :rows] for p in self.pool)  # [B, pages * page, ...]

    def read(self, slots: list[int], rows: int, dtype: torch.dtype) -> torch.Tensor:
        parts = self.read_parts(slots, rows)
        return unpack(self.kind, parts, dtype) if self.packed else parts[0].to(dtype)

    def release(self, slot: int) -> None:
        for p in self.tables[slot]:  # zeroed so the padding page stays the only page read as padding
            for part in self.pool:
                part[p].zero_()
        self.free.extend(self.tables[slot])
        self.tables[slot], self.counts[slot] = [], 0

    def nbytes_of(self, slot: int) -> int:
        """Bytes of the slot's filled rows (what a page table maps, without the unfilled tail)."""
        if self.pool is None:
            return 0
        return self.counts[slot] * sum(p[0, 0].numel() * p.element_size() for p in self.pool)


class SlotCache(SequenceShard):
    def __init__(self, model, slots: int, packed: bool = True, page: int = 64):
        super().__init__(offset=0, total_len=0, parts=1)
        self.slots, self.packed, self.page = slots, packed, page
        self.ratio = {b.spec.layer_id: b.spec.compress_ratio for b in model.layers if b.spec.owns_kv}
        self.lengths = [0] * slots
        self.ids: Optional[torch.Tensor] = None  # [slots, HISTORY_TOKENS]
        self.entries: dict[tuple[int, str], PagedStore] = {}
        self.window: dict[int, tuple[torch.Tensor, ...]] = {}  # layer -> parts [slots, W-1, ...]
        self.pending: dict[int, torch.Tensor] = {}  # owner layer -> [slots, m, D] block buffer
        self.filled: dict[int, list[int]] = {}  # owner layer -> rows of the block buffer in use, per slot
        self.busy: list[int] = []  # the slots of the running step
        self._done: dict[int, torch.Tensor] = {}  # owner layer -> [B] rows whose block this step completed

    # --- moving sequences in and out ---

    def insert(self, slot: int, c: DecodeCache) -> None:
        """Take over the state of a prefilled 1-sequence cache."""
        if c.batch != 1:
            raise ValueError(f"a slot takes a 1-sequence cache, got {c.batch}")
        self.lengths[slot] = c.length
        ids = c.ids[0, -HISTORY_TOKENS:]
        if self.ids is None:
            self.ids = ids.new_zeros(self.slots, HISTORY_TOKENS)
        self.ids[slot] = 0  # before the start: Engram masks positions < 0 whatever the id
        self.ids[slot, HISTORY_TOKENS - ids.shape[0]:] = ids
        for layer, store in c.window.items():
            if layer not in self.window:
                self.window[layer] = tuple(p.new_zeros(self.slots, *p.shape[1:]) for p in store.parts)
            for dst, src in zip(self.window[layer], store.parts):
                dst[slot] = src[0]
        for key, store in c.entries.items():
            paged = self.entries.setdefault(key, PagedStore(key[1], self.packed, self.slots, self.page))
            if store.parts is not None:
                paged.write(slot, store.parts)
        for layer, rows in c.pending.items():
            if layer not in self.pending:
                self.pending[layer] = rows.new_zeros(self.slots, self.ratio[layer], rows.shape[2])
                self.filled[layer] = [0] * self.slots
            self.pending[layer][slot, :rows.shape[1]] = rows[0]
            self.filled[layer][slot] = rows.shape[1]

    def release(self, slot: int) -> None:
        for paged in self.entries.values():
            paged.release(slot)
        for layer in self.filled:
            self.filled[layer][slot] = 0
        self.lengths[slot] = 0

    def extract(self, slot: int) -> DecodeCache:
        """The slot's global entries, pending block rows and history as a 1-sequence DecodeCache
        (window rows are not copied: the prefix cache rebuilds them)."""
        c = DecodeCache(1, packed=self.packed)
        c.length = self.lengths[slot]
        for key, paged in self.entries.items():
            store = c.entries[key] = _Store(key[1], self.packed)
            if paged.counts[slot]:
                store.parts = tuple(p.clone() for p in paged.read_parts([slot], paged.counts[slot]))
        for layer, buf in self.pending.items():
            c.pending[layer] = buf[slot:slot + 1, :self.filled[layer][slot]].clone()
        c.ids = self.ids[slot:slot + 1, HISTORY_TOKENS - min(c.length, HISTORY_TOKENS):].clone()
        return c

    def global_bytes(self, slot: int) -> int:
        return sum(p.nbytes_of(slot) for p in self.entries.values())

    # --- one decode step over the busy slots ---

    def begin(self, slots: list[int], input_ids: torch.Tensor) -> None:
        """Before a forward over input_ids [B, 1]: the next token of each of `slots`."""
        if input_ids.shape != (len(slots), 1):
            raise ValueError(f"a slot step feeds one token per slot: {len(slots)} slots, ids "
                             f"{tuple(input_ids.shape)}")
        self.busy = list(slots)
        self._rows = torch.tensor(self.busy, device=input_ids.device)
        self.total_len = max(self.lengths[s] for s in slots) + 1
        self.doc_start = torch.zeros(len(slots), 1, dtype=torch.long, device=input_ids.device)
        self.history = self.ids[self._rows]

    def end(self, input_ids: torch.Tensor) -> None:
        self.ids[self._rows] = torch.cat((self.ids[self._rows, 1:], input_ids), dim=1)
        for s in self.busy:
            self.lengths[s] += 1
        self._done = {}

    def positions(self, batch: int, seq_len: int, device: torch.device) -> torch.Tensor:
        return torch.tensor([self.lengths[s] for s in self.busy], device=device)[:, None]  # [B, 1]

    def gather(self, t: torch.Tensor, layer: int = -1, name: str = "") -> torch.Tensor:
        # t [B, 1, .]: the entry of every busy row's block; only rows that completed it keep theirs
        paged = self.entries.setdefault((layer, name), PagedStore(name, self.packed, self.slots, self.page))
        done = self._done[layer]
        for b in done.nonzero()[:, 0].tolist():
            row = t[b:b + 1]
            paged.write(self.busy[b], pack(name, row) if self.packed else (row,))
        rows = self.total_len // self.ratio[layer]
        if rows == 0:
            return t[:, :0]
        return paged.read(self.busy, rows, t.dtype)  # [B, S_max, .]

    def halo(self, t: torch.Tensor, n: int, layer: int = -1) -> Optional[torch.Tensor]:
        if layer not in self.window:  # never prefilled (a prompt shorter than the layer's first use)
            zeros = t.new_zeros(self.slots, n, t.shape[2])
            self.window[layer] = pack("window", zeros) if self.packed else (zeros,)
        parts = self.window[layer]
        old = tuple(p[self._rows] for p in parts)  # [B, n, ...]
        new = pack("window", t) if self.packed else (t.to(parts[0].dtype),)
        for p, o, x in zip(parts, old, new):
            p[self._rows] = torch.cat((o[:, 1:], x), dim=1)
        return unpack("window", old, t.dtype) if self.packed else old[0].to(t.dtype)

    def block_input(self, x: torch.Tensor, layer: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        # x [B, 1, D] -> each row's block [B, m, D] with x written after its filled rows, and the
        # global id of that block's entry [B, 1]
        if layer not in self.pending:
            self.pending[layer] = x.new_zeros(self.slots, m, x.shape[2])
            self.filled[layer] = [0] * self.slots
        filled = torch.tensor([self.filled[layer][s] for s in self.busy], device=x.device)
        buf = self.pending[layer]
        buf[self._rows, filled] = x[:, 0].to(buf.dtype)
        self._done[layer] = filled + 1 == m
        for s in self.busy:
            self.filled[layer][s] = (self.filled[layer][s] + 1) % m
        first = torch.tensor([self.lengths[s] // m for s in self.busy], device=x.device)[:, None]
        return buf[self._rows].to(x.dtype), first
