"""Decode cache: what a layer needs from earlier tokens, kept between forwards.

Per attention layer the model reads, through the SequenceShard hooks (model/runtime.py):
  window   the last W-1 window-KV rows (every layer has its own)
  global   the compressed latent and index keys of every finished m-block (owner layers)
  pending  the layer inputs of an unfinished m-block, which its next tokens complete
and Engram reads the token ids just before the new ones. A forward over new tokens at
positions [length, length + T) then computes exactly what the training forward computes for
those positions of the whole sequence (tests/test_generate.py).

Rows of one batch share a length (prefill, and the equal-length decoding of tests and benchmarks);
continuous batching of sequences at different lengths decodes from inference/slots.py.

Packed (the default), the cache stores what inference stores (docs/ARCHITECTURE.md §4): the main latent in
FP4 (E2M1, E4M3 scale per 16), index keys in MXFP4, window rows in FP8; reads dequantise
(model/quant.py on CPU, its bit-exact Triton kernels on CUDA).
A model trained with KV QAT (model.kv_quant=qat) computed exactly these values, so a packed
cache reproduces its training forward bit for bit; without QAT packing is an approximation.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from model.quant import pack_fp8, pack_kv_fp4, pack_mxfp4, unpack_fp8, unpack_kv_fp4, unpack_mxfp4
from model.runtime import HISTORY_TOKENS, SequenceShard

# what each kind of cached tensor is stored as when packed
FORMATS = {"kv": (pack_kv_fp4, unpack_kv_fp4), "index_k": (pack_mxfp4, unpack_mxfp4),
           "window": (pack_fp8, unpack_fp8)}


@functools.cache
def _kernel_formats() -> dict:
    """The Triton kernels of the same formats (bit-exact with model/quant.py for bf16 inputs)."""
    from model.kernels import quant as k
    return {"kv": (k.pack_kv_fp4, k.unpack_kv_fp4), "index_k": (k.pack_mxfp4, k.unpack_mxfp4),
            "window": (k.pack_fp8, k.unpack_fp8)}


def pack(kind: str, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """t [..., d] -> its packed parts (codes, scales); on CUDA through the Triton kernels."""
    return (_kernel_formats() if t.is_cuda else FORMATS)[kind][0](t)


def unpack(kind: str, parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
    return (_kernel_formats() if parts[0].is_cuda else FORMATS)[kind][1](*parts, dtype)


class _Store:
    """Rows appended along dim 1, kept packed (codes, scales) or as they came."""

    def __init__(self, kind: str, packed: bool):
        self.kind, self.packed = kind, packed
        self.parts: Optional[tuple[torch.Tensor, ...]] = None

    def append(self, t: torch.Tensor) -> None:
        new = pack(self.kind, t) if self.packed else (t,)
        self.parts = new if self.parts is None else tuple(torch.cat(p, dim=1) for p in zip(self.parts, new))

    def keep_last(self, n: int) -> None:
        self.parts = tuple(p[:, -n:] for p in self.parts)

    def read(self, dtype: torch.dtype) -> torch.Tensor:
        return unpack(self.kind, self.parts, dtype) if self.packed else self.parts[0].to(dtype)

    def size(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parts or ())


class DecodeCache(SequenceShard):
    def __init__(self, batch: int, packed: bool = True):
        super().__init__(offset=0, total_len=0, parts=1)
        self.batch, self.length, self.packed = batch, 0, packed
        self.ids: Optional[torch.Tensor] = None  # [B, <= HISTORY_TOKENS] the newest token ids
        self.window: dict[int, _Store] = {}  # layer -> the last W-1 window rows [B, W-1, C]
        self.entries: dict[tuple[int, str], _Store] = {}  # (owner layer, "kv" | "index_k") -> [B, S, .]
        self.pending: dict[int, torch.Tensor] = {}  # owner layer -> layer inputs [B, r < m, D]
        self.replaying: set[tuple[int, str]] = set()  # entries a CED replay reads but must not append to
        self.token_layer_passes = 0  # tokens x layers run so far (CED prefill skips most decoder passes)
        self._marked: Optional[tuple] = None  # the state before a forward that `rollback` may shorten
        self._window_rows: dict[int, tuple[torch.Tensor, int]] = {}  # layer -> (its new rows, W-1)
        self._blocks: dict[int, tuple[int, torch.Tensor, int]] = {}  # owner -> (position of row 0, rows, m)

    def begin(self, input_ids: torch.Tensor) -> None:
        """Before a forward over input_ids [B, T] that follow the cached tokens."""
        B, T = input_ids.shape
        if B != self.batch:
            raise ValueError(f"the cache holds {self.batch} sequences, got a batch of {B}")
        self.offset, self.total_len = self.length, self.length + T
        self.doc_start = torch.zeros(B, T, dtype=torch.long, device=input_ids.device)  # one document
        self.history = self.ids

    def replay(self, start: int, total_len: int, entries: dict, input_ids: torch.Tensor) -> DecodeCache:
        """A bounded replay of tokens [start, total_len): the layers that run see those tokens only
        (window rows start with the first replayed token) and read the cached global entries of
        `entries` without adding to them. CED prefill replays the decoder layers of a prompt
        (model.transformer.forward_ced); a prefix-cache hit replays every layer (inference/prefix.py)."""
        if self.length and self.length != total_len:
            raise ValueError("a replay starts a sequence or rebuilds a restored prefix: the cache must be "
                             "empty")
        self.offset, self.total_len = start, total_len
        self.doc_start = torch.zeros(self.batch, total_len - start, dtype=torch.long, device=input_ids.device)
        self.history = input_ids[:, max(start - HISTORY_TOKENS, 0):start] if start > 0 else None
        self.replaying = set(entries)
        return self

    def end(self, input_ids: torch.Tensor) -> None:
        """After the forward: the new tokens are part of the cached prefix."""
        self.replaying = set()
        ids = input_ids if self.ids is None else torch.cat((self.ids, input_ids), dim=1)
        self.ids = ids[:, -HISTORY_TOKENS:]
        self.length += input_ids.shape[1]

    # --- speculative verification: a forward whose tail may be taken back ---

    def mark(self) -> None:
        """Before a forward of which `rollback` may keep only a prefix (speculative verification):
        remembers the window rows, pending block inputs and history as they are now (stores replace
        their tensors when they grow, so references suffice) and records what the forward adds."""
        self._marked = (self.length, self.ids, {layer: s.parts for layer, s in self.window.items()},
                        dict(self.pending))
        self._window_rows, self._blocks = {}, {}

    def rollback(self, keep: int, input_ids: torch.Tensor) -> None:
        """After the marked forward over input_ids [B, T]: keep its first `keep` tokens, as if only
        they had been run (a forward computes each position from the positions before it only, so
        their rows are what a forward over them alone computes)."""
        if self._marked is None:
            raise RuntimeError("rollback without a marked forward")
        length, ids, windows, pending = self._marked
        T = input_ids.shape[1]
        if not 0 < keep <= T or self.length != length + T:
            raise ValueError(f"rollback to {keep} of the {T} tokens of the marked forward")
        new_len = length + keep
        for layer, (rows, n) in self._window_rows.items():
            store = self.window[layer]
            store.parts = windows.get(layer)
            if store.parts is None:  # the layer's first forward: rows before position 0 are zeros
                store.append(rows.new_zeros(rows.shape[0], n, rows.shape[2]))
            store.append(rows[:, :keep])
            store.keep_last(n)
        for layer, (start, rows, m) in self._blocks.items():
            for name in ("kv", "index_k"):
                store = self.entries.get((layer, name))
                if store is not None and store.parts is not None:
                    store.parts = tuple(p[:, :new_len // m] for p in store.parts)
            done = new_len // m * m
            self.pending[layer] = rows[:, done - start:new_len - start]
        for layer in set(pending) - set(self._blocks):
            self.pending[layer] = pending[layer]
        kept = input_ids[:, :keep]
        self.ids = (kept if ids is None else torch.cat((ids, kept), dim=1))[:, -HISTORY_TOKENS:]
        self.length = new_len
        self._marked = None
        self._window_rows, self._blocks = {}, {}

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep the sequences at `rows` [B'] (in that order) and drop the others."""
        for store in (*self.window.values(), *self.entries.values()):
            if store.parts is not None:
                store.parts = tuple(p[rows] for p in store.parts)
        self.pending = {layer: t[rows] for layer, t in self.pending.items()}
        self.ids = None if self.ids is None else self.ids[rows]
        self.batch = rows.numel()

    # --- the hooks the model calls ---

    def gather(self, t: torch.Tensor, layer: int = -1, name: str = "") -> torch.Tensor:
        store = self.entries.setdefault((layer, name), _Store(name, self.packed))
        if (layer, name) in self.replaying:
            return store.read(t.dtype)
        if t.shape[1]:
            store.append(t)
        return store.read(t.dtype) if store.parts is not None else t

    def halo(self, t: torch.Tensor, n: int, layer: int = -1) -> Optional[torch.Tensor]:
        store = self.window.get(layer)
        old = None if store is None else store.read(t.dtype)
        if self._marked is not None:
            self._window_rows[layer] = (t, n)
        if store is None:  # rows before position 0 are zeros (masked by position anyway)
            store = self.window[layer] = _Store("window", self.packed)
            store.append(t.new_zeros(t.shape[0], n, t.shape[2]))
        store.append(t[:, max(t.shape[1] - n, 0):])  # rows pack one by one: only the kept ones need it
        store.keep_last(n)
        return old

    def block_input(self, x: torch.Tensor, layer: int, m: int) -> tuple[torch.Tensor, int]:
        if (layer, "kv") in self.replaying:  # its entries are cached; what it computes now is dropped
            return x, self.offset // m
        old = self.pending.get(layer)
        full = x if old is None else torch.cat((old, x), dim=1)
        done = full.shape[1] // m * m
        self.pending[layer] = full[:, done:]
        start = self.offset - (0 if old is None else old.shape[1])  # a block boundary
        if self._marked is not None:
            self._blocks[layer] = (start, full, m)
        return full, start // m

    def nbytes(self) -> dict[str, int]:
        """Bytes held, by kind: window rows, global entries (main KV + index keys), pending inputs."""
        return {"window": sum(s.size() for s in self.window.values()),
                "global": sum(s.size() for s in self.entries.values()),
                "pending": sum(t.numel() * t.element_size() for t in self.pending.values())}

    def global_bytes_per_token(self) -> float:
        """Global-KV bytes per cached token per sequence, from the buffers themselves."""
        return self.nbytes()["global"] / max(self.length, 1) / self.batch
