"""Context parallelism: each rank of a CP group holds a contiguous slice of the sequence.

Token-local work (projections, MoE, mHC, Engram) needs nothing. Attention needs two things
from the other slices, both small next to the tokens themselves:
  - the compressed global KV and index keys of the whole sequence (890 bytes per token at
    full scale): every layer that writes them all-gathers them along the sequence;
  - the last window-1 window-KV rows of the previous slice (a halo).
Both exchanges are autograd functions: the gradient of a gathered tensor is summed over
the group and each rank keeps its own slice's part.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from conf.errors import ConfigError
from model.runtime import HISTORY_TOKENS, SequenceShard, document_starts


class _GatherSequence(torch.autograd.Function):
    """[B, n, ...] per rank -> [B, n * size, ...] in rank order; backward: sum, keep own part."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group, size: int, rank: int):
        ctx.group, ctx.rank, ctx.n = group, rank, t.shape[1]
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[:, ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n], None, None, None


class ContextParallelShard(SequenceShard):
    def __init__(self, group, size: int, rank: int, offset: int, total_len: int, doc_start: torch.Tensor,
                 history: Optional[torch.Tensor]):
        super().__init__(offset=offset, total_len=total_len, doc_start=doc_start, history=history, parts=size)
        self.group, self.size, self.rank = group, size, rank

    def gather(self, t: torch.Tensor, layer: int = -1, name: str = "") -> torch.Tensor:
        return _GatherSequence.apply(t, self.group, self.size, self.rank)

    def halo(self, t: torch.Tensor, n: int, layer: int = -1) -> Optional[torch.Tensor]:
        tails = _GatherSequence.apply(t[:, t.shape[1] - n:], self.group, self.size,
                                      self.rank)  # [B, size*n, C]
        if self.rank == 0:  # nothing before the sequence; zeros keep rank 0 in the backward exchange
            return tails[:, :n] * 0
        return tails[:, (self.rank - 1) * n:self.rank * n]

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach().clone()
        dist.all_reduce(t, group=self.group)
        return t


def check_slices(seq_len: int, cp: int, window: int, max_ratio: int, max_ngram: int = 1) -> int:
    """The length of one slice; ConfigError when the sequence cannot be cut for CP."""
    if cp > 1 and max_ngram - 1 > HISTORY_TOKENS:
        raise ConfigError(f"context parallelism passes {HISTORY_TOKENS} ids of history to each slice; Engram "
                          f"order {max_ngram} needs {max_ngram - 1}")
    if seq_len % cp:
        raise ConfigError(f"trainer.context_parallel={cp} does not divide data.seq_len={seq_len}")
    local = seq_len // cp
    if cp > 1 and local % max_ratio:
        raise ConfigError(f"a context-parallel slice of {local} tokens must be a multiple of the compress "
                          f"ratio {max_ratio}")
    if cp > 1 and local < window - 1:
        raise ConfigError(f"a context-parallel slice of {local} tokens is shorter than the window halo "
                          f"{window - 1}")
    return local


def slice_batch(batch: dict[str, torch.Tensor],
                layout) -> tuple[dict[str, torch.Tensor], ContextParallelShard]:
    """This rank's slice of a full-sequence batch and the shard that describes it."""
    T = batch["input_ids"].shape[1]
    n = T // layout.cp
    lo, hi = layout.cp_rank * n, (layout.cp_rank + 1) * n
    doc_start = (document_starts(batch["doc_ids"]) if "doc_ids" in batch
                 else torch.zeros_like(batch["input_ids"]))
    history = batch["input_ids"][:, max(lo - HISTORY_TOKENS, 0):lo] if lo > 0 else None
    shard = ContextParallelShard(layout.cp_group, layout.cp, layout.cp_rank, lo, T, doc_start[:, lo:hi],
                                 history)
    return {k: v[:, lo:hi] for k, v in batch.items()}, shard
