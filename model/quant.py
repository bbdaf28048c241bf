"""Low-precision formats of the KV cache, as fake quantisation (QAT) and as real packed storage.

Three formats, each quantising the LAST dim in contiguous blocks with one scale byte per block:

* ``kv_fp4`` (main KV): E2M1 values, E4M3 scale per 16 values, scale = e4m3(amax / 6).
* ``mxfp4`` (indexer q/k): E2M1 values, E8M0 (power-of-two) scale per 32 values,
  scale = 2^ceil(log2(amax / 6)).
* ``fp8`` (window KV): E4M3 values, E8M0 scale per 32 values, scale = 2^ceil(log2(amax / 448)).

Packed layout: E2M1 codes go two per byte, element ``2i`` in the LOW nibble and ``2i + 1`` in the high nibble;
a nibble is ``sign << 3 | code`` with codes 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6. Values that round to zero are
always encoded as +0 (nibble 0), so nibble 0x8 is never produced. FP8 values are the raw bits of
``torch.float8_e4m3fn`` (which does keep -0). E8M0 scale bytes are biased exponents (2^(byte - 127)); 0 and
255 are never produced.

``fake_quant_*`` and ``unpack_*(*pack_*(x))`` run the same fp32 arithmetic on the same codes and scales, so
they agree bitwise.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

E2M1_MAX = 6.0
E4M3_MAX = 448.0
KV_FP4_BLOCK = 16
MXFP4_BLOCK = 32
FP8_BLOCK = 32
# Lower clamps on the block amax: keep scales positive and finite for all-zero or tiny blocks.
KV_FP4_MIN_AMAX = E2M1_MAX * 2.0**-9  # -> scale 2^-9, the smallest positive E4M3 value
MXFP4_MIN_AMAX = E2M1_MAX * 2.0**-126  # -> scale 2^-126, the smallest normal fp32 (E8M0 byte 1)
FP8_MIN_AMAX = 1e-4
SCALE_BYTES = 1

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of codes 0..7
# Midpoints between neighbouring grid points, split by where a tie goes under round-half-to-even
# (to the neighbour with even code, i.e. mantissa bit 0).
_E2M1_TIES_DOWN = (0.25, 1.25, 2.5, 5.0)  # lower neighbour has the even code
_E2M1_TIES_UP = (0.75, 1.75, 3.5)  # upper neighbour has the even code


@functools.cache
def _consts(device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """Per-device lookup tensors (cached so steady-state calls do no host-to-device copies)."""
    down = torch.tensor(_E2M1_TIES_DOWN, dtype=torch.float32, device=device)
    up = torch.tensor(_E2M1_TIES_UP, dtype=torch.float32, device=device)
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return down, up, torch.cat([mags, -mags])  # decode table indexed by the 4-bit nibble


def e2m1_encode(v: Tensor) -> Tensor:
    """Nibble (uint8, 0..15) of the nearest E2M1 value, ties to even, saturating at +-6."""
    down, up, _ = _consts(v.device)
    a = v.float().abs()
    # Code = number of midpoints passed; '<' for ties-down midpoints and '<=' for ties-up ones.
    # Magnitudes above 6 pass all seven midpoints, which is the clamp to code 7.
    mag = torch.bucketize(a, down, right=False) + torch.bucketize(a, up, right=True)
    sign = (v < 0) & (mag > 0)  # anything rounding to zero becomes +0
    return (mag | (sign.long() << 3)).to(torch.uint8)


@functools.cache
def _divisor(value: float, device: torch.device) -> Tensor:
    return torch.tensor(value, dtype=torch.float32, device=device)


def _div(a: Tensor, divisor: float) -> Tensor:
    """a / divisor rounded once (IEEE), on every device. Not ``a / divisor``: with a Python number (a
    CPU scalar) as the divisor, ATen's CUDA division multiplies by the rounded reciprocal instead, which
    differs in the last bit for some a (kv_fp4: 10 scales of the tie cases in tests/test_kernels_quant.py
    round the other way on an H200), so the reference would depend on the device."""
    return a / _divisor(divisor, a.device)


def e2m1_decode(codes: Tensor) -> Tensor:
    """fp32 value of each E2M1 nibble."""
    return _consts(codes.device)[2][codes.long()]


def round_to_e2m1(v: Tensor) -> Tensor:
    """Round to the nearest E2M1 grid point (ties to even, clamped to +-6); fp32 result."""
    return e2m1_decode(e2m1_encode(v))


def e4m3_round(x: Tensor) -> Tensor:
    """Round to the nearest float8_e4m3fn value (torch's conversion is round-to-nearest-even)."""
    return x.float().to(torch.float8_e4m3fn).float()


def _pow2_ceil_exponent(v: Tensor) -> Tensor:
    """ceil(log2(v)) for positive normal v, exactly (log2 can misround near powers of two)."""
    mant, exp = torch.frexp(v)  # v = mant * 2^exp with mant in [0.5, 1)
    return torch.where(mant == 0.5, exp - 1, exp)


def _e8m0_to_scale(byte: Tensor) -> Tensor:
    """2^(byte - 127): the byte is exactly an fp32 exponent field, so build the float from bits."""
    return (byte.to(torch.int32) << 23).view(torch.float32)


def _e8m0_from_amax(amax: Tensor, max_code: float) -> Tensor:
    """E8M0 byte of the smallest power of two >= amax / max_code."""
    exp = _pow2_ceil_exponent(_div(amax, max_code)).clamp(-126, 127)
    return (exp + 127).to(torch.uint8)


# --- per-format encoders: fp32 blocks [..., nb, block] -> (codes uint8 [..., nb, block],
# scale byte [..., nb]) ---


def _amax(xb: Tensor, floor: float) -> Tensor:
    return xb.abs().amax(dim=-1).clamp(min=floor)


def _encode_kv_fp4(xb: Tensor) -> tuple[Tensor, Tensor]:
    # Saturate the scale at the E4M3 max instead of letting huge blocks overflow.
    scale = e4m3_round(_div(_amax(xb, KV_FP4_MIN_AMAX), E2M1_MAX).clamp(max=E4M3_MAX))
    return e2m1_encode(xb / scale.unsqueeze(-1)), scale.to(torch.float8_e4m3fn).view(torch.uint8)


def _encode_mxfp4(xb: Tensor) -> tuple[Tensor, Tensor]:
    sbyte = _e8m0_from_amax(_amax(xb, MXFP4_MIN_AMAX), E2M1_MAX)
    return e2m1_encode(xb / _e8m0_to_scale(sbyte).unsqueeze(-1)), sbyte


def _encode_fp8(xb: Tensor) -> tuple[Tensor, Tensor]:
    sbyte = _e8m0_from_amax(_amax(xb, FP8_MIN_AMAX), E4M3_MAX)
    v = (xb / _e8m0_to_scale(sbyte).unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX)
    return v.to(torch.float8_e4m3fn).view(torch.uint8), sbyte


def _decode_e4m3(codes: Tensor) -> Tensor:
    return codes.view(torch.float8_e4m3fn).float()


@dataclass(frozen=True)
class _Format:
    block: int
    value_bits: int  # 4: two codes per byte (nibbles), 8: one code per byte
    encode: Callable[[Tensor], tuple[Tensor, Tensor]]
    decode_values: Callable[[Tensor], Tensor]  # uint8 codes -> fp32
    decode_scale: Callable[[Tensor], Tensor]  # uint8 scale bytes -> fp32


FORMATS: dict[str, _Format] = {
    "kv_fp4": _Format(KV_FP4_BLOCK, 4, _encode_kv_fp4, e2m1_decode, _decode_e4m3),
    "mxfp4": _Format(MXFP4_BLOCK, 4, _encode_mxfp4, e2m1_decode, _e8m0_to_scale),
    "fp8": _Format(FP8_BLOCK, 8, _encode_fp8, _decode_e4m3, _e8m0_to_scale),
}


def _check_dim(name: str, dim: int, block: int) -> None:
    if dim % block != 0:
        raise ValueError(f"{name}: last dim {dim} must be divisible by the block size {block}")


def _to_blocks(name: str, x: Tensor) -> Tensor:
    if x.dim() == 0:
        raise ValueError(f"{name}: expected a tensor with at least one dim, got a scalar")
    block = FORMATS[name].block
    _check_dim(name, x.shape[-1], block)
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _dequant(fmt: _Format, codes: Tensor, sbytes: Tensor) -> Tensor:
    """codes [..., nb, block], scale bytes [..., nb] -> fp32 [..., nb * block]."""
    out = fmt.decode_values(codes) * fmt.decode_scale(sbytes).unsqueeze(-1)
    return out.flatten(-2)


def _quant_dequant(name: str, x: Tensor) -> Tensor:
    fmt = FORMATS[name]
    return _dequant(fmt, *fmt.encode(_to_blocks(name, x))).to(x.dtype)


class _FakeQuantSTE(torch.autograd.Function):
    """Forward: quantise-dequantise. Backward: identity (straight-through estimator).

    An autograd.Function rather than ``x + (q - x).detach()``: the latter re-rounds and need not equal q
    bitwise.
    """

    @staticmethod
    def forward(ctx, x: Tensor, name: str) -> Tensor:  # type: ignore[override]
        return _quant_dequant(name, x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad, None


def fake_quant_kv_fp4(x: Tensor) -> Tensor:
    """Main-KV fake quant: E2M1 values with an E4M3 scale per 16; STE gradient."""
    return _FakeQuantSTE.apply(x, "kv_fp4")


def fake_quant_mxfp4(x: Tensor) -> Tensor:
    """Indexer q/k fake quant: MXFP4 (E2M1 values, E8M0 scale per 32); STE gradient."""
    return _FakeQuantSTE.apply(x, "mxfp4")


def fake_quant_fp8(x: Tensor) -> Tensor:
    """Window-KV fake quant: E4M3 values with an E8M0 scale per 32; STE gradient."""
    return _FakeQuantSTE.apply(x, "fp8")


# --- packed storage ---


def _pack_nibbles(codes: Tensor) -> Tensor:
    """[..., d] nibbles -> [..., d/2] bytes; element 2i in the low nibble, 2i+1 in the high nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unpack_nibbles(packed: Tensor) -> Tensor:
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def _pack(name: str, x: Tensor) -> tuple[Tensor, Tensor]:
    fmt = FORMATS[name]
    codes, sbytes = fmt.encode(_to_blocks(name, x))
    codes = codes.flatten(-2)
    return (_pack_nibbles(codes) if fmt.value_bits == 4 else codes), sbytes


def _unpack(name: str, codes: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    fmt = FORMATS[name]
    if fmt.value_bits == 4:
        codes = _unpack_nibbles(codes)
    if codes.shape[-1] != scales.shape[-1] * fmt.block:
        raise ValueError(f"{name}: {codes.shape[-1]} values do not match {scales.shape[-1]} scales")
    codes = codes.reshape(*codes.shape[:-1], scales.shape[-1], fmt.block)
    return _dequant(fmt, codes, scales).to(dtype)


def pack_kv_fp4(x: Tensor) -> tuple[Tensor, Tensor]:
    """-> (nibble-packed E2M1 codes uint8 [..., d/2], E4M3 scale bits uint8 [..., d/16])."""
    return _pack("kv_fp4", x)


def unpack_kv_fp4(codes: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    return _unpack("kv_fp4", codes, scales, dtype)


def pack_mxfp4(x: Tensor) -> tuple[Tensor, Tensor]:
    """-> (nibble-packed E2M1 codes uint8 [..., d/2], E8M0 scales uint8 [..., d/32])."""
    return _pack("mxfp4", x)


def unpack_mxfp4(codes: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    return _unpack("mxfp4", codes, scales, dtype)


def pack_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    """-> (float8_e4m3fn bits uint8 [..., d], E8M0 scales uint8 [..., d/32])."""
    return _pack("fp8", x)


def unpack_fp8(codes: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    return _unpack("fp8", codes, scales, dtype)


def empty_packed(fmt: str, leading: tuple[int, ...], dim: int,
                 device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """Uninitialised storage for ``leading`` packed ``dim``-vectors: the (codes, scales) pair that
    ``pack_<fmt>`` returns for such a tensor. Cache buffers are allocated with this."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {sorted(FORMATS)}")
    f = FORMATS[fmt]
    _check_dim(fmt, dim, f.block)
    codes = torch.empty(*leading, dim * f.value_bits // 8, dtype=torch.uint8, device=device)
    scales = torch.empty(*leading, dim // f.block * SCALE_BYTES, dtype=torch.uint8, device=device)
    return codes, scales


def bytes_per_vector(fmt: str, dim: int) -> int:
    """Storage bytes of one packed ``dim``-vector: the value bytes plus one scale byte per block."""
    return sum(t.numel() for t in empty_packed(fmt, (1,), dim, device="meta"))
