"""The mHC stream updates that the fused step (model/kernels/mhc.py) cannot take, in Triton.
References: `model.mhc.update_streams` and `model.mhc.mix_streams` (same math).

Both are one operation, a per-token mix of the n streams:

    out[t, o, :] = sum_i a[t, i, o] * x[t, i, :]  (+ post[t, o] * y[t, :])

    update_streams(h, y, post, comb) = stream_mix(comb, h, post, y)       a = comb [T, n, n]
    mix_streams(pre, h)              = stream_mix(pre[..., None], h)[:, 0]  a = pre [T, n, 1]

They run where a block boundary has no fused step: the first sub-layer's input, the update
before an Engram layer and after the last block (`settle`), the final norm's input. As einsums
they are batched [n, n] @ [n, D] matmuls (and their backward [n, 1] @ [1, D] outer products),
which cuBLAS runs with a 32 x 32 wmma kernel about ten times slower than the bytes they move.

The backward is the same mix with a transposed (dx[t, i] = sum_o a[t, i, o] dout[t, o]; dy is
the mix of dout by post) and one reduction over D for da[t, i, o] = x[t, i] . dout[t, o] and
dpost[t, o] = y[t] . dout[t, o]. Math is fp32; outputs are rounded once to the input dtype.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Tokens x model dims a program (mix), and tokens a program x dims a step (the D reduction); warps of the
# reduction (the fastest of a sweep)
_MIX_T, _MIX_D, _RED_T, _RED_D = (4, 16, 4, 16) if INTERPRET else (8, 256, 8, 128)
_RED_WARPS = 2


@triton.jit
def _mix_kernel(A, X, P, Y, OUT, T, D, s_at, s_ai, s_ao, s_pt, s_po,
                NI: tl.constexpr, NO: tl.constexpr, NIP: tl.constexpr, HAS_Y: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    # X [T, NI, D] and OUT [T, NO, D] contiguous; A [T, NI, NO] and P [T, NO] by strides; Y [T, D]
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    i = tl.arange(0, NIP)
    t_ok, c_ok, i_ok = t < T, c < D, i < NI
    x = tl.load(X + (t[:, None, None] * NI + i[None, :, None]) * D + c[None, None, :],
                mask=(t_ok[:, None] & i_ok[None, :])[:, :, None] & c_ok[None, None, :],
                other=0.0).to(tl.float32)
    tc = t_ok[:, None] & c_ok[None, :]
    if HAS_Y:
        y = tl.load(Y + t[:, None] * D + c[None, :], mask=tc, other=0.0).to(tl.float32)
    for o in tl.static_range(NO):
        a = tl.load(A + t[:, None] * s_at + i[None, :] * s_ai + o * s_ao, mask=t_ok[:, None] & i_ok[None, :],
                    other=0.0).to(tl.float32)  # [BLOCK_T, NIP]
        out = tl.sum(a[:, :, None] * x, axis=1)  # [BLOCK_T, BLOCK_D]
        if HAS_Y:
            out += tl.load(P + t * s_pt + o * s_po, mask=t_ok, other=0.0).to(tl.float32)[:, None] * y
        tl.store(OUT + (t[:, None] * NO + o) * D + c[None, :], out.to(OUT.dtype.element_ty), mask=tc)


@triton.jit
def _reduce_kernel(X, Y, G, DA, DP, T, D, NI: tl.constexpr, NO: tl.constexpr, NIP: tl.constexpr,
                   NOP: tl.constexpr, HAS_Y: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    # DA [T, NI, NO] = sum_c X[t, i, c] G[t, o, c]; DP [T, NO] = sum_c Y[t, c] G[t, o, c] (fp32)
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    i, o = tl.arange(0, NIP), tl.arange(0, NOP)
    ti = (t < T)[:, None] & (i < NI)[None, :]
    to = (t < T)[:, None] & (o < NO)[None, :]
    da = tl.zeros([BLOCK_T, NIP, NOP], dtype=tl.float32)
    dp = tl.zeros([BLOCK_T, NOP], dtype=tl.float32)
    for c0 in range(0, D, BLOCK_D):
        c = c0 + tl.arange(0, BLOCK_D)
        c_ok = c < D
        x = tl.load(X + (t[:, None, None] * NI + i[None, :, None]) * D + c[None, None, :],
                    mask=ti[:, :, None] & c_ok[None, None, :], other=0.0).to(tl.float32)  # [BT, NIP, BD]
        g = tl.load(G + (t[:, None, None] * NO + o[None, :, None]) * D + c[None, None, :],
                    mask=to[:, :, None] & c_ok[None, None, :], other=0.0).to(tl.float32)  # [BT, NOP, BD]
        da += tl.sum(x[:, :, None, :] * g[:, None, :, :], axis=3)
        if HAS_Y:
            y = tl.load(Y + t[:, None] * D + c[None, :], mask=(t < T)[:, None] & c_ok[None, :], other=0.0)
            dp += tl.sum(y.to(tl.float32)[:, None, :] * g, axis=2)
    tl.store(DA + (t[:, None, None] * NI + i[None, :, None]) * NO + o[None, None, :], da,
             mask=ti[:, :, None] & (o < NO)[None, None, :])
    if HAS_Y:
        tl.store(DP + t[:, None] * NO + o[None, :], dp, mask=to)


def _pow2(n: int) -> int:
    return max(2, triton.next_power_of_2(n))


def _mix(a: torch.Tensor, a_strides: tuple[int, int, int], x: torch.Tensor, n_out: int,
         post: Optional[torch.Tensor] = None, y: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [T, NI, D] mixed by a (element (t, i, o) at a_strides) -> [T, n_out, D] in x's dtype."""
    T, NI, D = x.shape
    out = torch.empty(T, n_out, D, dtype=x.dtype, device=x.device)
    has_y = y is not None
    p = post if has_y else a  # unread without y
    if T and D:
        grid = (triton.cdiv(T, _MIX_T), triton.cdiv(D, _MIX_D))
        _mix_kernel[grid](a, x, p, y if has_y else x, out, T, D, *a_strides,
                          *(p.stride() if has_y else (0, 0)), NI=NI, NO=n_out, NIP=_pow2(NI), HAS_Y=has_y,
                          BLOCK_T=_MIX_T, BLOCK_D=_MIX_D, **({} if INTERPRET else {"num_warps": 4}))
    return out


class _StreamMix(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, x, post, y):
        # a [T, NI, NO] fp32, x [T, NI, D] contiguous; post [T, NO] / y [T, D] contiguous or None
        ctx.save_for_backward(a, x, post, y)
        return _mix(a, a.stride(), x, a.shape[2], post, y)

    @staticmethod
    def backward(ctx, g):
        a, x, post, y = ctx.saved_tensors
        need_a, need_x, need_p, need_y = ctx.needs_input_grad
        g = g.contiguous()
        T, NI, D = x.shape
        NO = a.shape[2]
        want_p, want_y = y is not None and need_p, y is not None and need_y
        dx = _mix(a, (a.stride(0), a.stride(2), a.stride(1)), g, NI) if need_x else None  # a transposed
        dy = _mix(post, (post.stride(0), post.stride(1), 0), g, 1).view(T, D).to(y.dtype) if want_y else None
        da = dpost = None
        if need_a or want_p:  # e.g. not for the first sub-layer's constant one-hot pre
            da = torch.empty(T, NI, NO, dtype=torch.float32, device=x.device)
            dpost = torch.empty(T, NO, dtype=torch.float32, device=x.device) if want_p else da
            if T:
                _reduce_kernel[(triton.cdiv(T, _RED_T),)](x, y if want_p else x, g, da, dpost, T, D, NI=NI,
                                                         NO=NO, NIP=_pow2(NI), NOP=_pow2(NO), HAS_Y=want_p,
                                                         BLOCK_T=_RED_T, BLOCK_D=_RED_D,
                                                         **({} if INTERPRET else {"num_warps": _RED_WARPS}))
        return (da.to(a.dtype) if need_a else None), dx, (dpost.to(post.dtype) if want_p else None), dy


@torch.compiler.disable  # trainer.compile: a graph break, launched as is (model/kernels/__init__.py)
def update_streams_triton(h: torch.Tensor, y: torch.Tensor, post: torch.Tensor,
                          comb: torch.Tensor) -> torch.Tensor:
    """`update_streams`: h [..., n, D], y [..., D], post [..., n], comb [..., n, n] -> h' [..., n, D] in
    h's dtype."""
    *lead, n, D = h.shape
    flat = h.reshape(-1, n, D).contiguous()
    out = _StreamMix.apply(comb.float().reshape(-1, n, n), flat, post.float().reshape(-1, n).contiguous(),
                           y.reshape(-1, D).contiguous())
    return out.view(*lead, n, D)


@torch.compiler.disable
def mix_streams_triton(pre: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """`mix_streams`: pre [..., n], h [..., n, D] -> x [..., D] in h's dtype."""
    *lead, n, D = h.shape
    a = pre.float().reshape(-1, n, 1)
    return _StreamMix.apply(a, h.reshape(-1, n, D).contiguous(), None, None).view(*lead, D)
