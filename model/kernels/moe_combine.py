"""Fused MoE combine, forward and backward. Reference: `model.moe.combine_reference`, the tail
of `MoE.dispatch`, which gathers the expert outputs back into token order ([N, k, D]), scales
each row by its routing weight and sums a token's k rows.

Eager PyTorch runs that as a gather, a multiply and a sum over [N, k, D] (and, backward, a
multiply, a product-and-sum for the weights' gradient and a gather), each a pass over
[N, k, D]. Here the forward reads each expert row once and writes
the token's sum; the backward reads the token's output gradient once and each expert row once,
writing that row's gradient and the k weight gradients. Math in fp32; the output is rounded once
to the requested dtype (the reference rounds each weighted row to the rows' dtype first).

The same forward kernel without weights is the backward of the dispatch's gather
(`moe_gather_sum_triton`): the gradient of a token's k copies, summed in one read.

Contract (`moe_combine_triton(y, inv, weights, out_dtype)`):
    y [N*k, D] expert outputs in expert order; inv [N*k] int: choice slot n*k + j (token n's j-th
    expert) is row inv[n*k + j] of y, a permutation; weights [N, k] -> [N, D] in out_dtype.
    Differentiable in y and weights.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _combine_fwd_kernel(Y, INV, W, OUT, N, D, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                        WEIGHTED: tl.constexpr = True):
    # OUT[t] = sum_j W[t, j] * Y[INV[t*K + j]] over a [BLOCK_T, BLOCK_D] tile, fp32 accumulation
    # (without WEIGHTED, W is not read: a plain sum of the k rows, the dispatch gather's gradient)
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t_ok = t < N
    m = t_ok[:, None] & (d < D)[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(K):
        row = tl.load(INV + t * K + j, mask=t_ok, other=0).to(tl.int64)
        yv = tl.load(Y + row[:, None] * D + d[None, :], mask=m, other=0.0).to(tl.float32)
        if WEIGHTED:
            yv *= tl.load(W + t * K + j, mask=t_ok, other=0.0).to(tl.float32)[:, None]
        acc += yv
    tl.store(OUT + t[:, None] * D + d[None, :], acc.to(OUT.dtype.element_ty), mask=m)


@triton.jit
def _combine_bwd_kernel(Y, INV, W, DOUT, DY, DW, N, D, K: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_D: tl.constexpr):
    # whole rows a program (BLOCK_D >= D): DW[t, j] = <DOUT[t], Y[row]> sums over D.
    # DY[row] = W[t, j] * DOUT[t]: inv is a permutation, so every row of DY is written exactly once.
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    t_ok = t < N
    m = t_ok[:, None] & (d < D)[None, :]
    dout = tl.load(DOUT + t[:, None] * D + d[None, :], mask=m, other=0.0).to(tl.float32)
    for j in tl.static_range(K):
        row = tl.load(INV + t * K + j, mask=t_ok, other=0).to(tl.int64)
        w = tl.load(W + t * K + j, mask=t_ok, other=0.0).to(tl.float32)
        at = row[:, None] * D + d[None, :]
        yv = tl.load(Y + at, mask=m, other=0.0).to(tl.float32)
        tl.store(DY + at, (w[:, None] * dout).to(DY.dtype.element_ty), mask=m)
        tl.store(DW + t * K + j, tl.sum(dout * yv, axis=1), mask=t_ok)


def _tiles(D: int):
    """(tokens a program, D columns a program, warps): whole rows of up to 1024 columns with 4
    tokens, wider rows one token at a time (the backward keeps a whole row)."""
    block_d = max(16, triton.next_power_of_2(D))
    return (4 if block_d <= 1024 else 1), block_d, (4 if block_d <= 1024 else 8)


class _MoECombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, inv, weights, out_dtype):
        N, K = weights.shape
        D = y.shape[1]
        out = torch.empty(N, D, dtype=out_dtype, device=y.device)
        block_t, block_d, warps = _tiles(D)
        if N > 0:
            _combine_fwd_kernel[(triton.cdiv(N, block_t), triton.cdiv(D, block_d))](
                y, inv, weights, out, N, D, K=K, BLOCK_T=block_t, BLOCK_D=block_d, num_warps=warps)
        ctx.save_for_backward(y, inv, weights)
        return out

    @staticmethod
    def backward(ctx, dout):
        y, inv, weights = ctx.saved_tensors
        N, K = weights.shape
        D = y.shape[1]
        dy = torch.empty_like(y)
        dw = torch.empty(N, K, dtype=torch.float32, device=y.device)
        block_t, block_d, warps = _tiles(D)
        if N > 0:
            _combine_bwd_kernel[(triton.cdiv(N, block_t),)](
                y, inv, weights, dout.contiguous(), dy, dw, N, D, K=K, BLOCK_T=block_t, BLOCK_D=block_d,
                num_warps=warps)
        return dy, None, dw.to(weights.dtype), None


def moe_gather_sum_triton(g: torch.Tensor, inv: torch.Tensor, k: int, out_dtype: torch.dtype) -> torch.Tensor:
    """The gradient of `MoE.gather_routed`'s copies: g [N*k, D] in expert order, inv [N*k] as in
    `moe_combine_triton` -> [N, D] in out_dtype, row n = sum_j g[inv[n*k + j]] (fp32 sum, one
    rounding). One read of g, where the reference gathers it into token order and then sums.
    Reference: `model.moe._Gather.backward`. Not differentiable (a backward's own step)."""
    if g.dim() != 2 or inv.shape != (g.shape[0],) or g.shape[0] % k:
        raise ValueError(f"moe_gather_sum_triton: g {tuple(g.shape)}, inv {tuple(inv.shape)}, k={k}: "
                         "expected g [N*k, D] and inv [N*k]")
    N, D = g.shape[0] // k, g.shape[1]
    out = torch.empty(N, D, dtype=out_dtype, device=g.device)
    block_t, block_d, warps = _tiles(D)
    if N > 0:
        g, inv = g.contiguous(), inv.contiguous()
        _combine_fwd_kernel[(triton.cdiv(N, block_t), triton.cdiv(D, block_d))](
            g, inv, g, out, N, D, K=k, BLOCK_T=block_t, BLOCK_D=block_d, WEIGHTED=False, num_warps=warps)
    return out


def moe_combine_triton(y: torch.Tensor, inv: torch.Tensor, weights: torch.Tensor,
                       out_dtype: torch.dtype) -> torch.Tensor:
    """See the module docstring: y [N*k, D], inv [N*k], weights [N, k] -> [N, D] in out_dtype."""
    N, K = weights.shape
    if y.dim() != 2 or y.shape[0] != N * K or inv.shape != (N * K,):
        raise ValueError(f"moe_combine_triton: y {tuple(y.shape)}, inv {tuple(inv.shape)}, "
                         f"weights {tuple(weights.shape)}: expected y [N*k, D], inv [N*k], weights [N, k]")
    return _MoECombine.apply(y.contiguous(), inv.contiguous(), weights.contiguous(), out_dtype)
