"""Tests for model/quant.py. Expected values are worked out by hand from the format definitions."""

from __future__ import annotations

import pytest
import torch

from model.quant import (
    bytes_per_vector,
    e2m1_encode,
    e4m3_round,
    fake_quant_fp8,
    fake_quant_kv_fp4,
    fake_quant_mxfp4,
    pack_fp8,
    pack_kv_fp4,
    pack_mxfp4,
    round_to_e2m1,
    unpack_fp8,
    unpack_kv_fp4,
    unpack_mxfp4,
)

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
FAKE = {"kv_fp4": fake_quant_kv_fp4, "mxfp4": fake_quant_mxfp4, "fp8": fake_quant_fp8}
PACK = {
    "kv_fp4": (pack_kv_fp4, unpack_kv_fp4),
    "mxfp4": (pack_mxfp4, unpack_mxfp4),
    "fp8": (pack_fp8, unpack_fp8),
}
BLOCK = {"kv_fp4": 16, "mxfp4": 32, "fp8": 32}


def block(values: list[float], size: int) -> torch.Tensor:
    """One block: the given values followed by zeros."""
    return torch.tensor(values + [0.0] * (size - len(values)))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


# --- E2M1 ---


def test_e2m1_grid_points_are_fixed() -> None:
    g = torch.tensor(GRID + [-v for v in GRID[1:]])
    assert torch.equal(round_to_e2m1(g), g)
    assert e2m1_encode(g).tolist() == list(range(8)) + list(range(9, 16))


def test_e2m1_ties_to_even_and_clamp() -> None:
    mid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])
    assert torch.equal(round_to_e2m1(mid), want)
    assert torch.equal(round_to_e2m1(-mid), -want)
    off = torch.tensor([0.26, 0.74, 2.49, 5.01, 6.5, 1e9, -7.0])
    assert torch.equal(round_to_e2m1(off), torch.tensor([0.5, 0.5, 2.0, 6.0, 6.0, 6.0, -6.0]))


def test_e2m1_negative_zero_is_encoded_as_plus_zero() -> None:
    assert e2m1_encode(torch.tensor([-0.0, -0.1, -0.25])).tolist() == [0, 0, 0]


def test_e4m3_round() -> None:
    # [1, 2) has 3 mantissa bits -> step 1/8; [16, 32) step 2; 2^-10 is half the smallest subnormal
    # -> tie to 0.
    x = torch.tensor([1.0833, 1.05, 100 / 6, 2.0**-10, 1000.0])
    assert torch.equal(e4m3_round(x), torch.tensor([1.125, 1.0, 16.0, 0.0, 448.0]))


# --- main KV: FP4 with E4M3 scale per 16 ---


def test_kv_fp4_amax6_is_exact() -> None:
    x = block(GRID + [-0.5, -3.0, -6.0], 16)
    assert torch.equal(fake_quant_kv_fp4(x), x)
    assert pack_kv_fp4(x)[1].tolist() == [0x38]  # E4M3 1.0: exponent field 7, mantissa 0


def test_kv_fp4_unrepresentable_amax_uses_e4m3_rounded_scale() -> None:
    # amax 6.5 -> 6.5/6 = 1.0833 -> E4M3 1.125 (0b0_0111_001 = 0x39).
    # x/1.125: 6.5 -> 5.78 -> 6; 1 -> 0.89 -> 1; 0.3 -> 0.27 -> 0.5; -2 -> -1.78 -> -2.
    x = block([6.5, 1.0, 0.3, -2.0], 16)
    want = block([6.75, 1.125, 0.5625, -2.25], 16)
    assert torch.equal(fake_quant_kv_fp4(x), want)
    assert pack_kv_fp4(x)[1].tolist() == [0x39]


def test_kv_fp4_scale_rounded_down_clamps_to_6() -> None:
    # amax 100 -> 16.67 -> E4M3 16 (0b0_1011_000 = 0x58); 100/16 = 6.25 clamps to 6 -> 96.
    # amax 6.3 -> 1.05 -> E4M3 1.0; 6.3 clamps to 6.
    x = torch.stack([block([100.0, -100.0, 8.0], 16), block([6.3, -6.3], 16)])
    want = torch.stack([block([96.0, -96.0, 8.0], 16), block([6.0, -6.0], 16)])
    assert torch.equal(fake_quant_kv_fp4(x), want)
    assert pack_kv_fp4(x)[1].tolist() == [[0x58], [0x38]]


def test_kv_fp4_zero_and_tiny_blocks() -> None:
    x = torch.stack([torch.zeros(16), torch.full((16,), 1e-12), torch.full((16,), -1e-12)])
    y = fake_quant_kv_fp4(x)
    assert torch.isfinite(y).all() and torch.equal(y, torch.zeros_like(x))
    # amax floor 6*2^-9 -> scale 2^-9: the smallest E4M3 subnormal, bit pattern 0x01.
    assert pack_kv_fp4(x)[1].flatten().tolist() == [0x01] * 3


def test_kv_fp4_nibble_order() -> None:
    # scale 1; element 2i in the low nibble: (0.5, 6) -> 0x71, (-1, 2) -> low 0b1010, high 0b0100 -> 0x4A.
    codes, _ = pack_kv_fp4(block([0.5, 6.0, -1.0, 2.0], 16))
    assert codes.tolist()[:3] == [0x71, 0x4A, 0x00]


# --- indexer: MXFP4 ---


def test_mxfp4_power_of_two_scales() -> None:
    # amax 6 -> 2^0 (byte 127), 6.1 -> 2^1 (128), 3 -> 2^-1 (126), 0 -> floor 6*2^-126 -> 2^-126 (1).
    x = torch.stack([block([6.0], 32), block([6.1, 1.0], 32), block([3.0, 0.25], 32), torch.zeros(32)])
    assert pack_mxfp4(x)[1].flatten().tolist() == [127, 128, 126, 1]
    # 6.1/2 = 3.05 -> 3; 1/2 -> 0.5; 3/0.5 = 6; 0.25/0.5 = 0.5.
    want = torch.stack([block([6.0], 32), block([6.0, 1.0], 32), block([3.0, 0.25], 32), torch.zeros(32)])
    assert torch.equal(fake_quant_mxfp4(x), want)


def test_mxfp4_scale_is_smallest_power_of_two_covering_amax() -> None:
    amax = torch.logspace(-30, 30, 200)
    scale = 2.0 ** (pack_mxfp4(block([], 32) + amax[:, None])[1].flatten().double() - 127)
    a6 = amax.double() / 6
    assert ((scale >= a6) & (scale / 2 < a6)).all()


def test_mxfp4_ties_to_even() -> None:
    # scale 1 (amax 6): midpoints round to the even code.
    x = block([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0], 32)
    assert torch.equal(fake_quant_mxfp4(x), block([6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -4.0], 32))
    # amax 7 -> scale 2 -> 7/2 = 3.5 is a tie -> 4 -> 8 (rounds above the block amax).
    assert fake_quant_mxfp4(block([7.0], 32))[0].item() == 8.0


# --- window KV: FP8 E4M3 with E8M0 scale per 32 ---


def test_fp8_scale_and_max_value() -> None:
    # amax 448*4 -> scale 4 (byte 129): 448*scale survives; 449 -> scale 2 (byte 128), 449/2 = 224.5 -> 224.
    x = torch.stack(
        [block([1792.0, -1792.0, 4.0], 32), block([449.0, 1.0], 32), block([448.0, 1.0, -2.0], 32)]
    )
    codes, scales = pack_fp8(x)
    assert scales.flatten().tolist() == [129, 128, 127]
    want = torch.stack(
        [block([1792.0, -1792.0, 4.0], 32), block([448.0, 1.0], 32), block([448.0, 1.0, -2.0], 32)]
    )
    assert torch.equal(fake_quant_fp8(x), want)
    # E4M3 bits: 448 = 0x7E, 1 = 0x38, -2 = 0xC0.
    assert codes[2, :3].tolist() == [0x7E, 0x38, 0xC0]


def test_fp8_huge_values_stay_finite_and_within_range() -> None:
    x = block([1e30, -1e30, 3e29], 32)
    y = fake_quant_fp8(x)
    scale = 2.0 ** (pack_fp8(x)[1].item() - 127)
    assert torch.isfinite(y).all()
    assert y.abs().max().item() <= 448 * scale and scale / 2 < 1e30 / 448 <= scale


def test_fp8_amax_floor() -> None:
    # amax < 1e-4 -> floor: 1e-4/448 = 2.23e-7 -> 2^-22 (byte 105). 1e-6 / 2^-22 = 4.19 -> E4M3 4.
    x = torch.stack([block([1e-6], 32), torch.zeros(32)])
    assert pack_fp8(x)[1].flatten().tolist() == [105, 105]
    assert torch.equal(fake_quant_fp8(x), torch.stack([block([4 * 2.0**-22], 32), torch.zeros(32)]))


# --- shared behaviour ---


@pytest.mark.parametrize("fmt", list(FAKE))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ste_gradient_is_identity(fmt: str, dtype: torch.dtype) -> None:
    x = (torch.randn(3, 64) * 5).to(dtype).requires_grad_()
    g = torch.randn(3, 64).to(dtype)
    y = FAKE[fmt](x)
    assert y.dtype == dtype and y.shape == x.shape
    y.backward(g)
    assert torch.equal(x.grad, g)


def random_blocks(fmt: str, dtype: torch.dtype, dim: int = 256) -> torch.Tensor:
    """Blocks at very different magnitudes, including all-zero, tiny and huge blocks and exact zeros."""
    gen = torch.Generator().manual_seed(0)
    mags = torch.tensor([0.0, 1e-38, 1e-12, 1e-5, 1e-2, 1.0, 7.0, 1e3, 1e6, 1e30])
    x = torch.randn(5, len(mags), dim, generator=gen)
    x[..., ::7] = 0.0
    per_block = mags[torch.randint(len(mags), (5, len(mags), dim // BLOCK[fmt]), generator=gen)]
    x = x * per_block.repeat_interleave(BLOCK[fmt], dim=-1)
    return x.to(dtype)


@pytest.mark.parametrize("fmt", list(PACK))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_unpack_round_trip_is_exact(fmt: str, dtype: torch.dtype) -> None:
    pack, unpack = PACK[fmt]
    x = random_blocks(fmt, dtype)
    codes, scales = pack(x)
    ref = FAKE[fmt](x)
    assert torch.isfinite(ref).all()
    assert torch.equal(bits(unpack(codes, scales, dtype)), bits(ref))
    assert torch.equal(bits(unpack(codes, scales)), bits(ref.float()))  # products are exact in bf16
    assert not torch.equal(ref, x)  # sanity: it does quantise


@pytest.mark.parametrize(
    ("fmt", "dim", "want_bytes"), [("kv_fp4", 512, 288), ("mxfp4", 128, 68), ("fp8", 512, 528)]
)
def test_packed_layout_and_bytes_per_vector(fmt: str, dim: int, want_bytes: int) -> None:
    pack, _ = PACK[fmt]
    codes, scales = pack(torch.randn(2, 3, dim, dtype=torch.bfloat16))
    value_bytes = dim // 2 if fmt != "fp8" else dim
    assert codes.dtype == scales.dtype == torch.uint8
    assert codes.shape == (2, 3, value_bytes) and scales.shape == (2, 3, dim // BLOCK[fmt])
    assert bytes_per_vector(fmt, dim) == want_bytes == codes[0, 0].nbytes + scales[0, 0].nbytes


@pytest.mark.parametrize("fmt", list(PACK))
def test_non_divisible_last_dim_raises(fmt: str) -> None:
    x = torch.randn(2, BLOCK[fmt] + 8)
    for fn in (FAKE[fmt], PACK[fmt][0]):
        with pytest.raises(ValueError, match="divisible"):
            fn(x)
    with pytest.raises(ValueError, match="divisible"):
        bytes_per_vector(fmt, BLOCK[fmt] + 8)


def test_bytes_per_vector_unknown_format() -> None:
    with pytest.raises(ValueError, match="unknown format"):
        bytes_per_vector("int4", 128)
