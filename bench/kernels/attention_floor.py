"""How far the sparse attention kernels are from what their memory traffic allows, at `small`'s
shape in the training step (micro-batch 8 x 4096 queries, H = 16, C = 512, k = 512, W = 128).

At 16 heads a gathered row (C bf16 values, read as both K and V) carries 4 * H * C FLOPs forward,
32 per byte, so the kernels are bound by how fast rows reach the SMs, and the backward also by the
fp32 atomic adds of every selected row's dK = dV. Both ceilings are measured here on the same
index tensor the kernels read, in the same process:
  * gather: one program per query sums its selected rows (the forward's access pattern, no math);
  * atomic: one program per query adds a [C] fp32 row into each selected row of an fp32 [B, S, C]
    buffer (relaxed reductions, as the backward issues them).
The floors are then the kernels' bytes over those rates: forward = every attended row (window +
selected) gathered once; backward = the same gather plus the selected rows' atomic adds (the
window rows' dK = dV is a GEMM kernel of its own, 0.7 ms, left out). `*_frac_of_floor` is floor
over measured time: 1.0 would be a kernel doing nothing but its unavoidable traffic.

Layer kinds: `m1` is a decoder layer (S = 4096 entries, one per position), `m2` an encoder layer
(S = 2048). Selections are the top-k of random scores over each query's visible entries (causal),
as the attention benchmark does; early queries see fewer than k entries.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from bench.timing import copy_bandwidth_gbs, timed_ms

B, T, H, C, K, W = 8, 4096, 16, 512, 512, 128


@triton.jit
def _gather_rows(G, IDX, OUT, T, S, K, C: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // T
    offs_c = tl.arange(0, C)
    acc = tl.zeros([BLOCK_N, C], tl.float32)
    for n0 in range(0, K, BLOCK_N):
        ids = tl.load(IDX + pid * K + n0 + tl.arange(0, BLOCK_N))
        ok = ids >= 0
        rows = b * S + tl.where(ok, ids, 0)
        acc += tl.load(G + rows[:, None] * C + offs_c[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    tl.store(OUT + pid * C + offs_c, tl.sum(acc, 0))


@triton.jit
def _add_rows(DG, IDX, T, S, K, C: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // T
    offs_c = tl.arange(0, C)
    val = tl.full([BLOCK_N, C], 1.0, tl.float32)
    for n0 in range(0, K, BLOCK_N):
        ids = tl.load(IDX + pid * K + n0 + tl.arange(0, BLOCK_N))
        ok = ids >= 0
        rows = b * S + tl.where(ok, ids, 0)
        tl.atomic_add(DG + rows[:, None] * C + offs_c[None, :], val, mask=ok[:, None], sem="relaxed")


def _selection(S: int, ratio: int, device) -> torch.Tensor:
    """idx [B, T, K]: top-k of random scores over the entries complete at each query (entry j
    covers positions j*ratio .. j*ratio + ratio - 1), ascending, -1 padded, as the indexer's."""
    from model.kernels.topk import select_topk_triton

    g = torch.Generator(device=device).manual_seed(S)
    scores = torch.rand(B, T, S, device=device, generator=g)
    visible = ((torch.arange(S, device=device) * ratio + ratio - 1)[None, :]
               <= torch.arange(T, device=device)[:, None])
    return select_topk_triton(scores.masked_fill(~visible, float("-inf")), K)


def _ceilings(glob: torch.Tensor, idx: torch.Tensor, n_rows: int) -> tuple[float, float]:
    """(gather, atomic) GB/s over idx's n_rows selected rows: the best of a few tile shapes each."""
    S = glob.shape[1]
    out = torch.empty(B * T, C, device=glob.device)
    dg = torch.zeros(B, S, C, device=glob.device)
    gather_ms = min(timed_ms(lambda bn=bn, st=st: _gather_rows[(B * T,)](
        glob, idx, out, T, S, K, C=C, BLOCK_N=bn, num_warps=4, num_stages=st))
                    for bn, st in ((16, 3), (32, 3), (16, 4)))
    atomic_ms = min(timed_ms(lambda bn=bn: _add_rows[(B * T,)](dg, idx, T, S, K, C=C, BLOCK_N=bn,
                                                               num_warps=4))
                    for bn in (16, 32))
    return n_rows * C * glob.element_size() / gather_ms / 1e6, n_rows * C * 4 / atomic_ms / 1e6


def _layer(ratio: int, device) -> dict:
    from model.kernels.sparse_attention import sparse_attention_triton

    S = T // ratio
    idx = _selection(S, ratio, device)
    g = torch.Generator(device=device).manual_seed(ratio)
    r = lambda *shape: torch.randn(*shape, device=device, generator=g, dtype=torch.bfloat16).requires_grad_()
    q, win, glob = r(B, T, H, C), r(B, T, C), r(B, S, C)
    sink = torch.zeros(H, device=device, requires_grad=True)
    doc = torch.zeros(B, T, dtype=torch.long, device=device)
    dout = torch.randn(B, T, H, C, device=device, dtype=torch.bfloat16)

    def fwd():
        return sparse_attention_triton(q, win, glob, idx, doc, sink, C ** -0.5, W)[0]

    def fwd_bwd():
        torch.autograd.grad(fwd(), [q, win, glob, sink], dout)

    fwd_ms, fwd_bwd_ms = timed_ms(fwd), timed_ms(fwd_bwd)
    selected = int((idx >= 0).sum())
    gather_gbs, atomic_gbs = _ceilings(glob.detach(), idx, selected)
    window = B * sum(min(W, t + 1) for t in range(T))  # no halo: query t sees t + 1 window rows
    gather_ms = (selected + window) * C * 2 / gather_gbs / 1e6
    atomic_ms = selected * C * 4 / atomic_gbs / 1e6
    bwd_ms = fwd_bwd_ms - fwd_ms
    return {"S": S, "selected_per_query": selected / (B * T), "window_per_query": window / (B * T),
            "kernel_fwd_ms": fwd_ms, "kernel_bwd_ms": bwd_ms, "gather_gbs": gather_gbs,
            "atomic_gbs": atomic_gbs, "floor_fwd_ms": gather_ms, "floor_bwd_ms": gather_ms + atomic_ms,
            "floor_bwd_atomic_ms": atomic_ms,
            "fwd_frac_of_floor": gather_ms / fwd_ms, "bwd_frac_of_floor": (gather_ms + atomic_ms) / bwd_ms}


def bench(device) -> dict:
    torch.cuda.set_device(device)
    out = {"micro_batch": B, "queries": T, "heads": H, "latent": C, "topk": K, "window": W,
           "copy_gbs": copy_bandwidth_gbs()}
    for ratio in (1, 2):
        out[f"m{ratio}"] = _layer(ratio, torch.device("cuda", torch.cuda.current_device()))
        torch.cuda.empty_cache()
    return out


if __name__ == "__main__":
    import json

    print(json.dumps(bench(torch.device("cuda", 0)), indent=1))
