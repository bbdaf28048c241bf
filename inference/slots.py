"""Slot cache: the decode state of up to `slots` sequences of different lengths, decoded together.

Continuous batching (inference/generate.py) prefills each prompt on its own into a DecodeCache
(inference/cache.py), moves that state into a free slot here, and then runs one forward per step
over the new token of every busy slot. Rows of a step sit at different positions, so everything
that DecodeCache keeps per batch is kept per slot, on the device:

  global   entries of every owner layer in fixed-size pages of one pool per tensor, with a page
           table per slot [slots, pages] on the device, packed as DecodeCache packs them; a step
           reads the busy rows' pages as one [B, S_cap, .] tensor, and entries past a row's own
           count are invisible to it by causality ((j+1)*m > t+1), so the padding needs no mask
  window   a ring of window rows per slot [slots, W - 1 + lookahead, .] (position p at p % size)
  pending  a block buffer per slot and owner layer, a ring of whole m-blocks (position p at p % size);
           every step compresses the blocks its rows touch and keeps the entries of the blocks
           whose last row it fed
  ids      a ring of the newest HISTORY_TOKENS + lookahead token ids (Engram's n-gram history)
  pos      the position of each slot's next token

`lookahead` is the most tokens one forward feeds per row: 1 for the plain engine; speculative
verification (inference/speculative.py) feeds the anchor and its drafts, and then keeps only a
prefix of them per row (`end(.., keep)`). The rings are sized so that a forward's writes never
reach a row that the slot may still read after such a rollback: a rejected position's window row,
block row and id sit past the kept length, where the next forward writes before anything reads
them, and an entry that a rejected position completed is invisible by causality until the row
feeds that block's last position again, in a forward that rewrites it before reading it.

A step is split in two so that its device part has no host sync and fixed shapes (a CUDA graph
of it can be replayed, inference/graphs.py):
  host     `prepare(busy)`: reserves the pages that the step's completed entries go to (which
           rows complete one follows from the lengths alone, which the host tracks) and picks the
           read width S_cap from a few buckets of the longest row; `advance(busy)` counts the token
  device   `begin_rows(rows, cap)` / `end_rows(ids)`: every hook reads the rows' positions from
           `pos` and writes where they say. Rows that complete no entry write it to a scratch page.
Window, block and id writes go to slots that the step does not read, so running the device part
twice over the same state writes the same values.

A finished slot's pages go back to the pool; `extract` copies a slot out as a DecodeCache (what the
prefix cache keeps).
"""
from __future__ import annotations

from typing import Optional

import torch

from inference.cache import DecodeCache, _Store, pack, unpack
from model.runtime import HISTORY_TOKENS, SequenceShard

PAD_PAGE, SCRATCH_PAGE = 0, 1  # page 0 is read as padding and never written; page 1 takes discarded writes


def capacity(need: int, quantum: int) -> int:
    """The read width (in tokens) of a step whose longest row needs `need`: a multiple of `quantum`
    with at most three significant bits (widths grow by at most 25%), so a decode run visits a few
    widths per doubling of its length and a captured step is reused across them."""
    n = -(-need // quantum)
    if n > 8:
        step = 1 << (n.bit_length() - 3)
        n = -(-n // step) * step
    return n * quantum


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """A host list as an int64 tensor on `device`, without waiting for the device: a copy from
    pageable memory would wait for every queued kernel first."""
    t = torch.tensor(values, dtype=torch.long)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class PagedStore:
    """Rows of many sequences in pages of `page` rows: pool parts [pages, page, ...] and a page
    table [slots, width] (PAD_PAGE where a slot has no page). Pages are reserved on the host;
    rows are written and read on the device only."""

    def __init__(self, kind: str, packed: bool, slots: int, page: int):
        self.kind, self.packed, self.page, self.slots = kind, packed, page, slots
        self.pool: Optional[tuple[torch.Tensor, ...]] = None
        self.table: Optional[torch.Tensor] = None
        self.pages: list[list[int]] = [[] for _ in range(slots)]
        self.free: list[int] = []
        self.version = 0  # bumped when pool or table move (a captured step holds their addresses)

    def create(self, like: tuple[torch.Tensor, ...]) -> None:
        """Pool and table from the parts of one row (any [.., 1, ...] as pack makes them)."""
        if self.pool is None:
            self.pool = tuple(p.new_zeros(2, self.page, *p.shape[2:]) for p in like)
            self.table = torch.zeros(self.slots, 1, dtype=torch.long, device=like[0].device)
            self.version += 1

    def reserve(self, slot: int, rows: int) -> None:
        """Make sure slot's pages hold `rows` rows (host bookkeeping, device table updated in place)."""
        need = -(-rows // self.page)
        while len(self.pages[slot]) < need:
            if not self.free:
                n = self.pool[0].shape[0]
                self.pool = tuple(torch.cat((p, torch.zeros_like(p)), dim=0) for p in self.pool)
                self.free.extend(range(max(n, SCRATCH_PAGE + 1), 2 * n))
                self.version += 1
            j = len(self.pages[slot])
            self.widen(j + 1)
            page = self.free.pop()
            self.pages[slot].append(page)
            self.table[slot, j] = page  # a fill kernel: no copy from the host

    def widen(self, width: int) -> None:
        if self.table.shape[1] < width:
            grown = self.table.new_zeros(self.slots, max(width, 2 * self.table.shape[1]))
            grown[:, :self.table.shape[1]] = self.table
            self.table = grown
            self.version += 1

    def write(self, slot: int, parts: tuple[torch.Tensor, ...], start: int) -> None:
        """Rows start .. start + S of slot from parts [1, S, ...] (pages reserved here)."""
        S = parts[0].shape[1]
        self.reserve(slot, start + S)
        at = torch.arange(start, start + S, device=parts[0].device)
        pages = self.table[slot, at // self.page]
        for dst, src in zip(self.pool, parts):
            dst[pages, at % self.page] = src[0].to(dst.dtype)

    def write_step(self, rows: torch.Tensor, index: torch.Tensor, done: torch.Tensor,
                   parts: tuple[torch.Tensor, ...]) -> None:
        """Rows `index` [B, n] of each of `rows` [B] from parts [B, n, ...], where `done` [B, n]; the
        others go to the scratch page (a fixed-shape write, no host sync)."""
        col = torch.clamp(index // self.page, max=self.table.shape[1] - 1)
        page = self.table[rows[:, None], col]
        page = torch.where(done & (page != PAD_PAGE), page, SCRATCH_PAGE)
        for dst, src in zip(self.pool, parts):
            dst[page, index % self.page] = src.to(dst.dtype)

    def read_parts(self, rows: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
        """The first n rows of each of `rows` [B], packed: parts [B, n, ...]."""
        width = -(-n // self.page)
        self.widen(width)
        table = self.table[rows, :width]  # [B, width]
        return tuple(p[table].flatten(1, 2)[:, :n] for p in self.pool)

    def read(self, rows: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
        parts = self.read_parts(rows, n)
        return unpack(self.kind, parts, dtype) if self.packed else parts[0].to(dtype)

    def release(self, slot: int) -> None:
        """The slot's pages go back to the pool as they are: a page's rows past a sequence's count
        are invisible to it by causality, so stale (finite) rows need no zeroing."""
        for j in range(len(self.pages[slot])):
            self.table[slot, j] = PAD_PAGE
        self.free.extend(self.pages[slot])
        self.pages[slot] = []

    def row_bytes(self) -> int:
        return 0 if self.pool is None else sum(p[0, 0].numel() * p.element_size() for p in self.pool)


class SlotCache(SequenceShard):
    def __init__(self, model, slots: int, packed: bool = True, page: int = 64, lookahead: int = 1):
        super().__init__(offset=0, total_len=0, parts=1)
        if lookahead < 1:
            raise ValueError(f"lookahead={lookahead}: a forward feeds at least one token per row")
        self.slots, self.packed, self.page, self.lookahead = slots, packed, page, lookahead
        self.ratio = {b.spec.layer_id: b.spec.compress_ratio for b in model.layers if b.spec.owns_kv}
        self.widths = {"kv": model.cfg.kv_dim, "index_k": model.cfg.index_dim}
        # ring sizes: the rows a step reads before its first token plus the rows it writes
        self.window_ring = model.cfg.window - 1 + lookahead
        self.id_ring = HISTORY_TOKENS + lookahead
        # whole blocks: a step reads the block of its first token and every block up to its last
        self.block_ring = {layer: m * self._blocks(m, lookahead) for layer, m in self.ratio.items()}
        self.quantum = page * max(self.ratio.values(), default=1)
        self.lengths = [0] * slots  # host copy of `pos`
        self._covered = [0] * slots  # per slot: the longest sequence its reserved pages hold (host)
        self.pos: Optional[torch.Tensor] = None  # [slots] position of each slot's next token
        self.ids: Optional[torch.Tensor] = None  # [slots, id_ring] ring of the newest ids
        self.entries: dict[tuple[int, str], PagedStore] = {}
        self.window: dict[int, tuple[torch.Tensor, ...]] = {}  # layer -> ring parts [slots, W, ...]
        self.pending: dict[int, torch.Tensor] = {}  # owner layer -> [slots, block_ring, D] block rows
        self._rows: Optional[torch.Tensor] = None  # [B] the slots of the running step
        self._pos: Optional[torch.Tensor] = None  # [B] their positions
        self._tokens = 1  # tokens per row of the running step
        self._done: dict[int, torch.Tensor] = {}  # owner layer -> [B] rows whose block this step completes
        self._index: dict[tuple, torch.Tensor] = {}  # the step's index tensors that layers share
        self._busy: list[int] = []

    @staticmethod
    def _blocks(m: int, tokens: int) -> int:
        """m-blocks that a forward of `tokens` tokens per row may touch (it starts anywhere in one)."""
        return -(-(m - 1 + tokens) // m)

    def version(self) -> tuple:
        """Changes whenever a tensor that a captured step holds is reallocated."""
        return tuple(s.version for s in self.entries.values()) + (len(self.window), len(self.pending))

    def ready(self) -> bool:
        """Every buffer a step touches exists (a step may then be captured: it allocates no state)."""
        return (self.pos is not None and all(s.pool is not None for s in self.entries.values())
                and len(self.entries) == 2 * len(self.ratio))

    # --- moving sequences in and out ---

    def _state(self, device: torch.device) -> None:
        if self.pos is None:
            self.pos = torch.zeros(self.slots, dtype=torch.long, device=device)
            self.ids = torch.zeros(self.slots, self.id_ring, dtype=torch.long, device=device)

    def _store(self, key: tuple[int, str], device: torch.device, dtype: torch.dtype) -> PagedStore:
        """The paged store of (layer, name), its pool made from one probe row if it has none."""
        store = self.entries.setdefault(key, PagedStore(key[1], self.packed, self.slots, self.page))
        if store.pool is None:
            probe = torch.zeros(1, 1, self.widths[key[1]], device=device,
                                dtype=torch.float32 if self.packed else dtype)
            store.create(pack(key[1], probe) if self.packed else (probe,))
        return store

    def insert(self, slot: int, c: DecodeCache) -> None:
        """Take over the state of a prefilled 1-sequence cache."""
        if c.batch != 1:
            raise ValueError(f"a slot takes a 1-sequence cache, got {c.batch}")
        L = c.length
        device = c.ids.device
        self._state(device)
        self.lengths[slot] = L
        self._covered[slot] = 0
        self.pos[slot] = L
        ring = self.id_ring
        ids = c.ids[0, -HISTORY_TOKENS:]
        self.ids[slot] = 0  # before the start: Engram masks positions < 0 whatever the id
        at = torch.arange(L - ids.shape[0], L, device=device) % ring
        self.ids[slot, at] = ids
        for layer, store in c.window.items():
            parts = store.parts  # [1, W-1, ...]: positions L-W+1 .. L-1 (zeros before 0)
            n = parts[0].shape[1]
            if layer not in self.window:
                self.window[layer] = tuple(p.new_zeros(self.slots, self.window_ring, *p.shape[2:])
                                           for p in parts)
            at = torch.arange(L - n, L, device=device) % self.window_ring
            for dst, src in zip(self.window[layer], parts):
                dst[slot, at] = src[0]
        # unpacked pools keep the entries' dtype; packed parts are bytes whatever the input
        dtype = next((s.parts[0].dtype for s in c.entries.values() if s.parts is not None), torch.float32)
        for key, store in c.entries.items():
            if store.parts is not None:
                self._store(key, device, dtype).write(slot, store.parts, 0)
        for layer in self.ratio:
            for name in ("kv", "index_k"):
                self._store((layer, name), device, dtype)
        for layer, rows in c.pending.items():  # rows [1, L % m, D]: positions L // m * m .. L - 1
            if layer not in self.pending:
                self.pending[layer] = rows.new_zeros(self.slots, self.block_ring[layer], rows.shape[2])
            at = torch.arange(L - rows.shape[1], L, device=device) % self.block_ring[layer]
            self.pending[layer][slot, at] = rows[0]

    def release(self, slot: int) -> None:
        for paged in self.entries.values():
            paged.release(slot)
        self.lengths[slot] = self._covered[slot] = 0

    def extract(self, slot: int) -> DecodeCache:
        """The slot's state as a 1-sequence DecodeCache: global entries, pending block rows, window
        rows and history (what `insert` takes; the prefix cache keeps it)."""
        c = DecodeCache(1, packed=self.packed)
        L = c.length = self.lengths[slot]
        device = self.pos.device
        row = torch.tensor([slot], device=device)
        rows_before = self.window_ring - self.lookahead  # the W-1 rows before the next token
        at = torch.arange(L - rows_before, L, device=device) % self.window_ring
        for layer, parts in self.window.items():
            store = c.window[layer] = _Store("window", self.packed)
            store.parts = tuple(p[slot, at][None].clone() for p in parts)
        for key, paged in self.entries.items():
            store = c.entries[key] = _Store(key[1], self.packed)
            n = L // self.ratio[key[0]]
            if n:
                store.parts = tuple(p.clone() for p in paged.read_parts(row, n))
        for layer, buf in self.pending.items():
            at = torch.arange(L - L % self.ratio[layer], L, device=device) % self.block_ring[layer]
            c.pending[layer] = buf[slot:slot + 1, at].clone()
        at = torch.arange(max(L - HISTORY_TOKENS, 0), L, device=device) % self.id_ring
        c.ids = self.ids[slot, at][None].clone()
        return c

    def global_bytes(self, slot: int) -> int:
        return sum(p.row_bytes() * (self.lengths[slot] // self.ratio[k[0]]) for k, p in self.entries.items())

    # --- one decode step over the busy slots: host part ---

    def prepare(self, busy: list[int], tokens: int = 1) -> int:
        """Before a step of `busy` feeding `tokens` per row: reserve the pages its completed entries
        go to -> the step's read width in tokens (a bucket of the longest row's length + tokens)."""
        if not 1 <= tokens <= self.lookahead:
            raise ValueError(f"a step of {tokens} tokens per row on a slot cache of lookahead "
                             f"{self.lookahead}")
        for s in busy:
            if self.lengths[s] + tokens > self._covered[s]:  # some store's pages end before an entry
                self._reserve(s, self.lengths[s] + tokens)
        cap = capacity(max(self.lengths[s] for s in busy) + tokens, self.quantum)
        for (layer, _), store in self.entries.items():
            store.widen(-(-(cap // self.ratio[layer]) // self.page))
        return cap

    def _reserve(self, slot: int, length: int) -> None:
        """Pages for every entry of a sequence of `length` tokens in slot, and how far they reach."""
        covered = None
        for (layer, _), store in self.entries.items():
            m = self.ratio[layer]
            store.reserve(slot, length // m)
            reach = len(store.pages[slot]) * self.page * m + m - 1  # the longest length they hold
            covered = reach if covered is None else min(covered, reach)
        self._covered[slot] = length if covered is None else covered

    def advance(self, busy: list[int], keep: Optional[list[int]] = None) -> None:
        """Count the step's tokens on the host: one per row, or keep[i] for busy[i]."""
        for i, s in enumerate(busy):
            self.lengths[s] += 1 if keep is None else keep[i]

    # --- one decode step: device part (fixed shapes, no host sync) ---

    def begin_rows(self, rows: torch.Tensor, cap: int, tokens: int = 1) -> None:
        """Before a forward over `tokens` tokens of each of `rows` [B], reading `cap` tokens' worth
        of global entries."""
        ring = self.id_ring
        self._rows, self._tokens = rows, tokens
        self._pos = self.pos[rows]  # [B]
        self.total_len = cap
        self.doc_start = torch.zeros(rows.shape[0], tokens, dtype=torch.long, device=rows.device)
        at = (self._pos[:, None] - HISTORY_TOKENS + torch.arange(HISTORY_TOKENS, device=rows.device)) % ring
        self.history = self.ids[rows[:, None], at]  # [B, HISTORY_TOKENS], oldest first
        self._done, self._index = {}, {}

    def _shared(self, key: tuple, make) -> torch.Tensor:
        """An index tensor of this step that every layer with the same ring or ratio uses: made once."""
        if key not in self._index:
            self._index[key] = make()
        return self._index[key]

    def end_rows(self, input_ids: torch.Tensor, keep: Optional[torch.Tensor] = None) -> None:
        """After the forward over input_ids [B, T]: their ids join the history and each row's
        position moves on by T, or by keep [B] (1..T: the rest is taken back)."""
        T = input_ids.shape[1]
        at = self._shared(("fed", self.id_ring), lambda: (self._pos[:, None] + self._steps(T)) % self.id_ring)
        self.ids[self._rows[:, None], at] = input_ids
        self.pos[self._rows] = self._pos + (T if keep is None else keep)

    def _steps(self, n: int) -> torch.Tensor:
        return self._shared(("arange", n), lambda: torch.arange(n, device=self._pos.device))

    # --- the step as one call (tests, and the eager path of inference/graphs.py) ---

    def begin(self, slots: list[int], input_ids: torch.Tensor) -> None:
        """Before a forward over input_ids [B, T]: the next T tokens of each of `slots`."""
        if input_ids.dim() != 2 or input_ids.shape[0] != len(slots):
            raise ValueError(f"a slot step feeds a row of tokens per slot: {len(slots)} slots, ids "
                             f"{tuple(input_ids.shape)}")
        self._busy = list(slots)
        cap = self.prepare(self._busy, input_ids.shape[1])
        self.begin_rows(to_device(self._busy, input_ids.device), cap, input_ids.shape[1])

    def end(self, input_ids: torch.Tensor, keep: Optional[list[int]] = None) -> None:
        """After the forward: every fed token joins its row, or only the first keep[i] of row i
        (speculative verification: the rest were rejected drafts)."""
        if keep is not None and not all(1 <= n <= input_ids.shape[1] for n in keep):
            raise ValueError(f"keep={keep}: each row keeps 1..{input_ids.shape[1]} of the tokens fed")
        self.end_rows(input_ids, None if keep is None else to_device(keep, input_ids.device))
        self.advance(self._busy, keep)

    # --- the hooks the model calls ---

    def positions(self, batch: int, seq_len: int, device: torch.device) -> torch.Tensor:
        return self._pos[:, None] + self._steps(seq_len)  # [B, T]

    def gather(self, t: torch.Tensor, layer: int = -1, name: str = "") -> torch.Tensor:
        # t [B, nb, .]: the entries of the blocks every busy row touched; only the blocks whose last
        # row the step fed are kept
        m = self.ratio[layer]
        paged = self._store((layer, name), t.device, t.dtype)
        nb = t.shape[1]
        index = self._shared(("block", m), lambda: self._pos[:, None] // m + self._steps(nb))  # [B, nb]
        paged.write_step(self._rows, index, self._done[layer], pack(name, t) if self.packed else (t,))
        return paged.read(self._rows, self.total_len // m, t.dtype)  # [B, S_cap, .]

    def halo(self, t: torch.Tensor, n: int, layer: int = -1) -> Optional[torch.Tensor]:
        # t [B, 1, C]: this step's window row; returns the n rows before it, oldest first
        if layer not in self.window:  # never prefilled (a prompt shorter than the layer's first use)
            zeros = t.new_zeros(self.slots, self.window_ring, t.shape[2])
            self.window[layer] = pack("window", zeros) if self.packed else (zeros,)
        parts = self.window[layer]
        ring = parts[0].shape[1]
        T = t.shape[1]
        at = self._shared(("ring", n, ring),  # [B, n]: positions pos-n .. pos-1 in the ring
                          lambda: (self._pos[:, None] - n + self._steps(n)) % ring)
        slot = self._shared(("fed", ring), lambda: (self._pos[:, None] + self._steps(T)) % ring)  # [B, T]
        old = tuple(p[self._rows[:, None], at] for p in parts)  # [B, n, ...]
        new = pack("window", t) if self.packed else (t,)
        for p, x in zip(parts, new):
            p[self._rows[:, None], slot] = x.to(p.dtype)
        return unpack("window", old, t.dtype) if self.packed else old[0].to(t.dtype)

    def block_input(self, x: torch.Tensor, layer: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        # x [B, T, D] -> the nb blocks each row's tokens touch [B, nb * m, D], x written after the
        # block's earlier rows (rows past the last fed one are stale: their block is not done), and
        # the global id of the first block's entry [B, 1]
        ring = self.block_ring[layer]
        if layer not in self.pending:
            self.pending[layer] = x.new_zeros(self.slots, ring, x.shape[2])
        buf = self.pending[layer]
        T = x.shape[1]
        nb = self._blocks(m, T)
        first = self._shared(("first", m), lambda: (self._pos // m)[:, None])  # [B, 1]
        fed = self._shared(("fed", ring), lambda: (self._pos[:, None] + self._steps(T)) % ring)  # [B, T]
        buf[self._rows[:, None], fed] = x.to(buf.dtype)
        # [B, nb * m]: the rows of those blocks in the ring
        rows = self._shared(("blocks", ring, m), lambda: (first * m + self._steps(nb * m)) % ring)
        # block i is done when its last position, (first + i + 1) m - 1, is among those fed
        self._done[layer] = self._shared(("done", m), lambda: (first + self._steps(nb) + 1) * m
                                         <= self._pos[:, None] + T)  # [B, nb]
        return buf[self._rows[:, None], rows].to(x.dtype), first
