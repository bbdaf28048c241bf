"""Engram's gated residual add, forward and backward. Reference: `model.engram.Engram.gated_residual`
(docs/ARCHITECTURE.md §5), applied to the fused key/value projection's output kv [..., S + 1, D] (S stream
keys, then the value) and the residual streams h [..., S, D], with per-stream weights w_h, w_k [S, D]:

    rh_s = rsqrt(mean_D h_s^2 + eps)    rk_s = rsqrt(mean_D k_s^2 + eps)
    d_s  = sum_D(h_s w_h,s w_k,s k_s) rh_s rk_s / sqrt(D)
    gate_s = sigmoid(copysign(sqrt(max(|d_s|, 1e-6)), d_s))          (d = +0 -> +1e-3, as torch.copysign)
    out_s = h_s + gate_s * v

The reference is about a dozen eager kernels each way over [B, T, S, D] (an fp32 copy of kv, the
two RMS factors, products, a sum, the gate, the add). Here a token is one program: the forward reads
h and kv once and writes out, keeping per stream the two RMS factors, d and the gate ([tokens, S, 4]
fp32) for the backward, which reads h, kv and the output's gradient once and writes the gradients
of h and kv. With p_s = sum_D h k w_h w_k (so d = p rh rk / sqrt(D)) and c_s = dL/dd_s / sqrt(D),
the RMS factors' backward collapses to per-stream scalars:

    g_h = g_out + c rh rk (w_h w_k) k - h c rh^3 rk p / D
    g_k =         c rh rk (w_h w_k) h - k c rk^3 rh p / D        g_v = sum_s gate_s g_out_s
    g_w_h = w_k * Q,  g_w_k = w_h * Q,  Q_s = sum_tokens c_s rh_s rk_s h_s k_s   ([S, D] like the weights)

The sum p gets + 0.0 before it scales d, so a sum of negative zeros is +0 as in torch's reduction
and the gate sees the sign torch.copysign sees (on an H200 tl.sum of -0s alone gives -0). Math in
fp32; out, g_h and g_kv are rounded once to h's / kv's dtype. Backward programs walk a share of the
tokens and keep their part of Q in registers ([S, D], one more tile); the host adds the
[programs, S, D] partials. A tile holds a token's whole rows ([S, D] padded to powers of two), ~32
fp32 values of a tile a thread. The weights and the Q accumulator stay in registers for all of a
program's tokens (one [S, D] tile each): a backward that reloads the weights per token is slower.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from model.engram import GATE_EPS  # |d| is clamped to it under the square root
from model.kernels.rms_norm import reduction_programs


@triton.jit
def _gate(d, EPS: tl.constexpr):
    u = tl.sqrt(tl.maximum(tl.abs(d), EPS))
    negative = d.to(tl.int32, bitcast=True) < 0  # the sign bit, as copysign reads it
    return tl.sigmoid(tl.where(negative, -u, u))


@triton.jit
def _gate_fwd_kernel(H, KV, WH, WK, OUT, STATS, D, eps, scale,
                     S: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, EPS: tl.constexpr):
    # H, OUT [N, S, D]; KV [N, S + 1, D]; WH, WK [S, D] fp32; STATS [N, S, 4] fp32: rh, rk, d, gate
    tok = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    c = tl.arange(0, BLOCK_D)
    s_ok, c_ok = s < S, c < D
    ok = s_ok[:, None] & c_ok[None, :]
    offs = s[:, None] * D + c[None, :]
    h = tl.load(H + tok * S * D + offs, mask=ok, other=0.0).to(tl.float32)  # [BS, BD]
    k = tl.load(KV + tok * (S + 1) * D + offs, mask=ok, other=0.0).to(tl.float32)  # [BS, BD]
    v = tl.load(KV + tok * (S + 1) * D + S * D + c, mask=c_ok, other=0.0).to(tl.float32)  # [BD]
    whk = tl.load(WH + offs, mask=ok, other=0.0) * tl.load(WK + offs, mask=ok, other=0.0)  # [BS, BD]
    rh = tl.rsqrt(tl.sum(h * h, 1) / D + eps)  # [BS]
    rk = tl.rsqrt(tl.sum(k * k, 1) / D + eps)
    d = (tl.sum(h * whk * k, 1) + 0.0) * (rh * rk) * scale  # + 0.0: -0 sums become +0, as in torch
    gate = _gate(d, EPS)
    tl.store(OUT + tok * S * D + offs, (h + gate[:, None] * v[None, :]).to(OUT.dtype.element_ty), mask=ok)
    st = STATS + tok * S * 4 + s * 4
    tl.store(st, rh, mask=s_ok)
    tl.store(st + 1, rk, mask=s_ok)
    tl.store(st + 2, d, mask=s_ok)
    tl.store(st + 3, gate, mask=s_ok)


@triton.jit
def _gate_bwd_kernel(H, KV, WH, WK, STATS, GOUT, GH, GKV, Q_PART, n_tok, D, scale,
                     S: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, EPS: tl.constexpr):
    # GOUT, GH [N, S, D]; GKV [N, S + 1, D]; Q_PART [programs, S, D] fp32 (see the module docstring)
    pid = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    c = tl.arange(0, BLOCK_D)
    s_ok, c_ok = s < S, c < D
    ok = s_ok[:, None] & c_ok[None, :]
    offs = s[:, None] * D + c[None, :]
    whk = tl.load(WH + offs, mask=ok, other=0.0) * tl.load(WK + offs, mask=ok, other=0.0)  # [BS, BD]
    q = tl.zeros([BLOCK_S, BLOCK_D], dtype=tl.float32)
    tok = pid.to(tl.int64)  # int64: N * S * D may pass 2^31
    for _ in range(pid, n_tok, tl.num_programs(0)):
        h = tl.load(H + tok * S * D + offs, mask=ok, other=0.0).to(tl.float32)
        k = tl.load(KV + tok * (S + 1) * D + offs, mask=ok, other=0.0).to(tl.float32)
        v = tl.load(KV + tok * (S + 1) * D + S * D + c, mask=c_ok, other=0.0).to(tl.float32)
        g = tl.load(GOUT + tok * S * D + offs, mask=ok, other=0.0).to(tl.float32)
        st = STATS + tok * S * 4 + s * 4
        rh = tl.load(st, mask=s_ok, other=0.0)
        rk = tl.load(st + 1, mask=s_ok, other=0.0)
        d = tl.load(st + 2, mask=s_ok, other=0.0)
        gate = tl.load(st + 3, mask=s_ok, other=0.0)
        # out = h + gate v -> gate -> u = copysign(sqrt(max(|d|, EPS)), d) -> d = p rh rk * scale
        g_u = tl.sum(g * v[None, :], 1) * gate * (1.0 - gate)
        a = tl.abs(d)
        # du/dd = 1 / (2 sqrt|d|) on both sides; clamp_min passes at the bound, and |d| >= EPS > 0
        g_d = tl.where(a >= EPS, g_u * 0.5 / tl.sqrt(tl.maximum(a, EPS)), 0.0)
        cs = g_d * scale  # dL/dp / (rh rk)  [BS]
        p = tl.sum(h * whk * k, 1)
        crr = cs * rh * rk
        gh = g + crr[:, None] * whk * k - h * (crr * rh * rh * p / D)[:, None]
        gk = crr[:, None] * whk * h - k * (crr * rk * rk * p / D)[:, None]
        gv = tl.sum(gate[:, None] * g, 0)
        q += crr[:, None] * h * k
        tl.store(GH + tok * S * D + offs, gh.to(GH.dtype.element_ty), mask=ok)
        tl.store(GKV + tok * (S + 1) * D + offs, gk.to(GKV.dtype.element_ty), mask=ok)
        tl.store(GKV + tok * (S + 1) * D + S * D + c, gv.to(GKV.dtype.element_ty), mask=c_ok)
        tok += tl.num_programs(0)
    tl.store(Q_PART + pid.to(tl.int64) * S * D + offs, q, mask=ok)


def _blocks(S: int, D: int) -> tuple[int, int, int]:
    """(padded S, padded D, warps): whole rows a tile, ~32 fp32 values of a [S, D] tile a thread."""
    block_s, block_d = triton.next_power_of_2(S), triton.next_power_of_2(D)
    return block_s, block_d, min(16, max(4, block_s * block_d // 1024))


class _EngramGate(torch.autograd.Function):
    """Flat shapes: h [N, S, D], kv [N, S + 1, D]; w_h, w_k [S, D] fp32 contiguous."""

    @staticmethod
    def forward(ctx, h, kv, w_h, w_k, eps: float):
        N, S, D = h.shape
        out = torch.empty_like(h)
        stats = torch.empty(N, S, 4, dtype=torch.float32, device=h.device)
        block_s, block_d, warps = _blocks(S, D)
        if N:
            _gate_fwd_kernel[(N,)](h, kv, w_h, w_k, out, stats, D, eps, D ** -0.5,
                                   S=S, BLOCK_S=block_s, BLOCK_D=block_d, EPS=GATE_EPS, num_warps=warps)
        ctx.save_for_backward(h, kv, w_h, w_k, stats)
        return out

    @staticmethod
    def backward(ctx, g_out):
        h, kv, w_h, w_k, stats = ctx.saved_tensors
        N, S, D = h.shape
        block_s, block_d, warps = _blocks(S, D)
        programs = reduction_programs(N, h.device) if N else 1
        g_h, g_kv = torch.empty_like(h), torch.empty_like(kv)
        q_part = torch.zeros(programs, S, D, dtype=torch.float32, device=h.device)
        if N:
            _gate_bwd_kernel[(programs,)](h, kv, w_h, w_k, stats, g_out.contiguous(), g_h, g_kv, q_part, N, D,
                                          D ** -0.5, S=S, BLOCK_S=block_s, BLOCK_D=block_d, EPS=GATE_EPS,
                                          num_warps=warps)
        q = q_part.sum(0)  # [S, D]
        return g_h, g_kv, q * w_k, q * w_h, None


@torch.compiler.disable  # reached only outside torch.compile (see Engram.forward)
def engram_gate_triton(h: torch.Tensor, kv: torch.Tensor, w_h: torch.Tensor, w_k: torch.Tensor,
                       eps: float) -> torch.Tensor:
    """`Engram.gated_residual(h, kv)`: h [..., S, D] streams, kv [..., S + 1, D] (any float dtype),
    w_h / w_k the Engram's per-stream weights [S, D] (hidden_norm_weight, key_norm_weight), eps the
    RMS epsilon -> h + gate * value, h's dtype. Differentiable in h, kv, w_h and w_k."""
    *lead, S, D = h.shape
    if tuple(kv.shape) != (*lead, S + 1, D):
        raise ValueError(f"kv {tuple(kv.shape)} must be [..., {S + 1}, {D}] for h {tuple(h.shape)}")
    if tuple(w_h.shape) != (S, D) or tuple(w_k.shape) != (S, D):
        raise ValueError(f"w_h {tuple(w_h.shape)} and w_k {tuple(w_k.shape)} must be [{S}, {D}]")
    N = math.prod(lead)
    out = _EngramGate.apply(h.reshape(N, S, D).contiguous(), kv.reshape(N, S + 1, D).contiguous(),
                            w_h.float().contiguous(), w_k.float().contiguous(), float(eps))
    return out.view(h.shape)
