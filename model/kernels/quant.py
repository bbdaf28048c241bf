"""Triton kernels for the KV-cache formats of ``model/quant.py``: quantise + pack, unpack + dequantise,
and the fused quantise-dequantise of the QAT forward.

``model/quant.py`` is the reference; every kernel here must match it BIT FOR BIT (codes, scale bytes and
dequantised values), and ``tests/test_kernels_quant.py`` checks that. Formats (last dim, contiguous blocks):

* ``kv_fp4``: E2M1 values, E4M3 scale per 16, scale = e4m3(min(amax / 6, 448)).
* ``mxfp4``: E2M1 values, E8M0 scale per 32, scale = 2^ceil(log2(amax / 6)).
* ``fp8``: E4M3 values (clamped to +-448), E8M0 scale per 32, scale = 2^ceil(log2(amax / 448)).

Kernels (one program = a tile of BLOCK_R rows x BLOCK_B blocks; the input is flattened to rows first):

* ``_pack_kernel``: x [R, d] -> codes uint8 [R, d/2] (E2M1 nibbles, element 2i low) or [R, d] (E4M3
  bits), scales uint8 [R, d/block].
* ``_unpack_kernel``: (codes, scales) -> values [R, d] in the output dtype.
* ``_quant_dequant_kernel``: x [R, d] -> dequantised values [R, d] in x's dtype, nothing stored in between.

Structure, for memory throughput. Near copy bandwidth an H200 moves ~10^12 values a second through one
of these kernels (2.5-4 bytes each), which leaves roughly 10-15 integer / compare / min-max instructions
per value (Hopper issues those at half its fp32 rate). The first version spent 30-85 instructions a value
plus shared-memory layout conversions, and ran at 31-58% of copy bandwidth (GPU time, bf16 [65536, 512]);
this one spends 10-22 (sm_90 SASS, bf16, 512-wide rows), converts no layouts and runs at 75-99%. So:

* Values travel in pairs (2p, 2p + 1): one int32 word of bf16 input or output (element 2p in the low
  half), one byte of E2M1 nibbles (2p in the low nibble), one int16 of E4M3 bytes. Tiles are pair tiles
  [BLOCK_R, BLOCK_B, block / 8, 4], 4 pairs (a 16-byte vector of bf16) per thread along the last axis.
  The pair's values are w << 16 and w & 0xFFFF0000 (an op a value, where widening int16 lanes took 1.5);
  a block's amax reduces the last axis in-thread and the block / 8 axis over 2-4 threads; a group's 4
  nibble bytes become one int32 word by a shift-and-add over the last axis; bf16 results go back as words.
* Every access keeps the compute layout, so nothing goes through shared memory: code words and scale
  bytes (one per thread) carry contiguity-1 hints, without which Triton's coalescing pass widens them and
  converts layouts through shared memory; a block's scale byte is stored by its first group's thread.
* Rounding is a magic-number addition, not a count of midpoints or a float -> int conversion: with e the
  binade of a (2^floor(log2 a), floored where the grid's step stops shrinking), y = a + 2^k * e (one fma,
  round-to-nearest-even) rounds a to the grid's step e * 2^(23 - k) (E2M1: k = 22, step 0.5 below 2, then
  1 and 2; E4M3: k = 20, step 2^-9 for subnormals); y - 2^k * e is the rounded value, and the code is
  bits(y) - bits(2^k * e) plus the codes below e's binade. One formula covers subnormal and normal codes
  and the carry into the next binade.
* Decoding is a shift and a multiply: a 3-bit E2M1 magnitude at bit 22 (a 7-bit E4M3 magnitude at bit 20)
  is an fp32, subnormal or normal, of exactly 2^-126 (2^-120) times the code's value; the sign goes on
  with an XOR after the multiply by the scale.
* Scales cost a few ops a block: the E8M0 byte of RN(amax / c) is read off amax's bits (amax <= c * 2^k
  exactly when RN(amax / c) <= 2^k, for c = 6 = 1.5 * 2^2 and c = 448 = 1.75 * 2^8); the kv_fp4 scale
  is the magic rounding of RN(amax / 6), and RN(1 / scale) three Newton steps.
* bf16 results are the top halves of the fp32 ones: a dequantised value has at most 6 significant bits,
  so the reference's fp32 -> bf16 rounding is exact, except for fp8 products below 2^-130 (scale bytes
  < 6, which pack never makes), which are first rounded onto the bf16 subnormal grid.
* Shapes are compile-time: EVEN (R and d multiples of the tile) drops the masks, and a row whose block
  count is not a power of two is split into power-of-two chunks rather than padded.
* Tunables, per kernel: ``_CONFIG`` (values per program, warps) and ``_WHOLE_BLOCKS``. The latter orders
  the pair tiles [block / 8, BLOCK_R, BLOCK_B, 4] in memory so that a block's groups sit in one thread's
  registers: no shuffles for the amax and each block's scale computed once instead of in 2-4 threads
  (10-14% fewer instructions), but each warp-wide access then touches every 2nd or 4th 16 bytes of a span
  that L1 (loads) or L2 (stores) must merge. Chosen by a sweep of both tunables against copy
  bandwidth: whole blocks help unpack and quant_dequant much more than they cost pack; programs of 2
  warps beat 4 or 8 at the same values per thread; 1 warp caps an SM at 32 warps (the
  32-programs-per-SM limit) and loses.

Exactness, and why the arithmetic looks the way it does:

* Division is never ``/``: Triton lowers fp32 ``/`` to an approximate division (``div.full.f32``) on
  NVIDIA GPUs, while the reference divides with IEEE round-to-nearest. Dividing by an E8M0 scale is a
  multiplication by its exact reciprocal: the same real number, rounded once. Dividing by 6 or by an E4M3
  scale s is q0 = x * RN(1/s), q = fma(fma(-q0, s, x), RN(1/s), q0) (Markstein): the residual is exact
  and q = RN(x / s), checked exhaustively for every fp32 mantissa of x against 6 and every E4M3 mantissa;
  RN(1/s) itself comes from Newton steps, exact for every E4M3 value.
* No fp8 or bf16 casts (``.to(tl.float8e4nv)``, ``.to(tl.bfloat16)``): the interpreter's conversions
  round ties away from zero, lose the mantissa carry (1.97 -> 1.0), neither saturate nor make subnormals,
  so the CPU tests could not vouch for them; the bit arithmetic is the same on both. bf16 is read and
  written as bits for the same reason.
* Every fma is explicit and no product feeds an add: the GPU would contract those into an fma, the
  interpreter not.
* Float min/max are chosen for their NaN behaviour, which Triton keeps the same on the GPU (``min.f32`` /
  ``min.NaN.f32``) and in the interpreter (``np.fmin`` / ``np.minimum``): the block amax propagates NaN as
  ``torch.amax`` does, while the clamp of a quotient to 6 sends NaN to 6 (code 7, as ``bucketize`` does).
  Integer ops overflow only on NaN, whose result is then replaced or stays NaN.
* inf/NaN follow the reference on CPU: ``frexp`` of inf/NaN has exponent 0 (E8M0 byte 127), a NaN
  rounds to E2M1 code 7 and to E4M3 0x7F (with the NaN's sign bit, as torch's cast does).
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
# Per kernel: (values per program, warps), measured (see "Tunables" above): pack 32 values a thread (4
# 16-byte loads in flight), unpack and quant_dequant 16.
_CONFIG: dict[str, tuple[int, int]] = {"pack": (2048, 2), "unpack": (1024, 2), "quant_dequant": (1024, 2)}
# Per kernel: whole blocks in one thread's registers (see the module docstring).
_WHOLE_BLOCKS: dict[str, bool] = {"pack": False, "unpack": True, "quant_dequant": True}


def _f32_bits(v: float) -> int:
    """Bits of v rounded to fp32, as the amax clamp compares them in the integer domain."""
    return struct.unpack("<i", struct.pack("<f", v))[0]


def _f32_round(v: float) -> float:
    return struct.unpack("<f", struct.pack("<f", v))[0]


# name -> (kernel format id, block, value bits, fp32 bits of the amax floor)
_SPECS: dict[str, tuple[int, int, int, int]] = {
    "kv_fp4": (_KV_FP4, ref.KV_FP4_BLOCK, 4, _f32_bits(ref.KV_FP4_MIN_AMAX)),
    "mxfp4": (_MXFP4, ref.MXFP4_BLOCK, 4, _f32_bits(ref.MXFP4_MIN_AMAX)),
    "fp8": (_FP8, ref.FP8_BLOCK, 8, _f32_bits(ref.FP8_MIN_AMAX)),
}
assert ref.E2M1_MAX == 6.0 and ref.E4M3_MAX == 448.0, "the kernels hard-code the E2M1 and E4M3 maxima"
assert all(block % 8 == 0 for _, block, _, _ in _SPECS.values()), "a block is whole groups of 4 pairs"
_RCP6 = tl.constexpr(_f32_round(1.0 / 6.0))  # RN(1/6)
_FLT_MAX = tl.constexpr(_f32_round(3.4028234663852886e38))
_TWO_126 = tl.constexpr(2.0**126)
_TWO_120 = tl.constexpr(2.0**120)
_BF16_SUBNORMAL_MAGIC = tl.constexpr(1.5 * 2.0**-110)  # ulp 2^-133, the bf16 subnormal step


# --- element helpers (fp32 / int32 tensors of any shape) ---


@triton.jit
def _f32(bits):
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _bits(v):
    return v.to(tl.int32, bitcast=True)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _binade(a, MIN_EXP_BITS: tl.constexpr):
    """fp32 2^floor(log2(a)) for a >= 0 (inf for NaN), floored at the fp32 with bits MIN_EXP_BITS, where the
    grid's step stops shrinking (E2M1: 1, E4M3: 2^-6)."""
    return _f32(tl.maximum(_bits(a) & 0x7F800000, MIN_EXP_BITS))


@triton.jit
def _e2m1_code(q, neg):
    """fp32 -> nibble (int32): nearest of 0, .5, 1, 1.5, 2, 3, 4, 6, ties to even, saturating at 6;
    `neg` (q < -0.25: negative with a non-zero code) sets the sign bit. NaN -> 7."""
    a = tl.minimum(tl.abs(q), 6.0)  # minnum: NaN -> 6
    e = _binade(a, 0x3F800000)
    y = tl.fma(e, 4194304.0, a)  # a + M, M = 2^22 * e: ulp(M) = e / 2 is the step (0.5 below 2, then 1, 2)
    # code = (y - M) / step + the codes below e's binade (0 below 2, 2 from 2, 4 from 4), in integers:
    # bits(y) - bits(M) with bits(M) = bits(e) + (22 << 23), plus (bits(e) >> 22) - 254.
    bias = tl.where(neg, 8 - 254 - (22 << 23), -254 - (22 << 23))
    return _bits(y) - _bits(e) + bias + (_bits(e) >> 22)


@triton.jit
def _e2m1_round(q):
    """fp32 -> the E2M1 value (fp32) q rounds to, with q's sign; +0 for values that round to zero and +6
    for NaN, as decoding the reference's code gives."""
    a = tl.maximum(tl.minimum(q, 6.0), -6.0)  # minnum first: NaN -> 6
    # Signed magic: -M rounds -|a| symmetrically, and (-M + -tiny) - -M is +0.
    e = _f32(_bits(_binade(tl.abs(a), 0x3F800000)) | (_bits(a) & -2147483648))
    return tl.fma(-e, 4194304.0, tl.fma(e, 4194304.0, a))  # (a + M) - M, the subtraction exact


@triton.jit
def _e4m3_code(q):
    """fp32 -> E4M3FN byte (int32), round to nearest even, magnitude clamped to 448 first (as the reference
    does before every cast); keeps the sign of zero; NaN -> 0x7F with its sign."""
    a = tl.minimum(tl.abs(q), 448.0)  # minnum: NaN -> 448, patched below
    e = _binade(a, 0x3C800000)
    y = tl.fma(e, 1048576.0, a)  # a + M, M = 2^20 * e: ulp(M) = e / 8, the step (2^-9 for subnormals)
    # byte = (E + 6) * 8 + (y - M) / step for e = 2^E: bits(y) - bits(e) - (20 << 23) + (bits(e) >> 20) - 968.
    byte = _bits(y) - _bits(e) + (_bits(e) >> 20) - (968 + (20 << 23))
    byte = tl.where(q != q, 0x7F, byte)
    return byte | ((_bits(q) >> 24) & 0x80)


@triton.jit
def _e4m3_round(q):
    """fp32 -> the E4M3 value (fp32) q rounds to after the clamp to +-448, with q's sign (so -0.0 for
    negatives that round to zero, as the fp8 cast keeps); NaN stays NaN."""
    a = tl.minimum(tl.abs(q), 448.0, propagate_nan=tl.PropagateNan.ALL)
    e = _binade(a, 0x3C800000)  # inf for NaN: the fmas keep NaN
    r = tl.fma(-e, 1048576.0, tl.fma(e, 1048576.0, a))  # (a + M) - M
    return _f32(_bits(r) | (_bits(q) & -2147483648))


@triton.jit
def _div6(a):
    """RN(a / 6) for normal, finite or NaN a: the fma-corrected product (see the module docstring)."""
    q0 = a * _RCP6
    return tl.fma(tl.fma(-q0, 6.0, a), _RCP6, q0)


@triton.jit
def _rcp_e4m3(s):
    """RN(1 / s) for s a positive E4M3 value (NaN -> NaN) without a division: three Newton steps from the
    bit-trick estimate (5% off), exact for each of the 126 values (checked exhaustively). div_rn would cost
    more instructions plus, for its never-taken slow-path call, twice the registers."""
    r = _f32(0x7EF311C3 - _bits(s))
    for _ in tl.static_range(3):
        r = tl.fma(r, tl.fma(-s, r, 1.0), r)
    return r


@triton.jit
def _e4m3_value(byte):
    """E4M3FN byte (int32, sign ignored) -> fp32 magnitude; 0x7F / 0xFF are NaN. The 7 magnitude bits at
    bit 20 are an fp32 of exactly 2^-120 times the E4M3 value, subnormal codes included."""
    m7 = byte & 0x7F
    v = _f32(m7 << 20) * _TWO_120
    return tl.where(m7 == 0x7F, float("nan"), v)


# --- block helpers (per-block tensors [BR, BB]) ---


@triton.jit
def _block_scale(amax, FMT: tl.constexpr, MIN_AMAX_BITS: tl.constexpr):
    """amax [BR, BB] (fp32, >= 0 or NaN) -> (scale byte int32, scale fp32, RN(1 / scale) fp32)."""
    if FMT == 0:
        # e4m3(min(RN(amax / 6), 448)) == e4m3(RN(min(amax, 2688) / 6)); NaN stays NaN throughout.
        a = tl.minimum(amax, 2688.0, propagate_nan=tl.PropagateNan.ALL)
        a = _f32(tl.maximum(_bits(a), MIN_AMAX_BITS))  # integer max: NaN bits stay above
        v = _div6(a)  # in [2^-9, 448] or NaN: none of _e4m3_code's clamp or sign
        e = _binade(v, 0x3C800000)
        y = tl.fma(e, 1048576.0, v)  # _e4m3_code's rounding
        scale = tl.fma(-e, 1048576.0, y)  # the E4M3 value; NaN stays NaN
        sbyte = tl.where(v != v, 0x7F, _bits(y) - _bits(e) + (_bits(e) >> 20) - (968 + (20 << 23)))
        inv = _rcp_e4m3(scale)
    else:
        ab = tl.maximum(_bits(amax), MIN_AMAX_BITS)
        # E8M0 byte of RN(amax / c): amax's exponent less c's (2 for 6 = 1.5 * 2^2, 8 for 448 = 1.75 * 2^8),
        # plus one when amax's mantissa is above c's. Within [1, 253] for amax >= the floor.
        if FMT == 1:
            sbyte = ((ab + 0x3FFFFF) >> 23) - 2
        else:
            sbyte = ((ab + 0x1FFFFF) >> 23) - 8
        sbyte = tl.where(ab >= 0x7F800000, 127, sbyte)  # inf/NaN: frexp's exponent 0, as in the reference
        scale = _f32(sbyte << 23)
        inv = _f32((254 - sbyte) << 23)  # exact: 2^(127 - byte)
    return sbyte, scale, inv


# --- tiles: [BR, BB, G/8, 4] pairs, or [G/8, BR, BB, 4] with WB ---


@triton.jit
def _per_block(t, WB: tl.constexpr):
    """Per-block tensor [BR, BB] (or rows [BR, 1], blocks [1, BB]) -> broadcastable against pair tiles."""
    if WB:
        return t[None, :, :, None]
    else:
        return t[:, :, None, None]


@triton.jit
def _per_block3(t, WB: tl.constexpr):
    """Per-block tensor [BR, BB] -> broadcastable against word tiles (pair tiles less the pair axis)."""
    if WB:
        return t[None, :, :]
    else:
        return t[:, :, None]


@triton.jit
def _tile(pid_r, pid_b, n_rows, n_blocks, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr, G: tl.constexpr,
          WB: tl.constexpr):
    """-> (rows int64 [BR, 1], blocks [1, BB], mask [BR, BB], group index w (shaped to broadcast against
    pair tiles), pair index in the row (a pair tile)). A group is 4 pairs, a block G/8 groups.

    Triton gives each thread the 4 pairs of the last axis (one 16-byte vector) and spreads threads over the
    next axes, fastest first: the group axis comes right before the pairs (a block over 2-4 threads,
    coalesced), or first with WB (a block's groups in one thread)."""
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    blocks = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    mask = (rows < n_rows)[:, None] & (blocks < n_blocks)[None, :]
    if WB:
        w = tl.arange(0, G // 8)[:, None, None, None]
    else:
        w = tl.arange(0, G // 8)[None, None, :, None]
    col = _per_block((blocks * (G // 2))[None, :], WB) + w * 4 + tl.arange(0, 4)[None, None, None, :]
    # int64 rows: rows * stride can pass 2^31 on large caches.
    return rows.to(tl.int64)[:, None], blocks[None, :], mask, w, col


@triton.jit
def _load_pairs(x_ptr, r2, col, mask, stride_x, IN_BF16: tl.constexpr, EVEN: tl.constexpr,
                WB: tl.constexpr):
    """Values 2p and 2p + 1 for the pairs p = col of rows r2 -> fp32 (lo, hi) pair tiles."""
    if IN_BF16:
        # x is the bf16 rows viewed as int32 (stride in words): element 2p is the low half, 2p + 1 the high
        # half, and the top half of an fp32 is exactly the bf16.
        ptrs = x_ptr + _per_block(r2 * stride_x, WB) + col
        if EVEN:
            w = tl.load(ptrs)
        else:
            w = tl.load(ptrs, mask=_per_block(mask, WB), other=0)
        return _f32(w << 16), _f32(w & -65536)
    else:
        ptrs = x_ptr + ((_per_block(r2 * stride_x, WB) + 2 * col)[:, :, :, :, None]
                        + tl.arange(0, 2)[None, None, None, None, :])
        if EVEN:
            v = tl.load(ptrs)
        else:
            v = tl.load(ptrs, mask=_per_block(mask, WB)[:, :, :, :, None], other=0.0)
        return tl.split(v.to(tl.float32))


@triton.jit
def _store_pairs(out_ptr, r2, col, lo, hi, mask, n_blocks, G: tl.constexpr, OUT_BF16: tl.constexpr,
                 EVEN: tl.constexpr, WB: tl.constexpr):
    """Store fp32 pairs (lo, hi) to contiguous rows. For bf16 the caller guarantees that the values are
    bf16 values (see the module docstring): their top halves are the result, a pair one int32 word."""
    row = _per_block(r2 * (n_blocks * (G // 2)), WB)  # in pairs
    if OUT_BF16:
        ptrs = out_ptr + row + col  # out viewed as int32
        v = (_bits(hi) & -65536) | ((_bits(lo) >> 16) & 0xFFFF)
        m = _per_block(mask, WB)
    else:
        ptrs = out_ptr + ((row + col) * 2)[:, :, :, :, None] + tl.arange(0, 2)[None, None, None, None, :]
        v = tl.join(lo, hi).to(out_ptr.dtype.element_ty)
        m = _per_block(mask, WB)[:, :, :, :, None]
    if EVEN:
        tl.store(ptrs, v)
    else:
        tl.store(ptrs, v, mask=m)


@triton.jit
def _x_pairs(x_ptr, r2, col, mask, stride_x, IN_BF16: tl.constexpr, EVEN: tl.constexpr, WB: tl.constexpr):
    """-> (lo, hi) fp32 pair tiles and the block amax [BR, BB] (NaN-propagating, as torch.amax)."""
    lo, hi = _load_pairs(x_ptr, r2, col, mask, stride_x, IN_BF16, EVEN, WB)
    amax = tl.reduce(_max_nan(tl.abs(lo), tl.abs(hi)), 3, _max_nan)  # in-thread
    amax = tl.reduce(amax, 0 if WB else 2, _max_nan)  # in-thread with WB, else over 2-4 threads
    return lo, hi, amax


@triton.jit
def _quotient(x, scale, inv, FMT: tl.constexpr):
    """x / its block's scale (scale and inv = RN(1 / scale) broadcast to x), rounded once -> (q, whether
    q's E2M1 code is negative)."""
    if FMT == 0:
        q0 = x * inv
        # x = +-inf makes the residual inf - inf = NaN; minnum turns it into FLT_MAX, which keeps q = q0 =
        # +-inf (a NaN scale keeps q NaN either way).
        rem = tl.minimum(tl.fma(-q0, scale, x), _FLT_MAX)
        q = tl.fma(rem, inv, q0)
    else:
        q = x * inv
    return q, q < -0.25


# --- kernels ---


@triton.jit
def _pack_kernel(x_ptr, codes_ptr, scales_ptr, n_rows, n_blocks, stride_x,
                 FMT: tl.constexpr, G: tl.constexpr, MIN_AMAX_BITS: tl.constexpr, IN_BF16: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr, EVEN: tl.constexpr, WB: tl.constexpr):
    r2, b2, mask, w, col = _tile(tl.program_id(0), tl.program_id(1), n_rows, n_blocks, BLOCK_R, BLOCK_B, G,
                                 WB)
    lo, hi, amax = _x_pairs(x_ptr, r2, col, mask, stride_x, IN_BF16, EVEN, WB)  # pair tiles, [BR, BB]
    sbyte, scale, inv = _block_scale(amax, FMT, MIN_AMAX_BITS)
    scale4, inv4 = _per_block(scale, WB), _per_block(inv, WB)
    q_lo, neg_lo = _quotient(lo, scale4, inv4, FMT)
    q_hi, neg_hi = _quotient(hi, scale4, inv4, FMT)
    if FMT == 2:
        # A pair's two E4M3 bytes as one int16 (codes viewed as int16: the same pair index as x).
        pair = (_e4m3_code(q_lo) + _e4m3_code(q_hi) * 256).to(tl.int16)
        ptrs = codes_ptr + _per_block(r2 * (n_blocks * (G // 2)), WB) + col
        if EVEN:
            tl.store(ptrs, pair)
        else:
            tl.store(ptrs, pair, mask=_per_block(mask, WB))
    else:
        # A pair is one byte (element 2p in the low nibble), a group's 4 bytes one int32 word (little-endian).
        # Additions rather than ORs (no bits overlap): shift-and-add folds into one IMAD on the fma pipe.
        byte = _e2m1_code(q_lo, neg_lo) + _e2m1_code(q_hi, neg_hi) * 16
        words = tl.sum(byte * (1 << (tl.arange(0, 4) * 8))[None, None, None, :], axis=3)  # one per group
        # Contiguity 1: the compute layout has one word per thread and group; left alone, the coalescing
        # pass would widen the store and convert layouts through shared memory for it.
        offs = _per_block3(r2 * (n_blocks * (G // 8)) + b2 * (G // 8), WB) + w.reshape(w.shape[:3])
        offs = tl.max_contiguous(offs, [1, 1, 1])
        if EVEN:
            tl.store(codes_ptr + offs, words)
        else:
            tl.store(codes_ptr + offs, words, mask=_per_block3(mask, WB))
    s_offs = tl.max_contiguous(r2 * n_blocks + b2, [1, 1])  # one byte per thread and block, as above
    if WB:
        if EVEN:
            tl.store(scales_ptr + s_offs, sbyte.to(tl.uint8))
        else:
            tl.store(scales_ptr + s_offs, sbyte.to(tl.uint8), mask=mask)
    else:
        # Each thread of a block holds its scale ([BR, BB, G/8] layout); the first group's stores it.
        shape: tl.constexpr = (BLOCK_R, BLOCK_B, G // 8)
        s_mask = w.reshape(w.shape[:3]) == 0
        if not EVEN:
            s_mask = s_mask & mask[:, :, None]
        tl.store(scales_ptr + tl.broadcast_to(s_offs[:, :, None], shape),
                 tl.broadcast_to(sbyte.to(tl.uint8)[:, :, None], shape), mask=s_mask)


@triton.jit
def _unpack_kernel(codes_ptr, scales_ptr, out_ptr, n_rows, n_blocks, stride_c, stride_s,
                   FMT: tl.constexpr, G: tl.constexpr, OUT_BF16: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr, EVEN: tl.constexpr, WB: tl.constexpr):
    r2, b2, mask, w, col = _tile(tl.program_id(0), tl.program_id(1), n_rows, n_blocks, BLOCK_R, BLOCK_B, G,
                                 WB)
    s_offs = tl.max_contiguous(r2 * stride_s + b2, [1, 1])  # contiguity 1: see _pack_kernel
    if WB:
        s_ptrs, s_mask = scales_ptr + s_offs, mask
    else:
        # Each thread of a block reads its scale byte: [BR, BB, G/8].
        shape: tl.constexpr = (BLOCK_R, BLOCK_B, G // 8)
        s_ptrs, s_mask = scales_ptr + tl.broadcast_to(s_offs[:, :, None], shape), mask[:, :, None]
    if EVEN:
        sbyte = tl.load(s_ptrs).to(tl.int32)
    else:
        sbyte = tl.load(s_ptrs, mask=s_mask, other=0).to(tl.int32)
    if FMT == 2:
        # codes viewed as int16 (stride in pairs): the E4M3 bytes of elements 2p (low) and 2p + 1 (high).
        ptrs = codes_ptr + _per_block(r2 * stride_c, WB) + col
        if EVEN:
            c = tl.load(ptrs).to(tl.int32)
        else:
            c = tl.load(ptrs, mask=_per_block(mask, WB), other=0).to(tl.int32)
        mag_lo, sign_lo = _e4m3_value(c), (c & 0x80) << 24
        mag_hi, sign_hi = _e4m3_value(c >> 8), (c & 0x8000) << 16
    else:
        # codes viewed as int32 (stride in words): a group's 4 bytes, each the nibbles of one pair.
        offs = _per_block3(r2 * stride_c + b2 * (G // 8), WB) + w.reshape(w.shape[:3])
        offs = tl.max_contiguous(offs, [1, 1, 1])  # see _pack_kernel
        if EVEN:
            words = tl.load(codes_ptr + offs)
        else:
            words = tl.load(codes_ptr + offs, mask=_per_block3(mask, WB), other=0)
        c = words[:, :, :, None] >> (tl.arange(0, 4) * 8)[None, None, None, :]  # pair k's byte at bit 0
        # The 3 magnitude bits at bit 22 are an fp32 of exactly 2^-126 times the E2M1 value, 0.5 included.
        mag_lo, sign_lo = _f32((c & 7) << 22) * _TWO_126, (c & 8) << 28
        mag_hi, sign_hi = _f32((c & 0x70) << 18) * _TWO_126, (c & 0x80) << 24
    if FMT == 0:
        scale = _e4m3_value(sbyte)
        scale = _f32(_bits(scale) ^ ((sbyte & 0x80) << 24))  # unpack takes any byte, signed ones too
    else:
        scale = _f32(sbyte << 23)  # bytes 0 and 255 give 0 and inf, as in the reference
    scale4 = _per_block(scale, WB) if WB else scale[:, :, :, None]
    if FMT == 2 and OUT_BF16:
        # Only fp8 products can need bf16 rounding: below 2^-130, i.e. under scale bytes < 6. Adding and
        # removing 1.5 * 2^-110 rounds them onto the bf16 subnormal grid (2^-133), ties to even; other
        # blocks add 0. The sign goes on afterwards, so -0.0 survives. An explicit fma (the product is
        # exact, >= 2^-135), since the GPU would contract a product feeding an add anyway.
        tiny = tl.where(sbyte < 6, _BF16_SUBNORMAL_MAGIC, 0.0)
        tiny = _per_block(tiny, WB) if WB else tiny[:, :, :, None]
        p_lo, p_hi = tl.fma(mag_lo, scale4, tiny) - tiny, tl.fma(mag_hi, scale4, tiny) - tiny
    else:
        p_lo, p_hi = mag_lo * scale4, mag_hi * scale4
    _store_pairs(out_ptr, r2, col, _f32(_bits(p_lo) ^ sign_lo), _f32(_bits(p_hi) ^ sign_hi), mask, n_blocks,
                 G, OUT_BF16, EVEN, WB)


@triton.jit
def _quant_dequant_kernel(x_ptr, out_ptr, n_rows, n_blocks, stride_x,
                          FMT: tl.constexpr, G: tl.constexpr, MIN_AMAX_BITS: tl.constexpr,
                          IN_BF16: tl.constexpr, OUT_BF16: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr, EVEN: tl.constexpr, WB: tl.constexpr):
    r2, b2, mask, w, col = _tile(tl.program_id(0), tl.program_id(1), n_rows, n_blocks, BLOCK_R, BLOCK_B, G,
                                 WB)
    lo, hi, amax = _x_pairs(x_ptr, r2, col, mask, stride_x, IN_BF16, EVEN, WB)  # pair tiles, [BR, BB]
    _, scale, inv = _block_scale(amax, FMT, MIN_AMAX_BITS)
    scale4, inv4 = _per_block(scale, WB), _per_block(inv, WB)
    q_lo, _ = _quotient(lo, scale4, inv4, FMT)
    q_hi, _ = _quotient(hi, scale4, inv4, FMT)
    # The values the codes decode to, without the codes: the same fp32 products as the reference's.
    if FMT == 2:
        r_lo, r_hi = _e4m3_round(q_lo), _e4m3_round(q_hi)
    else:
        r_lo, r_hi = _e2m1_round(q_lo), _e2m1_round(q_hi)
    _store_pairs(out_ptr, r2, col, r_lo * scale4, r_hi * scale4, mask, n_blocks, G, OUT_BF16, EVEN, WB)


# --- Python wrappers ---


def _spec(name: str) -> tuple[int, int, int, int]:
    if name not in _SPECS:
        raise ValueError(f"unknown format {name!r}; expected one of {sorted(_SPECS)}")
    return _SPECS[name]


def _tiles(kernel: str, n_rows: int, n_blocks: int, block: int) -> dict:
    """Launch parameters for an [n_rows, n_blocks * block] input: whole rows per program when they fit in
    the tile, else power-of-two chunks of a row, also instead of padding a block count that is no power of
    two when a chunk keeps >= 64 values; EVEN when the tiles cover R and d exactly (no masks)."""
    values, warps = _CONFIG[kernel]
    most = max(1, values // block)
    bb = min(triton.next_power_of_2(n_blocks), most)
    if n_blocks % bb and (n_blocks & -n_blocks) * block >= 64:
        bb = min(n_blocks & -n_blocks, most)  # the largest power of two that divides n_blocks
    # A tile of one block (BLOCK_B = 1) makes Triton 3.6's coalescing pass assert on sm90 (AxisInfo rank
    # mismatch); a masked second block compiles.
    bb = max(bb, min(2, most))
    br = min(max(1, values // (bb * block)), triton.next_power_of_2(n_rows))
    return dict(grid=(triton.cdiv(n_rows, br), triton.cdiv(n_blocks, bb)), BLOCK_R=br, BLOCK_B=bb,
                EVEN=n_rows % br == 0 and n_blocks % bb == 0, WB=_WHOLE_BLOCKS[kernel], num_warps=warps)


def _launch(kernel, tiles: dict, *args, **constexprs) -> None:
    tiles = dict(tiles)
    kernel[tiles.pop("grid")](*args, **constexprs, **tiles)


def _as_rows(t: Tensor) -> Tensor:
    """[..., n] -> [R, n] with a unit last stride (a view where possible)."""
    t2 = t.reshape(math.prod(t.shape[:-1]), t.shape[-1])
    return t2 if t2.stride(-1) == 1 or t2.shape[-1] <= 1 else t2.contiguous()


def _as_words(t: Tensor, dtype: torch.dtype) -> Tensor:
    """Rows [R, n] (unit last stride, n a multiple of the word) -> [R, n / k] words of dtype (k elements
    each): a view where the rows are aligned to the word, else a contiguous copy."""
    k = dtype.itemsize // t.element_size()
    if t.storage_offset() % k or t.stride(0) % k or t.data_ptr() % (k * t.element_size()):
        t = t.contiguous()
    return t.view(dtype)


def _input_rows(name: str, x: Tensor) -> tuple[Tensor, bool]:
    """Validate x like the reference, -> (rows [R, d] to hand to a kernel, whether they are bf16 pairs:
    [R, d/2] int32 words)."""
    if x.dim() == 0:
        raise ValueError(f"{name}: expected a tensor with at least one dim, got a scalar")
    _, block, _, _ = _spec(name)
    ref._check_dim(name, x.shape[-1], block)
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        x = x.float()  # the reference's x.float(), done once here
    x2 = _as_rows(x)
    if x2.dtype == torch.bfloat16 and x2.numel():
        return _as_words(x2, torch.int32), True
    return x2, False


def _output(out: Tensor) -> tuple[Tensor, bool]:
    """Kernel-side view of a contiguous output buffer: bf16 is written as int32 pairs of bits."""
    return (out.view(torch.int32), True) if out.dtype == torch.bfloat16 else (out, False)


def _kernel_out_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32


@torch.compiler.disable  # a compiled decode step: a graph break, launched as is (model/kernels/__init__.py)
def _pack(name: str, x: Tensor) -> tuple[Tensor, Tensor]:
    fmt, block, bits, min_bits = _spec(name)
    x2, in_bf16 = _input_rows(name, x)
    lead, d = x.shape[:-1], x.shape[-1]
    n_rows, n_blocks = x2.shape[0], d // block
    codes = torch.empty(n_rows, d * bits // 8, dtype=torch.uint8, device=x.device)
    scales = torch.empty(n_rows, n_blocks, dtype=torch.uint8, device=x.device)
    if codes.numel():
        # Nibbles are written as int32 words of 8, E4M3 bytes as int16 pairs.
        c = codes.view(torch.int32 if bits == 4 else torch.int16)
        _launch(_pack_kernel, _tiles("pack", n_rows, n_blocks, block), x2, c, scales, n_rows, n_blocks,
                x2.stride(0), FMT=fmt, G=block, MIN_AMAX_BITS=min_bits, IN_BF16=in_bf16)
    return codes.reshape(*lead, d * bits // 8), scales.reshape(*lead, n_blocks)


@torch.compiler.disable  # a compiled decode step: a graph break, launched as is (model/kernels/__init__.py)
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
        w2 = _as_words(c2, torch.int32 if bits == 4 else torch.int16)  # 8 nibbles / an E4M3 pair
        _launch(_unpack_kernel, _tiles("unpack", n_rows, n_blocks, block), w2, s2, o2, n_rows, n_blocks,
                w2.stride(0), s2.stride(0), FMT=fmt, G=block, OUT_BF16=out_bf16)
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
        _launch(_quant_dequant_kernel, _tiles("quant_dequant", n_rows, n_blocks, block), x2, o2, n_rows,
                n_blocks, x2.stride(0), FMT=fmt, G=block, MIN_AMAX_BITS=min_bits, IN_BF16=in_bf16,
                OUT_BF16=out_bf16)
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
