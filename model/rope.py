"""Rotary position embedding on the trailing `rope_dim` dims of a vector, with YaRN.

Pairs are interleaved: (x[2i], x[2i+1]) rotate by angle pos * freq[i].
"""
from __future__ import annotations

import math

import torch
from torch import nn

from model.numerics import wide


def yarn_frequencies(dim: int, theta: float, factor: float, original_len: int,
                     beta_fast: int, beta_slow: int) -> torch.Tensor:
    """Inverse frequencies [dim/2] fp32. With original_len > 0, YaRN's NTK-by-parts: pairs whose
    wavelength fits into original_len many times keep theta's frequency, slow ones are divided by
    `factor`, with a linear ramp between. original_len = 0 turns YaRN off.

    The arithmetic follows DeepSeek's inference code (`precompute_freqs_cis`) op for op, fp32
    throughout, so a released checkpoint sees the same angles: YaRN applies whenever
    original_len > 0 (even at factor 1, where the blend changes the values only by rounding),
    whatever the sequence length, and the ramp's upper end is clamped at dim - 1 (not dim/2 - 1)."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if original_len <= 0:
        return freqs

    def correction_dim(rotations: float) -> float:
        # the (fractional) pair index whose wavelength fits `rotations` times into original_len
        return dim * math.log(original_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    keep = 1 - ramp  # 1: keep theta's frequency, 0: divide by factor
    return freqs / factor * (1 - keep) + freqs * keep


def rotate(x: torch.Tensor, angles: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [..., C] with its last 2 * angles.shape[-1] channels rotated pairwise by `angles` (by
    minus `angles` when inverse), which broadcast against them with the pair axis last."""
    dim = 2 * angles.shape[-1]
    rot = wide(x[..., -dim:])
    cos, sin = angles.cos(), angles.sin()
    if inverse:
        sin = -sin
    even, odd = rot[..., 0::2], rot[..., 1::2]
    out = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    return torch.cat((x[..., :-dim], out.to(x.dtype)), dim=-1)


class Rotary(nn.Module):
    """cos/sin for given positions; applied to the last `dim` channels of a tensor."""

    rotate = staticmethod(rotate)  # the op; model.ops.KernelPolicy may swap in the Triton rotation

    def __init__(self, dim: int, theta: float, factor: float = 1.0, original_len: int = 0,
                 beta_fast: int = 32, beta_slow: int = 1):
        super().__init__()
        self.dim = dim
        inv_freq = yarn_frequencies(dim, theta, factor, original_len, beta_fast, beta_slow)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        # positions [...] int -> angles [..., dim/2] fp32
        return positions.float().unsqueeze(-1) * self.inv_freq

    def forward(self, x: torch.Tensor, angles: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """Rotate x[..., -dim:]. `angles` broadcasts against x[..., -dim:] with its pair axis last
        (e.g. [B, T, dim/2] -> insert a head axis before calling for [B, T, H, C])."""
        return self.rotate(x, angles, inverse)
