"""Triton top-k selection for the indexer. Reference: `model.indexer.select_topk` (built on
`topk_ids`): the k largest scores of each row, ties at the k-th value to the lowest columns,
entries scored -inf dropped, ids ascending and -1 padded to exactly k.

One program per row (one query's scores [S] fp32, S <= MAX_S), the row held in registers:
  1. scores -> order-preserving uint32 keys (sign bit flipped for x >= 0, all bits for x < 0);
  2. the k-th largest key, built bit by bit from the top (radix select): up to 32 rounds, each one
     compare + count over the row, keep the bit if at least k keys are >= the candidate; done
     as soon as exactly k keys are >= it (the set is then fixed);
  3. take = key > kth, plus the first (k - #above) keys == kth in column order (a running count
     of the ties), minus the -inf entries; each taken column's output slot is the running count
     of takes before it, so the ids come out ascending with no sort, and the slots past the last
     take get -1.
The reference makes two torch.topk passes, a cumulative count in int64 and a sort, over every
[B, T, S] score; this reads the scores once and writes [B, T, k]. No gradient (selection runs
under no_grad).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from model.indexer import _sort_padded, select_topk

INTERPRET = bool(triton.knobs.runtime.interpret)
MAX_S = 16384  # wider rows (long contexts) take the reference path: the row would not fit in registers


@triton.jit
def _select_kernel(SC, POS, OUT, S, K, HAS_POS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr):
    # SC [R, S] fp32; POS [R, S] int64 entry ids (HAS_POS) else the column is the id; OUT [R, K] int64
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_S)
    in_row = cols < S
    x = tl.load(SC + row * S + cols, mask=in_row, other=float("-inf"))
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 ties with 0.0 (as in the reference's ==), so one key for both
    bits = x.to(tl.uint32, bitcast=True)
    key = tl.where((bits >> 31) != 0, ~bits, bits | 0x80000000)  # larger float -> larger key
    key = tl.where(in_row, key, 0)  # padding sorts below -inf (whose key is 0x007FFFFF)
    kth = tl.zeros((), dtype=tl.uint32)
    n_ge = tl.full((), BLOCK_S, tl.int32)  # #(key >= kth): every slot, padding included
    i = 0
    # largest t with #(key >= t) >= K is the K-th largest key. Once exactly K keys are >= kth
    # the selected set is fixed, and the lower bits cannot change it: stop there (distinct
    # scores separate after ~log2(S) + a few rounds, not 32)
    while (i < 32) & (n_ge != K):
        cand = kth | (tl.full((), 1, tl.uint32) << (31 - i))
        n = tl.sum((key >= cand).to(tl.int32), 0)
        kth = tl.where(n >= K, cand, kth)
        n_ge = tl.where(n >= K, n, n_ge)
        i += 1
    # fewer than K entries in the row: kth stays 0 and every entry is "above". Stopped early,
    # kth may lie between keys: above and tied then hold exactly K keys, all taken
    above = key > kth
    tied = key == kth
    n_above = tl.sum(above.to(tl.int32), 0)
    take = above | (tied & (tl.cumsum(tied.to(tl.int32), 0) <= K - n_above))
    take = take & (key > 0x007FFFFF)  # -inf entries are not selected
    slot = tl.cumsum(take.to(tl.int32), 0) - 1
    if HAS_POS:
        ids = tl.load(POS + row * S + cols, mask=in_row, other=-1)
    else:
        ids = cols.to(tl.int64)
    tl.store(OUT + row * K + slot, ids, mask=take)
    n_taken = tl.sum(take.to(tl.int32), 0)
    offs_k = tl.arange(0, BLOCK_K)
    tl.store(OUT + row * K + offs_k, tl.full([BLOCK_K], -1, tl.int64),
             mask=(offs_k >= n_taken) & (offs_k < K))


@torch.compiler.disable  # trainer.compile: a graph break, launched as is (model/kernels/__init__.py)
def select_topk_triton(scores: torch.Tensor, k: int,
                       positions: Optional[torch.Tensor] = None) -> torch.Tensor:
    """As `model.indexer.select_topk`: scores [B, T, S] (-inf = invisible), optional positions
    [B, T, S] mapping columns to entry ids -> ids [B, T, k] int64, ascending, -1 padded."""
    B, T, S = scores.shape
    if S > MAX_S or S == 0:
        return select_topk(scores, k, positions)
    sc = scores.detach().float().contiguous()
    out = torch.empty(B, T, k, dtype=torch.int64, device=scores.device)
    pos = sc if positions is None else positions.to(torch.int64).contiguous()  # unread without positions
    block_s = max(16, triton.next_power_of_2(S))
    _select_kernel[(B * T,)](sc, pos, out, S, k, HAS_POS=positions is not None, BLOCK_S=block_s,
                             BLOCK_K=max(16, triton.next_power_of_2(k)),
                             num_warps=1 if INTERPRET else min(16, max(4, block_s // 512)))
    # taken columns come out in column order; mapped through positions they need not be ascending
    return out if positions is None else _sort_padded(out)
