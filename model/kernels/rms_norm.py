"""Fused RMSNorm, forward and backward. Reference: `model.numerics.rms_norm` (F.rms_norm with the
weight cast to the input's dtype; under autocast an fp32 input gives an output in the autocast
dtype).

torch's fused rms_norm backward is two kernels: the input gradient, then the weight gradient
(`GammaBetaBackward`) reading x and dy a second time. At the `small` step (micro-batch 8) the
66 norms over [8, 4096, 1024] and [8, 4096, 512] took ~11 ms of backward at 0.16-0.19 ms a call,
where one read of x and dy and one write of dx is ~0.05 ms at copy bandwidth. Here the backward
reads x and dy once: each program walks its share of the rows, writes dx and keeps the weight
gradient's partial sum over its rows in fp32 registers; the host adds the [programs, D] partials.

Math in fp32 (statistics, products), each output rounded once: y = x * rstd * w with w rounded to
x's dtype first, as the reference does. The weight gradient is summed in fp32 and returned in the
weight's dtype (the reference rounds it to x's dtype on the way). Saved for backward: x and the
[rows] fp32 rstd.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_fwd_kernel(X, W, Y, RSTD, n_rows, D, eps, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # X [n_rows, D], W [D], Y [n_rows, D] (output dtype), RSTD [n_rows] fp32
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    ok = (rows < n_rows)[:, None] & (cols < D)[None, :]
    x = tl.load(X + rows[:, None] * D + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=cols < D, other=0.0).to(X.dtype.element_ty).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 1) / D + eps)
    tl.store(Y + rows[:, None] * D + cols[None, :], (x * rstd[:, None] * w[None, :]).to(Y.dtype.element_ty),
             mask=ok)
    tl.store(RSTD + rows, rstd, mask=rows < n_rows)


@triton.jit
def _rms_norm_bwd_kernel(X, W, DY, RSTD, DX, DW_PART, n_rows, D, n_tiles, BLOCK_R: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    # DX like X; DW_PART [programs, D] fp32: this program's sum over its rows of dy * x * rstd
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    c_ok = cols < D
    w = tl.load(W + cols, mask=c_ok, other=0.0).to(X.dtype.element_ty).to(tl.float32)
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    for tile in range(pid, n_tiles, tl.num_programs(0)):
        rows = (tile * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        ok = (rows < n_rows)[:, None] & c_ok[None, :]
        offs = rows[:, None] * D + cols[None, :]
        x = tl.load(X + offs, mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=ok, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rows < n_rows, other=0.0)
        xhat = x * rstd[:, None]
        g = dy * w[None, :]
        # d/dx of x * rstd: rstd * (g - xhat * mean(g * xhat))
        dx = rstd[:, None] * (g - xhat * (tl.sum(g * xhat, 1) / D)[:, None])
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=ok)
        dw += tl.sum(dy * xhat, 0)
    tl.store(DW_PART + pid.to(tl.int64) * D + cols, dw, mask=c_ok)


# Tile sizes (values a tile; a tile holds whole rows) and backward programs per SM. Compiled
# offline for sm_90 (bf16, 4 warps): the backward at 4096 values a tile needs 158-160 registers,
# at 2048 80-96 (no spills either way), so more programs stay resident to keep loads in flight.
FWD_TILE, BWD_TILE, BWD_PROGRAMS_PER_SM = 4096, 2048, 8


def _tiles(D: int, values: int) -> tuple[int, int, int]:
    """(rows a tile, padded D, warps) for tiles of about `values` values."""
    block_d = triton.next_power_of_2(D)
    return max(1, values // block_d), block_d, 4 if block_d <= 2048 else 8


def reduction_programs(n_tiles: int, device: torch.device) -> int:
    """Programs of a kernel whose programs walk a share of n_tiles and each add one [D] partial
    (a weight gradient): a few per SM; one in the interpreter. Also used by engram_gate.py."""
    if device.type != "cuda":
        return 1 if os.environ.get("TRITON_INTERPRET") == "1" else n_tiles
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(n_tiles, BWD_PROGRAMS_PER_SM * sms))


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float, out_dtype: torch.dtype):
        D = x.shape[-1]
        x2 = x.reshape(-1, D).contiguous()
        n_rows = x2.shape[0]
        y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        block_r, block_d, warps = _tiles(D, FWD_TILE)
        if n_rows:
            _rms_norm_fwd_kernel[(triton.cdiv(n_rows, block_r),)](x2, weight, y, rstd, n_rows, D, eps,
                                                                   BLOCK_R=block_r, BLOCK_D=block_d,
                                                                   num_warps=warps)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.x_shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        n_rows, D = x2.shape
        block_r, block_d, warps = _tiles(D, BWD_TILE)
        n_tiles = triton.cdiv(n_rows, block_r)
        programs = reduction_programs(n_tiles, x2.device) if n_rows else 1
        dx = torch.empty_like(x2)
        dw_part = torch.zeros(programs, D, dtype=torch.float32, device=x2.device)
        if n_rows:
            _rms_norm_bwd_kernel[(programs,)](x2, weight, dy.reshape(n_rows, D).contiguous(), rstd, dx,
                                              dw_part, n_rows, D, n_tiles, BLOCK_R=block_r, BLOCK_D=block_d,
                                              num_warps=warps)
        return dx.view(ctx.x_shape), dw_part.sum(0).to(weight.dtype), None, None


@torch.compiler.disable  # reached only outside torch.compile (see rms_norm_triton)
def _rms_norm_kernel(x: torch.Tensor, weight: torch.Tensor, eps: float,
                     out_dtype: torch.dtype) -> torch.Tensor:
    return _RMSNormFn.apply(x, weight, eps, out_dtype)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: Optional[float]) -> torch.Tensor:
    """`model.numerics.rms_norm` over x's last dim with a weight [D], x not fp64 (the policy's guard,
    model/ops.py, hands other calls to the reference, and torch.compile's too: inductor fuses the
    norm itself, where a kernel would be a graph break)."""
    eps = eps if eps is not None else torch.finfo(x.dtype).eps
    out_dtype = x.dtype
    if x.dtype == torch.float32 and torch.is_autocast_enabled(x.device.type):
        out_dtype = torch.get_autocast_dtype(x.device.type)
    return _rms_norm_kernel(x, weight, float(eps), out_dtype)
