"""Fused clamped SwiGLU, forward and backward. Reference: `model.moe.clamped_swiglu_packed`,
silu(min(gate, limit)) * clamp(up, -limit, limit) (no clamp for limit <= 0) of the two halves of
gate_up [N, 2I] = [gate | up], the output of the experts' stacked gate-and-up matmul.

Eager PyTorch runs the forward as three kernels and its backward as about eight (clamp masks,
silu_backward, products, where), each a pass over [tokens x inter_dim] tensors. Here the forward reads gate_up
once and writes h; the backward reads gate_up and dh once and writes gate_up's gradient, both halves in one
tensor (autograd adds no zero-filled halves, and the matmul before takes one gradient). Math in fp32, one
rounding to the input dtype per output (the reference rounds after each op in bf16). Saved for backward:
gate_up.

Gradients follow torch.clamp's: they pass where min <= x <= max (bounds included).
Under torch.compile the reference is used instead: inductor fuses those elementwise ops itself,
and a kernel here would be a graph break in the middle of the MoE.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.moe import clamped_swiglu_packed

BLOCK_R, BLOCK_C = 4, 256  # rows x columns of I a program: 8 values a thread at 4 warps


@triton.jit
def _tile(GU, n_rows, inter, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's [BLOCK_R, BLOCK_C] tile: gate and up in fp32, their offsets in GU [N, 2 inter],
    the offsets in an [N, inter] tensor, and the mask."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (r < n_rows)[:, None] & (c < inter)[None, :]
    src = r[:, None] * (2 * inter) + c[None, :]
    g = tl.load(GU + src, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU + src + inter, mask=ok, other=0.0).to(tl.float32)
    return g, u, src, r[:, None] * inter + c[None, :], ok


@triton.jit
def _swiglu_fwd_kernel(GU, H, n_rows, inter, limit, CLAMP: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_C: tl.constexpr):
    # GU [N, 2 inter] (gate | up) -> H [N, inter]
    g, u, _, dst, ok = _tile(GU, n_rows, inter, BLOCK_R, BLOCK_C)
    if CLAMP:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    h = g * tl.sigmoid(g) * u
    tl.store(H + dst, h.to(H.dtype.element_ty), mask=ok)


@triton.jit
def _swiglu_bwd_kernel(GU, DH, DGU, n_rows, inter, limit, CLAMP: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_C: tl.constexpr):
    # GU, DGU [N, 2 inter]; DH [N, inter]
    g, u, src, dst, ok = _tile(GU, n_rows, inter, BLOCK_R, BLOCK_C)
    dh = tl.load(DH + dst, mask=ok, other=0.0).to(tl.float32)
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
    tl.store(DGU + src, dg.to(DGU.dtype.element_ty), mask=ok)
    tl.store(DGU + src + inter, du.to(DGU.dtype.element_ty), mask=ok)


def _grid(n_rows: int, inter: int) -> tuple[int, int]:
    return triton.cdiv(n_rows, BLOCK_R), triton.cdiv(inter, BLOCK_C)


class _SwiGLU(torch.autograd.Function):
    """gate_up [N, 2I] -> h [N, I]."""

    @staticmethod
    def forward(ctx, gate_up, limit):
        gate_up = gate_up.contiguous()
        n_rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        h = gate_up.new_empty(n_rows, inter)
        if h.numel():
            _swiglu_fwd_kernel[_grid(n_rows, inter)](gate_up, h, n_rows, inter, float(limit), CLAMP=limit > 0,
                                                     BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C)
        ctx.save_for_backward(gate_up)
        ctx.limit = limit
        return h

    @staticmethod
    def backward(ctx, dh):
        (gate_up,) = ctx.saved_tensors
        n_rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        d_gate_up = torch.empty_like(gate_up)
        if dh.numel():
            _swiglu_bwd_kernel[_grid(n_rows, inter)](gate_up, dh.contiguous(), d_gate_up, n_rows, inter,
                                                     float(ctx.limit), CLAMP=ctx.limit > 0, BLOCK_R=BLOCK_R,
                                                     BLOCK_C=BLOCK_C)
        return d_gate_up, None


@torch.compiler.disable  # reached only outside torch.compile (see clamped_swiglu_packed_triton)
def _swiglu_kernel(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    lead, width = gate_up.shape[:-1], gate_up.shape[-1]
    return _SwiGLU.apply(gate_up.reshape(-1, width), limit).view(*lead, width // 2)


def clamped_swiglu_packed_triton(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """As `model.moe.clamped_swiglu_packed`: gate_up [..., 2I] (not fp64) -> h [..., I]."""
    if torch.compiler.is_compiling() or gate_up.dtype == torch.float64 or gate_up.shape[-1] % 2:
        return clamped_swiglu_packed(gate_up, limit)
    return _swiglu_kernel(gate_up, limit)
