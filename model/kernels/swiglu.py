"""Fused clamped SwiGLU, forward and backward. Reference: `model.moe.clamped_swiglu`,
silu(min(gate, limit)) * clamp(up, -limit, limit) (no clamp for limit <= 0).

Eager PyTorch runs the forward as three kernels and its backward as about eight (clamp masks,
silu_backward, products, where), each a pass over [tokens x inter_dim] tensors: at the `small`
step (micro-batch 8: 131072 routed rows x 768, 16 layers) they were ~35 ms of the 1.2 s
forward+backward. Here the forward reads gate and up once and writes h; the backward reads
gate, up and dh once and writes both gradients. Math in fp32, one rounding to the input dtype
per output (the reference rounds after each op in bf16). Saved for backward: gate and up only.

Gradients follow torch.clamp's: they pass where min <= x <= max (bounds included).
Under torch.compile the reference is used instead: inductor fuses those elementwise ops itself,
and a kernel here would be a graph break in the middle of the MoE.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.moe import clamped_swiglu

BLOCK = 1024


@triton.jit
def _swiglu_fwd_kernel(G, U, H, n, limit, CLAMP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(G + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=ok, other=0.0).to(tl.float32)
    if CLAMP:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    h = g * tl.sigmoid(g) * u
    tl.store(H + offs, h.to(H.dtype.element_ty), mask=ok)


@triton.jit
def _swiglu_bwd_kernel(G, U, DH, DG, DU, n, limit, CLAMP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(G + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=ok, other=0.0).to(tl.float32)
    dh = tl.load(DH + offs, mask=ok, other=0.0).to(tl.float32)
    gc = g
    uc = u
    if CLAMP:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
    s = tl.sigmoid(gc)
    dg = dh * uc * s * (1.0 + gc * (1.0 - s))  # d silu(x) / dx = s (1 + x (1 - s))
    du = dh * gc * s
    if CLAMP:
        dg = tl.where(g <= limit, dg, 0.0)
        du = tl.where((u >= -limit) & (u <= limit), du, 0.0)
    tl.store(DG + offs, dg.to(DG.dtype.element_ty), mask=ok)
    tl.store(DU + offs, du.to(DU.dtype.element_ty), mask=ok)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, limit):
        gate, up = gate.contiguous(), up.contiguous()
        h = torch.empty_like(gate)
        n = gate.numel()
        _swiglu_fwd_kernel[(triton.cdiv(n, BLOCK),)](gate, up, h, n, float(limit), CLAMP=limit > 0, BLOCK=BLOCK)
        ctx.save_for_backward(gate, up)
        ctx.limit = limit
        return h

    @staticmethod
    def backward(ctx, dh):
        gate, up = ctx.saved_tensors
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        _swiglu_bwd_kernel[(triton.cdiv(n, BLOCK),)](gate, up, dh.contiguous(), dg, du, n, float(ctx.limit),
                                                     CLAMP=ctx.limit > 0, BLOCK=BLOCK)
        return dg, du, None


@torch.compiler.disable  # reached only outside torch.compile (see clamped_swiglu_triton)
def _swiglu_kernel(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return _SwiGLU.apply(gate, up, limit)


def clamped_swiglu_triton(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """As `model.moe.clamped_swiglu`: gate, up [..., I] of one float dtype (not fp64) -> h [..., I]."""
    if (torch.compiler.is_compiling() or gate.dtype == torch.float64 or gate.shape != up.shape
            or gate.dtype != up.dtype):
        return clamped_swiglu(gate, up, limit)
    return _swiglu_kernel(gate, up, limit)
