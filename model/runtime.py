"""Per-forward state that CSA2 layers share: the Full/Reindex/Reuse plumbing (docs/ARCHITECTURE.md §3).

A Full layer writes its compressed KV latent, index keys and top-k here; Reindex layers
read the KV and index keys and the Full layer's candidate pool and write their own top-k;
Reuse layers read everything. Reuse and Reindex layers never write KV, which is how the
cache-size accounting and the tests see that they allocate none.
"""
from __future__ import annotations

from typing import Optional

import torch

# token ids before a slice that its first tokens' Engram n-grams read; covers orders up to 9
HISTORY_TOKENS = 8


def document_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    """doc_ids [B, T] (non-decreasing per row) -> first position of each token's document."""
    B, T = doc_ids.shape
    pos = torch.arange(T, device=doc_ids.device).expand(B, T)
    change = torch.ones_like(doc_ids, dtype=torch.bool)
    change[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return torch.where(change, pos, torch.zeros_like(pos)).cummax(dim=1).values


class SequenceShard:
    """Where this forward's tokens sit in the whole sequence. The default is all of it, on this
    device. Context parallelism (trainer/context_parallel.py) gives each rank a slice, and the
    generation engine (inference/) feeds new tokens after a cached prefix; both override the
    hooks below (`layer` says which attention layer calls), model code only calls them.

    offset, total_len   the slice is tokens [offset, offset + T) of total_len
    doc_start           [B, T] first position (global) of each token's document, or None
    history             [B, h] token ids just before the slice (None: the sequence starts here)
    parts               how many slices the sequence is cut into
    """

    def __init__(self, offset: int = 0, total_len: Optional[int] = None,
                 doc_start: Optional[torch.Tensor] = None,
                 history: Optional[torch.Tensor] = None, parts: int = 1):
        self.offset, self.total_len, self.doc_start, self.history, self.parts = (
            offset, total_len, doc_start, history, parts)

    def positions(self, batch: int, seq_len: int, device: torch.device) -> torch.Tensor:
        """[B, T] global positions of the slice's tokens (rows of a continuous batch differ)."""
        return (self.offset + torch.arange(seq_len, device=device)).expand(batch, seq_len)

    def gather(self, t: torch.Tensor, layer: int = -1, name: str = "") -> torch.Tensor:
        """[B, S_local, ...] of every slice, concatenated along dim 1 in sequence order
        (`name`: which of the layer's global tensors: "kv" or "index_k")."""
        return t

    def halo(self, t: torch.Tensor, n: int, layer: int = -1) -> Optional[torch.Tensor]:
        """The last n rows [B, n, ...] of the previous slice's t (None: nothing before)."""
        return None

    def block_input(self, x: torch.Tensor, layer: int, m: int) -> tuple[torch.Tensor, int]:
        """The compressor's input for this slice: x [B, T, D] preceded by the rows of an
        unfinished m-block before the slice, and the global id of its first entry (an int, or
        [B, 1] when rows sit at different positions). The default
        (and context parallelism) starts slices on block boundaries."""
        return x, self.offset // m

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the slices of one sequence (no gradient)."""
        return t

    def replay(self, start: int, total_len: int, entries: dict, input_ids: torch.Tensor) -> SequenceShard:
        """The shard of a CED bounded replay: tokens [start, total_len) of input_ids [B, total_len],
        whose global entries (layer, name) -> [B, S, .] are already computed."""
        return ReplayShard(start, total_len, entries, input_ids)


class ReplayShard(SequenceShard):
    """Decoder layers over the last tokens of a prompt (CED bounded replay): global entries come
    precomputed from the encoder output; no window rows exist before the first replayed token."""

    def __init__(self, start: int, total_len: int, entries: dict, input_ids: torch.Tensor):
        B = input_ids.shape[0]
        doc_start = torch.zeros(B, total_len - start, dtype=torch.long, device=input_ids.device)
        history = input_ids[:, max(start - HISTORY_TOKENS, 0):start] if start > 0 else None
        super().__init__(start, total_len, doc_start, history)
        self.entries = entries

    def gather(self, t: torch.Tensor, layer: int = -1, name: str = "") -> torch.Tensor:
        return self.entries[(layer, name)]


class _Sealable:
    """Forward state that ignores writes once sealed. Activation checkpointing re-runs a block's
    forward in the backward; what that recomputation writes here is not needed (later layers
    already read the forward's tensors) and would hold the recomputed graph, and through it this
    runtime, in a reference cycle: memory that grew with sequence length every step until the
    garbage collector ran."""
    sealed = False


class ForwardDict(dict, _Sealable):
    def __setitem__(self, key, value) -> None:
        if not self.sealed:
            super().__setitem__(key, value)


class ForwardList(list, _Sealable):
    def append(self, value) -> None:
        if not self.sealed:
            super().append(value)


class AttentionRuntime:
    def __init__(self, batch: int, seq_len: int, device: torch.device,
                 doc_ids: Optional[torch.Tensor] = None, with_indexer_loss: bool = False,
                 indexer_mode: str = "sparse", collect_recall: bool = False,
                 shard: Optional[SequenceShard] = None, token_types: Optional[torch.Tensor] = None):
        """indexer_mode: "sparse" attends to each query's top-k (the model as specified);
        "dense" attends to every visible entry (the indexer's dense warm-up, DeepSeek-V3.2).
        collect_recall: measure how much of the dense attention mass the top-k and the pool hold.
        token_types [B, T]: TEXT (-1) or an image-span type (conf.model), None: all text."""
        if indexer_mode not in ("sparse", "dense"):
            raise ValueError(f"indexer_mode={indexer_mode!r}: expected sparse or dense")
        self.shard = shard or SequenceShard()
        self.total_len = self.shard.total_len or seq_len
        offset = self.shard.offset
        self.positions = self.shard.positions(batch, seq_len, device)  # [B, T] global
        if self.shard.doc_start is not None:
            self.doc_start = self.shard.doc_start
        elif doc_ids is None:
            self.doc_start = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
        else:
            self.doc_start = document_starts(doc_ids) + offset
        # Image spans: the MoE routes their tokens with the vision bias, and Engram n-grams neither
        # include nor cross them (the public code treats span tokens as dead: an n-gram's look-back
        # stops there, as at a document start). Attention and the indexer stay causal over them.
        self.token_types = token_types
        self.image_mask = None if token_types is None else token_types >= 0  # [B, T]
        self.ngram_start = self.doc_start
        if self.image_mask is not None and bool(self.image_mask.any()):
            after_image = torch.where(self.image_mask, self.positions + 1, torch.zeros_like(self.positions))
            self.ngram_start = torch.maximum(self.doc_start, after_image.cummax(dim=1).values)
        self.with_indexer_loss = with_indexer_loss
        self.indexer_mode, self.collect_recall = indexer_mode, collect_recall
        # per-layer means
        self.recall: dict[str, list[torch.Tensor]] = {"topk": ForwardList(), "pool": ForwardList()}
        self.kv: dict[int, torch.Tensor] = ForwardDict()  # owner layer -> compressed latent [B, S, C]
        self.index_k: dict[int, torch.Tensor] = ForwardDict()  # owner layer -> index keys [B, S, Di]
        self.topk: dict[int, torch.Tensor] = ForwardDict()  # Full/Reindex layer -> entry ids [B, T, k]
        self.pool: dict[int, torch.Tensor] = ForwardDict()  # pool-building layer -> entry ids [B, T, P]
        self.indexer_losses: list[torch.Tensor] = ForwardList()
        self.aux_losses: list[torch.Tensor] = ForwardList()  # MoE balance losses
        self._visible: dict[int, torch.Tensor] = {}

    def seal(self) -> None:
        """The forward is over and its outputs are read: later writes (recomputation) are dropped."""
        for state in (self.kv, self.index_k, self.topk, self.pool, self.indexer_losses, self.aux_losses,
                      *self.recall.values()):
            state.sealed = True

    def visible(self, m: int, rows: slice = slice(None)) -> torch.Tensor:
        """[B, T, S] bool: compressed entry j (tokens j*m .. j*m+m-1) is visible to query t when
        the whole block is in t's past, (j+1)*m <= t+1, and inside t's document. `rows`: only
        those queries (a chunk of a long sequence; not cached, since it is O(T * S) in all)."""
        whole = rows == slice(None)
        if whole and m in self._visible:
            return self._visible[m]
        j = torch.arange(self.total_len // m, device=self.positions.device)
        t = self.positions[:, rows].unsqueeze(-1)
        causal = (j + 1) * m <= t + 1
        same_doc = j * m >= self.doc_start[:, rows].unsqueeze(-1)
        vis = causal & same_doc
        if whole:
            self._visible[m] = vis
        return vis

    def all_visible(self, m: int, rows: slice = slice(None)) -> torch.Tensor:
        """[B, T, S] entry ids, -1 where invisible: "select everything" for dense attention."""
        vis = self.visible(m, rows)
        ids = torch.arange(vis.shape[-1], device=vis.device).expand_as(vis)
        return torch.where(vis, ids, torch.full_like(ids, -1))

    def newest_visible(self, m: int, rows: slice = slice(None)) -> torch.Tensor:
        """[B, T]: the newest visible compressed entry per query, -1 when none."""
        positions, doc_start = self.positions[:, rows], self.doc_start[:, rows]
        newest = (positions + 1) // m - 1
        ok = (newest >= 0) & (newest * m >= doc_start)
        return torch.where(ok, newest, torch.full_like(newest, -1))
