"""Per-forward state that CSA2 layers share: the Full/Reindex/Reuse plumbing (SPEC §3).

A Full layer writes its compressed KV latent, index keys and top-k here; Reindex layers
read the KV and index keys and the Full layer's candidate pool and write their own top-k;
Reuse layers read everything. Reuse and Reindex layers never write KV, which is how the
cache-size accounting and the tests see that they allocate none.
"""
from __future__ import annotations

from typing import Optional

import torch


def document_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    """doc_ids [B, T] (non-decreasing per row) -> first position of each token's document."""
    B, T = doc_ids.shape
    pos = torch.arange(T, device=doc_ids.device).expand(B, T)
    change = torch.ones_like(doc_ids, dtype=torch.bool)
    change[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return torch.where(change, pos, torch.zeros_like(pos)).cummax(dim=1).values


class AttentionRuntime:
    def __init__(self, batch: int, seq_len: int, device: torch.device,
                 doc_ids: Optional[torch.Tensor] = None, with_indexer_loss: bool = False,
                 indexer_mode: str = "sparse", collect_recall: bool = False):
        """indexer_mode: "sparse" attends to each query's top-k (the model as specified);
        "dense" attends to every visible entry (the indexer's dense warm-up, DeepSeek-V3.2).
        collect_recall: measure how much of the dense attention mass the top-k and the pool hold."""
        if indexer_mode not in ("sparse", "dense"):
            raise ValueError(f"indexer_mode={indexer_mode!r}: expected sparse or dense")
        self.positions = torch.arange(seq_len, device=device).expand(batch, seq_len)  # [B, T]
        if doc_ids is None:
            self.doc_start = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
        else:
            self.doc_start = document_starts(doc_ids)
        self.with_indexer_loss = with_indexer_loss
        self.indexer_mode, self.collect_recall = indexer_mode, collect_recall
        self.recall: dict[str, list[torch.Tensor]] = {"topk": [], "pool": []}  # per-layer means
        self.kv: dict[int, torch.Tensor] = {}  # owner layer -> compressed latent [B, S, C]
        self.index_k: dict[int, torch.Tensor] = {}  # owner layer -> index keys [B, S, Di]
        self.topk: dict[int, torch.Tensor] = {}  # Full/Reindex layer -> entry ids [B, T, k]
        self.pool: dict[int, torch.Tensor] = {}  # pool-building layer -> entry ids [B, T, P]
        self.indexer_losses: list[torch.Tensor] = []
        self.aux_losses: list[torch.Tensor] = []  # MoE balance losses
        self._visible: dict[int, torch.Tensor] = {}

    def visible(self, m: int) -> torch.Tensor:
        """[B, T, S] bool: compressed entry j (tokens j*m .. j*m+m-1) is visible to query t when
        the whole block is in t's past, (j+1)*m <= t+1, and inside t's document."""
        if m not in self._visible:
            B, T = self.positions.shape
            j = torch.arange(T // m, device=self.positions.device)
            t = self.positions.unsqueeze(-1)
            causal = (j + 1) * m <= t + 1
            same_doc = j * m >= self.doc_start.unsqueeze(-1)
            self._visible[m] = causal & same_doc
        return self._visible[m]

    def all_visible(self, m: int) -> torch.Tensor:
        """[B, T, S] entry ids, -1 where invisible: "select everything" for dense attention."""
        vis = self.visible(m)
        ids = torch.arange(vis.shape[-1], device=vis.device).expand_as(vis)
        return torch.where(vis, ids, torch.full_like(ids, -1))

    def newest_visible(self, m: int) -> torch.Tensor:
        """[B, T]: the newest visible compressed entry per query, -1 when none."""
        newest = (self.positions + 1) // m - 1
        ok = (newest >= 0) & (newest * m >= self.doc_start)
        return torch.where(ok, newest, torch.full_like(newest, -1))
