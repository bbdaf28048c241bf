"""Rotary embedding of the trailing dims of a row, forward and backward, in one pass (Triton).
Reference: `model.rope.Rotary.forward` (same arguments, same math).

The reference widens the rotated slice to fp32, splits even and odd lanes with strided views,
stacks the rotated pairs and concatenates them back behind the untouched leading dims. Under
autograd each of those is a kernel and a tensor, and the backward adds the slice and cat
gradients into zero-filled buffers, a visible share of a `small` training step; inductor's
fused version is not much faster (a gather-like interleave it does not vectorise).
Here one program copies BLOCK_R whole rows: the leading C-R dims pass through as a plain copy,
the trailing R dims are loaded as pairs and rotated in fp32, rounded once to the output dtype, as
the reference does. The backward is the same kernel with the rotation inverted (the rotation is
orthogonal).

Contract (`rotary_triton(x, angles, inverse)`):
    x [..., C] with rows contiguous in the last dim; angles [..., R/2] whose leading shape is
    x's, or x's with its second-to-last axis of size 1 or absent (one angle row shared by that
    axis, e.g. the heads of q [B, T, H, C] with angles [B, T, 1, R/2]) -> [..., C] in x's dtype.
    Differentiable in x (angles come from positions and carry no gradient).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Values a program (whole rows) and warps: 2048-8192 values at 4 or 8 warps run near copy bandwidth
_VALUES, _WARPS = 4096, 4
# In place (only the rotated dims, `rotate_trailing_`): small programs (8 rows, 1 warp); larger ones
# were as slow as copying the whole row
_VALUES_IN_PLACE, _WARPS_IN_PLACE = 512, 1


@triton.jit
def _rotary_kernel(X, COS, SIN, OUT, n_rows, share, C, HALF, sign,
                   BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr,
                   COPY_LEAD: tl.constexpr = True):
    # X / OUT [n_rows, C]: the leading C - 2*HALF values of a row pass through, the trailing
    # 2*HALF are HALF pairs (2j, 2j + 1) rotated by angle j; COS / SIN [n_rows // share, HALF]:
    #   even' = even*cos - sign*odd*sin;  odd' = odd*cos + sign*even*sin.
    # A tile is BLOCK_R whole rows: the pass-through part is a plain [BLOCK_R, BLOCK_C] copy
    # (16-byte vectors), and only the rotated part is loaded as [BLOCK_R, BLOCK_P, 2] pairs and
    # split into its even and odd halves in registers. Without COPY_LEAD (in place: OUT is X) the
    # pass-through part is not touched at all.
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    r_ok = rows < n_rows
    lead = C - 2 * HALF
    if COPY_LEAD:
        cols = tl.arange(0, BLOCK_C)
        m = r_ok[:, None] & (cols < lead)[None, :]
        offs = rows[:, None] * C + cols[None, :]
        tl.store(OUT + offs, tl.load(X + offs, mask=m), mask=m)
    pairs = tl.arange(0, BLOCK_P)
    rot = r_ok[:, None] & (pairs < HALF)[None, :]  # [BLOCK_R, BLOCK_P]
    at = (rows[:, None] * C + lead + 2 * pairs[None, :])[:, :, None] + tl.arange(0, 2)[None, None, :]
    m2 = rot[:, :, None] & (tl.arange(0, 2) < 2)[None, None, :]
    even, odd = tl.split(tl.load(X + at, mask=m2, other=0.0))
    ang = (rows // share)[:, None] * HALF + pairs[None, :]
    cos = tl.load(COS + ang, mask=rot, other=1.0)
    sin = tl.load(SIN + ang, mask=rot, other=0.0) * sign
    e, o = even.to(tl.float32), odd.to(tl.float32)
    new_even = (e * cos - o * sin).to(OUT.dtype.element_ty)
    new_odd = (o * cos + e * sin).to(OUT.dtype.element_ty)
    tl.store(OUT + at, tl.join(new_even, new_odd), mask=m2)


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, share: int, inverse: bool,
            in_place: bool = False) -> torch.Tensor:
    C, half = x.shape[-1], cos.shape[-1]
    rows = x.view(-1, C) if in_place else x.reshape(-1, C)
    out = rows if in_place else torch.empty_like(rows)
    n_rows = rows.shape[0]
    block_p = max(16, triton.next_power_of_2(half))
    block_c = max(16, triton.next_power_of_2(C - 2 * half))
    block_r = max(1, (_VALUES_IN_PLACE if in_place else _VALUES) // (2 * block_p if in_place else block_c))
    if n_rows:
        _rotary_kernel[(triton.cdiv(n_rows, block_r),)](
            rows, cos, sin, out, n_rows, share, C, half, -1.0 if inverse else 1.0,
            BLOCK_R=block_r, BLOCK_C=block_c, BLOCK_P=block_p, COPY_LEAD=not in_place,
            num_warps=_WARPS_IN_PLACE if in_place else _WARPS)
    return out.view(x.shape)


def _rows_per_angle(x: torch.Tensor, cos: torch.Tensor) -> int:
    share = x.numel() // x.shape[-1] // cos.shape[0] if cos.shape[0] else 1
    if not x.is_contiguous() or share * cos.shape[0] * x.shape[-1] != x.numel():
        raise ValueError(f"rotary: x {tuple(x.shape)} must be contiguous with a whole number of rows per "
                         f"angle row ({cos.shape[0]} angle rows)")
    return share


def rotate_trailing_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     inverse: bool = False) -> torch.Tensor:
    """x [..., C] contiguous, its trailing 2 * cos.shape[-1] dims rotated in place (the leading
    ones are neither read nor written: 1/8 of the bytes of a copy for q's 64 of 512); cos / sin
    fp32 [A, R/2] with x's rows in A equal groups of consecutive rows (one angle row a group, e.g.
    q [B, T, H, C] and A = B * T). No autograd: for callers that own x and account for the
    rotation themselves (`model.kernels.sparse_attention`'s q_angles). Returns x."""
    return _launch(x, cos, sin, _rows_per_angle(x, cos), inverse, in_place=True)


def rotary_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """`rotate_trailing_`'s rotation into a new tensor (the whole row copied), no autograd."""
    return _launch(x, cos, sin, _rows_per_angle(x, cos), inverse)


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, share, inverse):
        ctx.save_for_backward(cos, sin)
        ctx.share, ctx.inverse = share, inverse
        return _launch(x, cos, sin, share, inverse)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _launch(grad.contiguous(), cos, sin, ctx.share, not ctx.inverse), None, None, None, None


def angle_share(x: torch.Tensor, angles: torch.Tensor) -> int | None:
    """Rows of x that one angle row serves: 1 when angles' leading shape is x's, x.shape[-2] when
    it is x's with that axis of size 1 or absent (the heads of q [B, T, H, C] with angles
    [B, T, 1, R/2] or [B, T, R/2]); None when the kernel cannot take this broadcast."""
    lead, x_lead = tuple(angles.shape[:-1]), tuple(x.shape[:-1])
    if lead == x_lead:
        return 1
    if x.dim() >= 2 and lead in (x_lead[:-1], x_lead[:-1] + (1,)):
        return x.shape[-2]
    return None


@torch.compiler.disable  # trainer.compile: a graph break, launched as is (model/kernels/__init__.py)
def rotary_triton(x: torch.Tensor, angles: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [..., C] rotated on its last 2 * angles.shape[-1] dims (module docstring)."""
    half = angles.shape[-1]
    if 2 * half > x.shape[-1] or x.shape[-1] % 2:
        raise ValueError(f"rotary_triton: {2 * half} rotary dims exceed the row's {x.shape[-1]} (or the row "
                         "is odd)")
    share = angle_share(x, angles)
    if share is None:
        raise ValueError(f"rotary_triton: angles {tuple(angles.shape)} do not match x {tuple(x.shape)}")
    angles = angles.float()
    return _Rotary.apply(x.contiguous(), angles.cos().contiguous(), angles.sin().contiguous(), share, inverse)
