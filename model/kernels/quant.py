"""Triton kernels for the KV-cache formats of ``model/quant.py``: quantise + pack, unpack + dequantise,
and the fused quantise-dequantise of the QAT forward.

``model/quant.py`` is the reference; every kernel here must match it BIT FOR BIT (codes, scale bytes and
dequantised values), and ``tests/test_kernels_quant.py`` checks that. Formats (last dim, contiguous blocks):

* ``kv_fp4``: E2M1 values, E4M3 scale per 16, scale = e4m3(min(amax / 6, 448)).
* ``mxfp4``: E2M1 values, E8M0 scale per 32, scale = 2^ceil(log2(amax / 6)).
* ``fp8``: E4M3 values (clamped to +-448), E8M0 scale per 32, scale = 2^ceil(log2(amax / 448)).

Kernels (one program = a tile of BLOCK_R rows x BLOCK_B blocks; the input is flattened to rows first):

* ``_pack_kernel``: x [R, d] -> codes uint8 [R, d/2] (E2M1 nibbles, element 2i low) or [R, d] (E4M3 bits),
  scales uint8 [R, d/block].
* ``_unpack_kernel``: (codes, scales) -> values [R, d] in the output dtype.
* ``_quant_dequant_kernel``: x [R, d] -> dequantised values [R, d] in x's dtype, nothing stored in between.

Exactness, and why the arithmetic looks the way it does:

* Divisions are ``tl.math.div_rn``: Triton lowers fp32 ``/`` to an approximate division
  (``div.full.f32``) on NVIDIA GPUs, while the reference divides with IEEE round-to-nearest. Dividing by
  an E8M0 scale is a multiplication by its exact reciprocal instead: the same real number, rounded once.
* E4M3 rounding is integer/fp32 bit arithmetic, not ``.to(tl.float8e4nv)``: the interpreter's fp8 cast
  rounds ties away from zero, loses the mantissa carry (1.97 -> 1.0), neither saturates nor makes
  subnormals, so the CPU tests could not vouch for it; the bit arithmetic is the same on both.
* bf16 is read and written as int16 bits for the same reason: the interpreter truncates fp32 -> bf16
  and mishandles bf16 subnormals; the bit arithmetic is exact RNE on both the GPU and the interpreter.
* The block amax is an integer max over the magnitude bits: for non-negative floats integer order is
  float order, and a NaN (above inf) propagates as in ``torch.amax`` whatever the float max does.
* inf/NaN follow the reference on CPU: ``frexp`` of inf/NaN has exponent 0 (E8M0 byte 127), a NaN
  rounds to E2M1 code 7 (``bucketize`` puts NaN last) and to E4M3 0x7F.
"""

from __future__ import annotations

import math
import struct

import torch
import triton
import triton.language as tl
from torch import Tensor

from model import quant as ref

# Format ids as the kernels see them (a constexpr selects the arithmetic).
_KV_FP4, _MXFP4, _FP8 = 0, 1, 2
# Values per program, and warps: 16 values per thread keeps the pack kernels near 64-90 registers on sm_90
# (4096 values on 4 warps needed up to 176 and would starve a memory-bound kernel of occupancy).
_TILE_VALUES = 2048
_NUM_WARPS = 4


def _f32_bits(v: float) -> int:
    """Bits of v rounded to fp32, as the amax clamp compares them in the integer domain."""
    return struct.unpack("<i", struct.pack("<f", v))[0]


# name -> (kernel format id, block, value bits, fp32 bits of the amax floor)
_SPECS: dict[str, tuple[int, int, int, int]] = {
    "kv_fp4": (_KV_FP4, ref.KV_FP4_BLOCK, 4, _f32_bits(ref.KV_FP4_MIN_AMAX)),
    "mxfp4": (_MXFP4, ref.MXFP4_BLOCK, 4, _f32_bits(ref.MXFP4_MIN_AMAX)),
    "fp8": (_FP8, ref.FP8_BLOCK, 8, _f32_bits(ref.FP8_MIN_AMAX)),
}
assert ref.E2M1_MAX == 6.0 and ref.E4M3_MAX == 448.0, "the kernels hard-code the E2M1 and E4M3 maxima"


# --- element helpers (fp32 / int32 tensors of any shape) ---


@triton.jit
def _load_f32(ptrs, mask, IN_BF16: tl.constexpr):
    if IN_BF16:
        # bf16 arrives as int16 bits; the top half of an fp32 is exactly the bf16.
        raw = tl.load(ptrs, mask=mask, other=0).to(tl.int32)
        return (raw << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_out(ptrs, v, mask, OUT_BF16: tl.constexpr):
    if OUT_BF16:
        # fp32 -> bf16 round-to-nearest-even on the magnitude bits (no int32 overflow for finite or inf).
        bits = v.to(tl.int32, bitcast=True)
        mag = bits & 0x7FFFFFFF
        half = (mag + 0x7FFF + ((mag >> 16) & 1)) >> 16
        half = tl.where(mag > 0x7F800000, 0x7FC0, half)  # NaN stays a quiet NaN
        tl.store(ptrs, (half | ((bits >> 16) & 0x8000)).to(tl.int16), mask=mask)
    else:
        tl.store(ptrs, v.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _e2m1_encode(v):
    """fp32 -> nibble (int32): nearest of 0, .5, 1, 1.5, 2, 3, 4, 6, ties to even, saturating at 6."""
    a = tl.abs(v)
    # Count the midpoints passed: strict for those whose tie goes down, '>=' for those whose tie goes up.
    mag = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
           + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
           + (a > 5.0).to(tl.int32))
    mag = tl.where(v != v, 7, mag)
    neg = (v < 0) & (mag > 0)  # values rounding to zero are +0
    return mag | (neg.to(tl.int32) << 3)


@triton.jit
def _with_sign(mag, negative):
    """mag (fp32, sign bit clear) with its sign bit set where `negative`. A bit OR, not -mag: on
    the GPU `-x` compiled to 0 - x, which turns the -0.0 of a negative zero code into +0.0."""
    bits = mag.to(tl.int32, bitcast=True) | (negative.to(tl.int32) << 31)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_decode(c):
    """nibble (int32) -> fp32; nibble 8 gives -0.0 like the reference table."""
    m = c & 7
    e = m >> 1
    # codes 2..7 are 2^(e-1) * (1 + f/2): build the fp32 directly from exponent and top mantissa bit.
    normal = (((e + 126) << 23) | ((m & 1) << 22)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, (m & 1).to(tl.float32) * 0.5, normal)
    return _with_sign(mag, c >= 8)


@triton.jit
def _e4m3_encode(v):
    """fp32 -> E4M3FN byte (int32), round to nearest even, magnitude clamped to 448 first (as the
    reference does before every cast); keeps the sign of zero and of values that round to zero."""
    a = tl.minimum(tl.abs(v), 448.0)
    a = tl.where(v != v, 0.0, a)  # keep NaN out of the integer path; patched below
    # Step of the E4M3 grid around a: 2^(e-3), with e floored at -6 because subnormals keep step 2^-9.
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    y = a * ((130 - e) << 23).to(tl.float32, bitcast=True)  # a / step, exact: power-of-two scaling, y < 16
    n = y.to(tl.int32)
    frac = y - n.to(tl.float32)  # exact
    n += ((frac > 0.5) | ((frac == 0.5) & ((n & 1) == 1))).to(tl.int32)
    # n * 2^(e-3) with n in [0, 16]: byte = (e + 6) * 8 + n covers subnormals, normals and the carry
    # into the next binade (n == 16) alike.
    byte = (e + 6) * 8 + n
    byte = tl.where(v != v, 0x7F, byte)
    return byte | ((v.to(tl.int32, bitcast=True) >> 24) & 0x80)


@triton.jit
def _e4m3_decode(b):
    """E4M3FN byte (int32) -> fp32 (0x7F / 0xFF are NaN)."""
    ex = (b >> 3) & 15
    man = b & 7
    normal = ((ex + 120) << 23) | (man << 20)
    normal = tl.where((b & 0x7F) == 0x7F, 0x7FC00000, normal).to(tl.float32, bitcast=True)  # NaN
    mag = tl.where(ex == 0, man.to(tl.float32) * 0.001953125, normal)  # subnormal: man * 2^-9
    return _with_sign(mag, (b & 0x80) != 0)


@triton.jit
def _e8m0_encode(q):
    """Byte of the smallest power of two >= q (q > 0): the fp32 exponent field, +1 unless q is a power of two."""
    bits = q.to(tl.int32, bitcast=True)
    ex = (bits >> 23) & 0xFF
    byte = ex + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    byte = tl.minimum(tl.maximum(byte, 1), 254)
    return tl.where(ex == 255, 127, byte)  # inf/NaN: frexp's exponent 0, as in the reference


@triton.jit
def _e8m0_decode(b):
    return (b << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e8m0_reciprocal(b):
    """1 / 2^(b - 127), exact. Multiplying by it rounds the same real number as dividing by the scale,
    and is far cheaper than an IEEE division. Exact for bytes 1..253, all that finite data produces
    (fp32 max / 6 < 2^126); byte 127 for inf/NaN blocks is fine too."""
    return ((254 - b) << 23).to(tl.float32, bitcast=True)


# --- block helpers (tiles [BLOCK_R, BLOCK_B, G]) ---


@triton.jit
def _tile_offsets(pid_r, pid_b, n_rows, n_blocks, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr,
                  G: tl.constexpr):
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    blocks = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    r3 = rows.to(tl.int64)[:, None, None]  # int64: rows * stride can pass 2^31 on large caches
    b3 = blocks[None, :, None]
    mask_rb = (rows < n_rows)[:, None] & (blocks < n_blocks)[None, :]  # [BLOCK_R, BLOCK_B]
    return r3, b3, mask_rb


@triton.jit
def _quantise(x, FMT: tl.constexpr, MIN_AMAX_BITS: tl.constexpr):
    """x [BR, BB, G] fp32 -> (codes int32 [BR, BB, G], scale byte int32 [BR, BB])."""
    amax_bits = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=2)
    amax = tl.maximum(amax_bits, MIN_AMAX_BITS).to(tl.float32, bitcast=True)
    if FMT == 0:
        sbyte = _e4m3_encode(tl.math.div_rn(amax, 6.0))
        codes = _e2m1_encode(tl.math.div_rn(x, _e4m3_decode(sbyte)[:, :, None]))
    elif FMT == 1:
        sbyte = _e8m0_encode(tl.math.div_rn(amax, 6.0))
        codes = _e2m1_encode(x * _e8m0_reciprocal(sbyte)[:, :, None])
    else:
        sbyte = _e8m0_encode(tl.math.div_rn(amax, 448.0))
        codes = _e4m3_encode(x * _e8m0_reciprocal(sbyte)[:, :, None])
    return codes, sbyte


@triton.jit
def _dequantise(codes, sbyte, FMT: tl.constexpr):
    """codes int32 [BR, BB, G], scale bytes int32 [BR, BB] -> fp32 [BR, BB, G]."""
    if FMT == 0:
        return _e2m1_decode(codes) * _e4m3_decode(sbyte)[:, :, None]
    elif FMT == 1:
        return _e2m1_decode(codes) * _e8m0_decode(sbyte)[:, :, None]
    else:
        return _e4m3_decode(codes) * _e8m0_decode(sbyte)[:, :, None]


# --- kernels ---


@triton.jit
def _pack_kernel(x_ptr, codes_ptr, scales_ptr, n_rows, n_blocks, stride_x,
                 FMT: tl.constexpr, G: tl.constexpr, NIBBLES: tl.constexpr, MIN_AMAX_BITS: tl.constexpr,
                 IN_BF16: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr):
    r3, b3, mask_rb = _tile_offsets(tl.program_id(0), tl.program_id(1), n_rows, n_blocks, BLOCK_R, BLOCK_B, G)
    j = tl.arange(0, G)[None, None, :]
    x = _load_f32(x_ptr + r3 * stride_x + b3 * G + j, mask_rb[:, :, None], IN_BF16)  # [BR, BB, G]
    codes, sbyte = _quantise(x, FMT, MIN_AMAX_BITS)
    tl.store(scales_ptr + r3.reshape(BLOCK_R, 1) * n_blocks + b3.reshape(1, BLOCK_B), sbyte.to(tl.uint8),
             mask=mask_rb)
    if NIBBLES:
        lo, hi = tl.split(codes.reshape(BLOCK_R, BLOCK_B, G // 2, 2))  # elements 2i, 2i + 1
        k = tl.arange(0, G // 2)[None, None, :]
        ptrs = codes_ptr + r3 * (n_blocks * (G // 2)) + b3 * (G // 2) + k  # [BR, BB, G/2]
        tl.store(ptrs, (lo | (hi << 4)).to(tl.uint8), mask=mask_rb[:, :, None])
    else:
        tl.store(codes_ptr + r3 * (n_blocks * G) + b3 * G + j, codes.to(tl.uint8), mask=mask_rb[:, :, None])


@triton.jit
def _unpack_kernel(codes_ptr, scales_ptr, out_ptr, n_rows, n_blocks, stride_c, stride_s,
                   FMT: tl.constexpr, G: tl.constexpr, NIBBLES: tl.constexpr, OUT_BF16: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr):
    r3, b3, mask_rb = _tile_offsets(tl.program_id(0), tl.program_id(1), n_rows, n_blocks, BLOCK_R, BLOCK_B, G)
    sbyte = tl.load(scales_ptr + r3.reshape(BLOCK_R, 1) * stride_s + b3.reshape(1, BLOCK_B), mask=mask_rb,
                    other=0).to(tl.int32)  # [BR, BB]
    if NIBBLES:
        k = tl.arange(0, G // 2)[None, None, :]
        packed = tl.load(codes_ptr + r3 * stride_c + b3 * (G // 2) + k, mask=mask_rb[:, :, None],
                         other=0).to(tl.int32)  # [BR, BB, G/2]
        codes = tl.join(packed & 0xF, packed >> 4).reshape(BLOCK_R, BLOCK_B, G)
    else:
        codes = tl.load(codes_ptr + r3 * stride_c + b3 * G + tl.arange(0, G)[None, None, :],
                        mask=mask_rb[:, :, None], other=0).to(tl.int32)
    out = _dequantise(codes, sbyte, FMT)
    j = tl.arange(0, G)[None, None, :]
    _store_out(out_ptr + r3 * (n_blocks * G) + b3 * G + j, out, mask_rb[:, :, None], OUT_BF16)


@triton.jit
def _quant_dequant_kernel(x_ptr, out_ptr, n_rows, n_blocks, stride_x,
                          FMT: tl.constexpr, G: tl.constexpr, MIN_AMAX_BITS: tl.constexpr,
                          IN_BF16: tl.constexpr, OUT_BF16: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr):
    r3, b3, mask_rb = _tile_offsets(tl.program_id(0), tl.program_id(1), n_rows, n_blocks, BLOCK_R, BLOCK_B, G)
    j = tl.arange(0, G)[None, None, :]
    x = _load_f32(x_ptr + r3 * stride_x + b3 * G + j, mask_rb[:, :, None], IN_BF16)  # [BR, BB, G]
    codes, sbyte = _quantise(x, FMT, MIN_AMAX_BITS)
    out = _dequantise(codes, sbyte, FMT)
    _store_out(out_ptr + r3 * (n_blocks * G) + b3 * G + j, out, mask_rb[:, :, None], OUT_BF16)


# --- Python wrappers ---


def _spec(name: str) -> tuple[int, int, int, int]:
    if name not in _SPECS:
        raise ValueError(f"unknown format {name!r}; expected one of {sorted(_SPECS)}")
    return _SPECS[name]


def _tiles(n_rows: int, n_blocks: int, block: int) -> tuple[int, int, tuple[int, int]]:
    """(BLOCK_R, BLOCK_B, grid): whole rows per program when they fit, else a slice of one row."""
    bb = min(triton.next_power_of_2(n_blocks), max(1, _TILE_VALUES // block))
    br = min(max(1, _TILE_VALUES // (bb * block)), triton.next_power_of_2(n_rows))
    return br, bb, (triton.cdiv(n_rows, br), triton.cdiv(n_blocks, bb))


def _as_rows(t: Tensor) -> Tensor:
    """[..., n] -> [R, n] with a unit last stride (a view where possible)."""
    t2 = t.reshape(math.prod(t.shape[:-1]), t.shape[-1])
    return t2 if t2.stride(-1) == 1 or t2.shape[-1] <= 1 else t2.contiguous()


def _input_rows(name: str, x: Tensor) -> tuple[Tensor, bool]:
    """Validate x like the reference, -> (rows [R, d] to hand to a kernel, whether they are bf16 bits)."""
    if x.dim() == 0:
        raise ValueError(f"{name}: expected a tensor with at least one dim, got a scalar")
    _, block, _, _ = _spec(name)
    ref._check_dim(name, x.shape[-1], block)
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        x = x.float()  # the reference's x.float(), done once here
    x2 = _as_rows(x)
    if x2.dtype == torch.bfloat16:
        return x2.view(torch.int16), True
    return x2, False


def _output(out: Tensor) -> tuple[Tensor, bool]:
    """Kernel-side view of an output buffer: bf16 is written as int16 bits."""
    return (out.view(torch.int16), True) if out.dtype == torch.bfloat16 else (out, False)


def _kernel_out_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32


def _pack(name: str, x: Tensor) -> tuple[Tensor, Tensor]:
    fmt, block, bits, min_bits = _spec(name)
    x2, in_bf16 = _input_rows(name, x)
    lead, d = x.shape[:-1], x.shape[-1]
    n_rows, n_blocks = x2.shape[0], d // block
    codes = torch.empty(n_rows, d * bits // 8, dtype=torch.uint8, device=x.device)
    scales = torch.empty(n_rows, n_blocks, dtype=torch.uint8, device=x.device)
    if codes.numel():
        br, bb, grid = _tiles(n_rows, n_blocks, block)
        _pack_kernel[grid](x2, codes, scales, n_rows, n_blocks, x2.stride(0), FMT=fmt, G=block,
                           NIBBLES=bits == 4, MIN_AMAX_BITS=min_bits, IN_BF16=in_bf16, BLOCK_R=br, BLOCK_B=bb,
                           num_warps=_NUM_WARPS)
    return codes.reshape(*lead, d * bits // 8), scales.reshape(*lead, n_blocks)


def _unpack(name: str, codes: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    fmt, block, bits, _ = _spec(name)
    if codes.dim() == 0 or scales.dim() == 0:
        raise ValueError(f"{name}: codes and scales need at least one dim, got shapes "
                         f"{tuple(codes.shape)} and {tuple(scales.shape)}")
    if codes.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{name}: codes and scales must be uint8, got {codes.dtype} and {scales.dtype}")
    n_values = codes.shape[-1] * 8 // bits
    if n_values != scales.shape[-1] * block:
        raise ValueError(f"{name}: {n_values} values do not match {scales.shape[-1]} scales")
    # The reference would broadcast mismatched leading dims; the cache never needs that, so refuse it.
    if codes.shape[:-1] != scales.shape[:-1]:
        raise ValueError(f"{name}: codes leading shape {tuple(codes.shape[:-1])} does not match scales "
                         f"leading shape {tuple(scales.shape[:-1])}")
    if codes.device != scales.device:
        raise ValueError(f"{name}: codes on {codes.device} but scales on {scales.device}")
    lead, n_blocks = codes.shape[:-1], scales.shape[-1]
    c2, s2 = _as_rows(codes), _as_rows(scales)
    n_rows = c2.shape[0]
    out = torch.empty(n_rows, n_values, dtype=_kernel_out_dtype(dtype), device=codes.device)
    if out.numel():
        o2, out_bf16 = _output(out)
        br, bb, grid = _tiles(n_rows, n_blocks, block)
        _unpack_kernel[grid](c2, s2, o2, n_rows, n_blocks, c2.stride(0), s2.stride(0), FMT=fmt, G=block,
                             NIBBLES=bits == 4, OUT_BF16=out_bf16, BLOCK_R=br, BLOCK_B=bb,
                             num_warps=_NUM_WARPS)
    return out.reshape(*lead, n_values).to(dtype)


def quant_dequant(name: str, x: Tensor) -> Tensor:
    """QAT forward of format ``name``: quantise then dequantise x in one pass; returns x.dtype, equal to
    the reference's fake_quant_<name>(x) forward. No autograd (wrap it for a straight-through gradient)."""
    fmt, block, _, min_bits = _spec(name)
    x2, in_bf16 = _input_rows(name, x)
    n_rows, n_blocks = x2.shape[0], x.shape[-1] // block
    out = torch.empty(n_rows, x.shape[-1], dtype=_kernel_out_dtype(x.dtype), device=x.device)
    if out.numel():
        o2, out_bf16 = _output(out)
        br, bb, grid = _tiles(n_rows, n_blocks, block)
        _quant_dequant_kernel[grid](x2, o2, n_rows, n_blocks, x2.stride(0), FMT=fmt, G=block,
                                    MIN_AMAX_BITS=min_bits, IN_BF16=in_bf16, OUT_BF16=out_bf16,
                                    BLOCK_R=br, BLOCK_B=bb, num_warps=_NUM_WARPS)
    return out.reshape(x.shape).to(x.dtype)


def pack_kv_fp4(x: Tensor) -> tuple[Tensor, Tensor]:
    """-> (nibble-packed E2M1 codes uint8 [..., d/2], E4M3 scale bits uint8 [..., d/16])."""
    return _pack("kv_fp4", x)


def unpack_kv_fp4(codes: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """codes uint8 [..., d/2], scales uint8 [..., d/16] -> [..., d] in dtype."""
    return _unpack("kv_fp4", codes, scales, dtype)


def pack_mxfp4(x: Tensor) -> tuple[Tensor, Tensor]:
    """-> (nibble-packed E2M1 codes uint8 [..., d/2], E8M0 scales uint8 [..., d/32])."""
    return _pack("mxfp4", x)


def unpack_mxfp4(codes: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """codes uint8 [..., d/2], scales uint8 [..., d/32] -> [..., d] in dtype."""
    return _unpack("mxfp4", codes, scales, dtype)


def pack_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    """-> (float8_e4m3fn bits uint8 [..., d], E8M0 scales uint8 [..., d/32])."""
    return _pack("fp8", x)


def unpack_fp8(codes: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """codes uint8 [..., d], scales uint8 [..., d/32] -> [..., d] in dtype."""
    return _unpack("fp8", codes, scales, dtype)
