"""Sinkhorn projection of the mHC stream-mixing logits (Triton forward and backward).

Replaces the plain-PyTorch reference `model.mhc.sinkhorn_comb` in
`HyperConnection.coefficients` (Block swaps it in when model.kernels=true):

    comb = softmax_rows(logits) + eps;  comb /= col_sums(comb) + eps                 # round 1
    repeat iters - 1 times:  comb /= row_sums(comb) + eps;  comb /= col_sums(comb) + eps

per token, on an n x n matrix (n = 4 streams, iters = 20: two such calls per block). Eager
PyTorch spends ~80 tiny kernel launches on the forward and ~160 on the backward of each call;
on a training step or a decode step those launches, not the math, are the cost. Here the
forward is one launch and the backward one launch (plus allocations).

Layout: one program handles BT tokens (rows of the flattened [T, n*n] logits); each token's
matrix lives in registers as a tuple of n*n [BT] vectors, entry i*n + j = row i, column j
(as `_token_coeffs` in model/kernels/mhc.py). Row and column sums are then elementwise adds
within a thread (no cross-lane reductions, no padding: any n works, n*n registers a token;
n <= 8 accepted). Loads and stores are strided by n*n elements; at 64 bytes a token (n = 4)
L1 absorbs that.

Backward: the exact gradient of the same rounds, by reverse sweep. Each normalisation
Y = X / s (s = eps + the row or column sums of X) has the vector-Jacobian product
    dX = (G - <G, Y>) / s        (<G, Y> summed along the same axis as s),
and the softmax P = softmax(L) has dL = P * (dP - <dP, P>)  (the eps shift has no gradient).
The sweep needs each round's input matrix in reverse order. Nothing is saved by the forward
but the logits (64 bytes a token, which the caller keeps alive anyway): the backward kernel
recomputes the rounds with the forward's own operations (so bitwise the forward's matrices),
writes each round's input matrix to a scratch buffer [iters - 1, n*n, T] (token-minor:
coalesced; (iters - 1) * n*n * 4 bytes a token, 1.2 KB for n = 4, iters = 20, alive only
during the kernel, written and read back by the same program, mostly from L2), then walks
the rounds backwards, recomputing within a round its row sums, the row-normalised matrix, the
column sums and the round's output from the stored input. The first round (softmax, +eps,
column normalisation) is recomputed from the logits at the end.
Alternatives not taken: keeping all rounds in registers (iters would have to be a constexpr,
and 20 rounds * 16 values for n = 4 is more than a thread's 255 registers), and reconstructing each round's
input from its output and normalisers in the reverse sweep (X = Y * s: no scratch, but rounding error
accumulates over the rounds: not the exact gradient of what the forward computed).

One launch each way replaces the eager composition's ~80; at training and decoding sizes the
kernel is launch-bound (`bench/kernels/mhc.py` measures it).

Contract (`sinkhorn_comb_triton`, the signature and semantics of `sinkhorn_comb`):
    logits [..., n, n] any float dtype -> comb [..., n, n] in logits' dtype
Math is fp32 for fp32 / bf16 / fp16 inputs (the reference computes in the input dtype; the
model's HyperConnection works in fp32, so there the two agree to rounding) and fp64 for fp64
inputs (gradcheck). Differentiable in logits.
"""
from __future__ import annotations

import math
import os
from typing import Optional

import torch
import triton
import triton.language as tl

MAX_STREAMS = 8  # n*n values a token in registers (sm_90: n = 8 bwd 202 regs, no spills)


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _load_mat(ptr, t64, t_ok, NN: tl.constexpr, DT: tl.constexpr):
    """[T, n*n] row-major matrices of tokens t -> tuple of n*n [BT] vectors in DT."""
    m = ()
    for e in tl.static_range(NN):
        m = m + (tl.load(ptr + t64 * NN + e, mask=t_ok, other=0.0).to(DT),)
    return m


@triton.jit
def _store_mat(ptr, m, t64, t_ok, NN: tl.constexpr):
    for e in tl.static_range(NN):
        tl.store(ptr + t64 * NN + e, m[e].to(ptr.dtype.element_ty), mask=t_ok)


@triton.jit
def _row_sums(m, N: tl.constexpr):
    s = ()
    for i in tl.static_range(N):
        acc = m[i * N]
        for j in tl.static_range(1, N):
            acc = acc + m[i * N + j]
        s = s + (acc,)
    return s


@triton.jit
def _col_sums(m, N: tl.constexpr):
    s = ()
    for j in tl.static_range(N):
        acc = m[j]
        for i in tl.static_range(1, N):
            acc = acc + m[i * N + j]
        s = s + (acc,)
    return s


@triton.jit
def _plus(s, eps, N: tl.constexpr):
    """Each of the N sums plus eps: the divisor of every normalisation (as DeepSeek's kernel)."""
    out = ()
    for i in tl.static_range(N):
        out = out + (s[i] + eps,)
    return out


@triton.jit
def _div_rows(m, s, N: tl.constexpr):
    out = ()
    for i in tl.static_range(N):
        for j in tl.static_range(N):
            out = out + (m[i * N + j] / s[i],)
    return out


@triton.jit
def _div_cols(m, s, N: tl.constexpr):
    out = ()
    for i in tl.static_range(N):
        for j in tl.static_range(N):
            out = out + (m[i * N + j] / s[j],)
    return out


@triton.jit
def _mul(a, b, NN: tl.constexpr):
    out = ()
    for e in tl.static_range(NN):
        out = out + (a[e] * b[e],)
    return out


@triton.jit
def _norm_rows_bwd(g, y, s, N: tl.constexpr):
    """VJP of y = x / s, s = row_sums(x) + eps: (g - <g, y>_row) / s."""
    gy = _row_sums(_mul(g, y, N * N), N)
    out = ()
    for i in tl.static_range(N):
        for j in tl.static_range(N):
            out = out + ((g[i * N + j] - gy[i]) / s[i],)
    return out


@triton.jit
def _norm_cols_bwd(g, y, s, N: tl.constexpr):
    """VJP of y = x / s, s = col_sums(x) + eps: (g - <g, y>_col) / s."""
    gy = _col_sums(_mul(g, y, N * N), N)
    out = ()
    for i in tl.static_range(N):
        for j in tl.static_range(N):
            out = out + ((g[i * N + j] - gy[j]) / s[j],)
    return out


@triton.jit
def _first_round(lg, eps, N: tl.constexpr):
    """Round 1 from the logits: (softmax P, cs = col_sums(P + eps) + eps, comb = (P + eps) / cs)."""
    p = ()
    for i in tl.static_range(N):
        mx = lg[i * N]
        for j in tl.static_range(1, N):
            mx = tl.maximum(mx, lg[i * N + j])
        ex = ()
        for j in tl.static_range(N):
            ex = ex + (tl.exp(lg[i * N + j] - mx),)
        z = ex[0]
        for j in tl.static_range(1, N):
            z = z + ex[j]
        for j in tl.static_range(N):
            p = p + (ex[j] / z,)
    pe = ()
    for e in tl.static_range(N * N):
        pe = pe + (p[e] + eps,)
    cs = _plus(_col_sums(pe, N), eps, N)
    return p, cs, _div_cols(pe, cs, N)


@triton.jit
def _sinkhorn_fwd_kernel(lg_ptr, out_ptr, T, rounds, eps,
                         N: tl.constexpr, BT: tl.constexpr, DT: tl.constexpr):
    """Program: BT tokens; logits [T, n*n] -> comb [T, n*n], all rounds in registers."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    t_ok = t < T
    t64 = t.to(tl.int64)
    lg = _load_mat(lg_ptr, t64, t_ok, N * N, DT)
    _, _, c = _first_round(lg, eps, N)
    for _ in range(rounds):  # the other iters - 1 rounds
        c = _div_rows(c, _plus(_row_sums(c, N), eps, N), N)
        c = _div_cols(c, _plus(_col_sums(c, N), eps, N), N)
    _store_mat(out_ptr, c, t64, t_ok, N * N)


@triton.jit
def _sinkhorn_bwd_kernel(lg_ptr, g_ptr, glg_ptr, scratch_ptr, T, rounds, eps,
                         N: tl.constexpr, BT: tl.constexpr, DT: tl.constexpr):
    """Program: BT tokens; logits and dL/dcomb [T, n*n] -> dL/dlogits [T, n*n]. Recomputes
    the rounds, keeping each round's input in scratch [rounds, n*n, T], then sweeps back."""
    NN: tl.constexpr = N * N
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    t_ok = t < T
    t64 = t.to(tl.int64)
    _, _, c = _first_round(_load_mat(lg_ptr, t64, t_ok, NN, DT), eps, N)
    for r in range(rounds):  # forward again, the same operations: the forward's matrices
        row = (t64 * 0 + r) * NN  # int64: rounds * n*n * T may pass 2^31
        for e in tl.static_range(NN):
            tl.store(scratch_ptr + (row + e) * T + t64, c[e], mask=t_ok)
        c = _div_rows(c, _plus(_row_sums(c, N), eps, N), N)
        c = _div_cols(c, _plus(_col_sums(c, N), eps, N), N)
    # every lane reads back only what it stored, but make the writes visible block-wide anyway
    # (a tile smaller than the block replicates tokens across lanes)
    tl.debug_barrier()
    g = _load_mat(g_ptr, t64, t_ok, NN, DT)
    for k in range(rounds):  # round rounds-1 down to 0
        row = (t64 * 0 + (rounds - 1 - k)) * NN
        x = ()
        for e in tl.static_range(NN):
            x = x + (tl.load(scratch_ptr + (row + e) * T + t64, mask=t_ok, other=1.0),)
        rs = _plus(_row_sums(x, N), eps, N)
        rn = _div_rows(x, rs, N)  # row-normalised
        cs = _plus(_col_sums(rn, N), eps, N)
        y = _div_cols(rn, cs, N)  # the round's output
        g = _norm_rows_bwd(_norm_cols_bwd(g, y, cs, N), rn, rs, N)
    # round 1: comb = (P + eps) / cs, P = softmax(logits)
    p, cs, c = _first_round(_load_mat(lg_ptr, t64, t_ok, NN, DT), eps, N)
    gp = _norm_cols_bwd(g, c, cs, N)
    gpp = _row_sums(_mul(gp, p, NN), N)
    gl = ()
    for i in tl.static_range(N):
        for j in tl.static_range(N):
            gl = gl + (p[i * N + j] * (gp[i * N + j] - gpp[i]),)
    _store_mat(glg_ptr, gl, t64, t_ok, NN)


# ----------------------------------------------------------------------------- autograd
def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _block_t(T: int, block_t: Optional[int]) -> int:
    if block_t is not None:
        return block_t
    if _interpreting():  # the interpreter's cost is per operation: fewest programs is fastest
        return max(16, min(4096, triton.next_power_of_2(max(T, 1))))
    return 128  # one token a lane at 4 warps: n*n = 16 values a matrix, no replication


def _launch_args(x: torch.Tensor, block_t: int):
    dt = tl.float64 if x.dtype == torch.float64 else tl.float32
    return dict(BT=block_t, DT=dt, num_warps=max(1, min(4, block_t // 32)))


class _SinkhornComb(torch.autograd.Function):
    """Flat shapes: logits [T, n*n] fp32 or fp64, contiguous."""

    @staticmethod
    def forward(ctx, logits, n: int, iters: int, eps: float, block_t: int):
        T = logits.shape[0]
        rounds = max(iters - 1, 0)
        out = torch.empty_like(logits)
        if T > 0:
            _sinkhorn_fwd_kernel[(triton.cdiv(T, block_t),)](
                logits, out, T, rounds, eps, N=n, **_launch_args(logits, block_t))
        ctx.save_for_backward(logits)
        ctx.n, ctx.rounds, ctx.eps, ctx.block_t = n, rounds, eps, block_t
        return out

    @staticmethod
    def backward(ctx, g):
        (logits,) = ctx.saved_tensors
        T = logits.shape[0]
        n, rounds = ctx.n, ctx.rounds
        g = g.to(logits.dtype).contiguous()
        g_logits = torch.empty_like(logits)
        scratch = torch.empty(max(rounds * n * n * T, 1), device=logits.device, dtype=logits.dtype)
        if T > 0:
            _sinkhorn_bwd_kernel[(triton.cdiv(T, ctx.block_t),)](
                logits, g, g_logits, scratch, T, rounds, ctx.eps, N=n, **_launch_args(logits, ctx.block_t))
        return g_logits, None, None, None, None


# ----------------------------------------------------------------------------- entry point
@torch.compiler.disable  # trainer.compile: a graph break, launched as is (model/kernels/__init__.py)
def sinkhorn_comb_triton(logits: torch.Tensor, iters: int, eps: float, *,
                         block_t: Optional[int] = None) -> torch.Tensor:
    """[..., n, n] logits -> doubly stochastic matrix, as `model.mhc.sinkhorn_comb` (see the
    module docstring). block_t: tokens a program (a power of two; None picks one)."""
    *lead, n, n2 = logits.shape
    if n != n2 or not 1 <= n <= MAX_STREAMS:
        raise ValueError(f"sinkhorn_comb_triton wants [..., n, n] with n <= {MAX_STREAMS}, got "
                         f"{tuple(logits.shape)}")
    if not logits.is_cuda and not _interpreting():
        raise RuntimeError("model.kernels=true runs Triton kernels: it needs a CUDA device (or "
                           "TRITON_INTERPRET=1)")
    T = math.prod(lead)
    work = torch.float64 if logits.dtype == torch.float64 else torch.float32
    # casts and reshapes stay outside the Function, so autograd casts the gradient back
    out = _SinkhornComb.apply(logits.to(work).reshape(T, n * n).contiguous(), n, int(iters), float(eps),
                              _block_t(T, block_t))
    return out.view(*lead, n, n).to(logits.dtype)
