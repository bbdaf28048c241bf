"""model/kernels/quant.py against the reference model/quant.py, bit for bit: codes, scale bytes, unpacked
values and the fused quantise-dequantise. On CPU the kernels run in Triton's interpreter (conftest sets
TRITON_INTERPRET=1 before this module imports them), so sizes stay small; the gpu test repeats the
comparison on CUDA at a realistic size."""

from __future__ import annotations

import re

import pytest
import torch

from model import quant as R
from model.kernels import quant as K

NAMES = ("kv_fp4", "mxfp4", "fp8")
BLOCK = {"kv_fp4": R.KV_FP4_BLOCK, "mxfp4": R.MXFP4_BLOCK, "fp8": R.FP8_BLOCK}
REF_PACK = {"kv_fp4": (R.pack_kv_fp4, R.unpack_kv_fp4), "mxfp4": (R.pack_mxfp4, R.unpack_mxfp4),
            "fp8": (R.pack_fp8, R.unpack_fp8)}
KER_PACK = {"kv_fp4": (K.pack_kv_fp4, K.unpack_kv_fp4), "mxfp4": (K.pack_mxfp4, K.unpack_mxfp4),
            "fp8": (K.pack_fp8, K.unpack_fp8)}
REF_FAKE = {"kv_fp4": R.fake_quant_kv_fp4, "mxfp4": R.fake_quant_mxfp4, "fp8": R.fake_quant_fp8}
# The interpreter computes in numpy, which warns where IEEE arithmetic makes inf/NaN on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered:RuntimeWarning")

E2M1_GRID = torch.tensor(R.E2M1_VALUES)
E2M1_MIDS = torch.tensor(R._E2M1_TIES_DOWN + R._E2M1_TIES_UP)
E4M3_POS = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448, all finite


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8, 8: torch.int64}[t.element_size()])


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bit patterns (so -0.0 != +0.0); NaNs only have to sit in the same places, since their
    payloads depend on the hardware that made them."""
    assert got.dtype == want.dtype and got.shape == want.shape and got.device == want.device
    if got.is_floating_point():
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan), "NaN positions differ"
        got, want = got.masked_fill(nan, 0), want.masked_fill(nan, 0)
    g, w = _bits(got), _bits(want)
    if not torch.equal(g, w):
        bad = (g != w).nonzero()
        i = tuple(bad[0].tolist())
        raise AssertionError(f"{bad.shape[0]} of {g.numel()} differ; first at {i}: got {got[i]!r}, want "
                             f"{want[i]!r}")


def check(name: str, x: torch.Tensor, out_dtypes=(torch.float32, torch.bfloat16)) -> None:
    """Every kernel of format `name` on x against the reference."""
    pack, unpack = KER_PACK[name]
    ref_pack, ref_unpack = REF_PACK[name]
    codes, scales = pack(x)
    ref_codes, ref_scales = ref_pack(x)
    assert_same(codes, ref_codes)
    assert_same(scales, ref_scales)
    for dtype in out_dtypes:
        assert_same(unpack(ref_codes, ref_scales, dtype), ref_unpack(ref_codes, ref_scales, dtype))
    assert_same(K.quant_dequant(name, x), REF_FAKE[name](x))


def _nudged(v: torch.Tensor) -> torch.Tensor:
    """v and its fp32 neighbours on both sides."""
    return torch.cat([v, torch.nextafter(v, torch.full_like(v, -float("inf"))),
                      torch.nextafter(v, torch.full_like(v, float("inf")))])


def _rows_with_anchor(anchor: torch.Tensor, fill: torch.Tensor, block: int) -> torch.Tensor:
    """Blocks [anchor_i, fill...]: the anchor fixes each block's amax, the fill is what gets rounded.
    anchor [n], fill [m] -> [n * ceil(m / (block - 1)), block]."""
    per = block - 1
    fill = torch.cat([fill, fill.new_zeros(-fill.numel() % per)]).reshape(-1, per)
    a = anchor.repeat_interleave(fill.shape[0])[:, None]
    return torch.cat([a, fill.repeat(anchor.numel(), 1)], dim=1)


def cases(name: str, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """fp32 inputs [rows, d] (d a multiple of the block) for each situation the kernels must handle."""
    g = torch.Generator().manual_seed(0)
    block = BLOCK[name]
    d = 4 * block
    out: dict[str, torch.Tensor] = {}
    for scale in (1e-3, 1.0, 1e3):
        out[f"normal_{scale:g}"] = torch.randn(8, d, generator=g) * scale
    # Grid points, exact ties and their fp32 neighbours, at the scale that makes them exact multiples.
    e2m1 = _nudged(torch.cat([E2M1_MIDS, E2M1_GRID, torch.tensor([6.5, 1e3])]))
    if name == "kv_fp4":
        scales = torch.tensor([1.0, 1.25, 0.0703125, 2.0**-9, 448.0, 3.0 * 2.0**-8])  # all E4M3 values
        out["ties"] = _tie_rows(torch.cat([e2m1, -e2m1]), scales, block)
        # Scale ties: amax / 6 on E4M3 midpoints (and neighbours), including past the 448 saturation.
        mids = (E4M3_POS[1:] + E4M3_POS[:-1]) / 2
        amax = _nudged(6 * torch.cat([mids, E4M3_POS[1:], torch.tensor([464.0, 480.0, 1e4])]))
        out["scale_ties"] = _rows_with_anchor(amax, torch.randn(block - 1, generator=g), block)
    elif name == "mxfp4":
        out["ties"] = _tie_rows(torch.cat([e2m1, -e2m1]), 2.0 ** torch.tensor([0.0, -10.0, 20.0, -120.0]),
                                block)
        # amax / 6 exactly a power of two, or one ulp either side: where ceil(log2) changes.
        out["scale_ties"] = _rows_with_anchor(_nudged(6 * 2.0 ** torch.arange(-126.0, 126.0, 7.0)),
                                              torch.randn(block - 1, generator=g), block)
    else:
        mids = (E4M3_POS[1:] + E4M3_POS[:-1]) / 2
        e4m3 = _nudged(torch.cat([mids, E4M3_POS]))
        out["ties"] = _tie_rows(torch.cat([e4m3, -e4m3]), 2.0 ** torch.tensor([0.0, -20.0, 10.0]), block,
                                anchor=448.0)
        out["scale_ties"] = _rows_with_anchor(_nudged(448 * 2.0 ** torch.arange(-30.0, 118.0, 5.0)),
                                              torch.randn(block - 1, generator=g), block)
    zeros = torch.zeros(4, d)
    zeros[1] = -0.0
    zeros[2, :block] = 1.0  # zero blocks next to non-zero ones
    out["zeros"] = zeros
    min_amax = {"kv_fp4": R.KV_FP4_MIN_AMAX, "mxfp4": R.MXFP4_MIN_AMAX, "fp8": R.FP8_MIN_AMAX}[name]
    tiny = torch.randn(6, d, generator=g) * min_amax * torch.tensor([0.5, 0.1, 1e-3, 0.9, 1.0, 2.0])[:, None]
    tiny[5, :3] = torch.tensor([1e-40, -3e-42, 1.4e-45])  # fp32 subnormals
    out["tiny"] = tiny
    huge = torch.randn(4, d, generator=g) * torch.tensor([1e30, 1e37, 3e38, 1.0])[:, None]
    huge[3, ::block] = torch.tensor([3.4e38, -3.4e38, 1e38, -2e38])  # saturation next to small values
    out["huge"] = huge.clamp(-3.4e38, 3.4e38)
    # Negatives that round to zero (-> +0 for E2M1, -0 for E4M3) beside an anchor that fixes the scale.
    neg = torch.tensor([-0.2, -0.25, -1e-30, -0.0, -0.24999, -1e-3, -2.0**-10, -2.0**-11])
    out["neg_to_zero"] = _rows_with_anchor(torch.tensor([6.0, 448.0, -6.0]), neg, block)
    # Random finite fp32 bit patterns: every exponent, subnormals included.
    bits = torch.randint(-(2**31), 2**31, (8, d), generator=g, dtype=torch.int64).to(torch.int32)
    rnd = bits.view(torch.float32)
    out["random_bits"] = torch.where(rnd.isfinite(), rnd, torch.zeros(()))
    return {k: v.to(device) for k, v in out.items()}


def _tie_rows(vals: torch.Tensor, scales: torch.Tensor, block: int, anchor: float = 6.0) -> torch.Tensor:
    """Blocks [anchor * s, vals * s...] for each scale s: vals land exactly on multiples of the scale."""
    rows = _rows_with_anchor(torch.tensor([anchor]), vals, block)
    return torch.cat([rows * s for s in scales.tolist()])


CASES = list(cases("fp8"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", NAMES)
def test_matches_reference(name: str, case: str, dtype: torch.dtype) -> None:
    check(name, cases(name)[case].to(dtype))


def _odd_shapes(block: int) -> list[tuple[int, ...]]:
    """Leading dims that are no tile multiple, a block count that is none, and rows of one block (a
    decode cache's probe entry is one row of one block at small widths)."""
    return [(3, 5, 64), (7, 3 * block), (1, 1, 1, block), (5, block), (2, 3, 5, 41 * block)]


@pytest.mark.parametrize("name", NAMES)
def test_odd_leading_shapes_and_block_counts(name: str) -> None:
    g = torch.Generator().manual_seed(1)
    block = BLOCK[name]
    for shape in _odd_shapes(block):
        check(name, torch.randn(*shape, generator=g))
    check(name, torch.randn(3, 5, 64, generator=g).bfloat16())


@pytest.mark.parametrize("name", NAMES)
def test_strided_inputs_fp16_and_fp64(name: str) -> None:
    g = torch.Generator().manual_seed(2)
    block = BLOCK[name]
    wide = torch.randn(6, 3 * block, generator=g)
    check(name, wide[:, : 2 * block])  # row stride 3 blocks: passed to the kernel as-is
    check(name, wide[:, block:].bfloat16())
    check(name, torch.randn(2 * block, 5, generator=g).t())  # last-dim stride != 1: copied
    check(name, torch.randn(4, 2 * block, generator=g).half(), out_dtypes=(torch.float16,))
    check(name, torch.randn(4, 2 * block, generator=g, dtype=torch.float64))
    # Unpacking from a slice of a wider cache buffer (row stride > row width).
    x = torch.randn(5, 2 * block, generator=g)
    codes, scales = REF_PACK[name][0](x)
    cbuf = torch.zeros(5, codes.shape[1] + 8, dtype=torch.uint8)
    sbuf = torch.zeros(5, scales.shape[1] + 3, dtype=torch.uint8)
    cbuf[:, 4:4 + codes.shape[1]] = codes
    sbuf[:, 1:1 + scales.shape[1]] = scales
    got = KER_PACK[name][1](cbuf[:, 4:4 + codes.shape[1]], sbuf[:, 1:1 + scales.shape[1]], torch.bfloat16)
    assert_same(got, REF_PACK[name][1](codes, scales, torch.bfloat16))


@pytest.mark.parametrize("name", NAMES)
def test_inf_and_nan_follow_the_reference(name: str) -> None:
    block = BLOCK[name]
    x = torch.randn(6, 2 * block, generator=torch.Generator().manual_seed(3))
    x[0, 3], x[1, 0], x[2, 5], x[3, 1] = float("inf"), -float("inf"), float("nan"), -float("nan")
    x[4, :block] = float("inf")
    x[5, block + 2] = float("nan")
    check(name, x)
    check(name, x.bfloat16())


@pytest.mark.parametrize("name", NAMES)
def test_unpack_any_bytes(name: str) -> None:
    """Every code byte under every scale byte, including the ones pack never makes (nibble 0x8, E4M3
    NaN, E8M0 0 and 255)."""
    block = BLOCK[name]
    per_block = block // 2 if name != "fp8" else block
    codes = torch.arange(256, dtype=torch.uint8).repeat(256).reshape(256, -1)  # [256, 256]: row r, all codes
    scales = torch.arange(256, dtype=torch.uint8)[:, None].expand(256, 256 // per_block).contiguous()
    unpack, ref_unpack = KER_PACK[name][1], REF_PACK[name][1]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert_same(unpack(codes, scales, dtype), ref_unpack(codes, scales, dtype))


@pytest.mark.parametrize("name", NAMES)
def test_empty_tensors(name: str) -> None:
    block = BLOCK[name]
    for shape in [(0, block), (4, 0), (2, 0, 2 * block)]:
        x = torch.zeros(shape)
        codes, scales = KER_PACK[name][0](x)
        ref_codes, ref_scales = REF_PACK[name][0](x)
        assert codes.shape == ref_codes.shape and scales.shape == ref_scales.shape
        assert KER_PACK[name][1](codes, scales).shape == REF_PACK[name][1](ref_codes, ref_scales).shape
        assert K.quant_dequant(name, x).shape == x.shape


def _ref_error(fn, *args) -> str:
    with pytest.raises(ValueError) as err:
        fn(*args)
    return re.escape(str(err.value))


@pytest.mark.parametrize("name", NAMES)
def test_errors_match_the_reference(name: str) -> None:
    block = BLOCK[name]
    pack, unpack = KER_PACK[name]
    ref_pack, ref_unpack = REF_PACK[name]
    for bad in (torch.tensor(1.0), torch.zeros(2, block + 1)):
        msg = _ref_error(ref_pack, bad)
        with pytest.raises(ValueError, match=msg):
            pack(bad)
        with pytest.raises(ValueError, match=msg):
            K.quant_dequant(name, bad)
    codes, scales = ref_pack(torch.zeros(2, 2 * block))
    msg = _ref_error(ref_unpack, codes, scales[:, :1])
    with pytest.raises(ValueError, match=msg):
        unpack(codes, scales[:, :1])
    with pytest.raises(ValueError, match="leading shape"):
        unpack(codes[:1], scales)
    with pytest.raises(ValueError, match="must be uint8"):
        unpack(codes.to(torch.int16), scales)


def test_unknown_format() -> None:
    with pytest.raises(ValueError, match="unknown format 'nvfp4'"):
        K.quant_dequant("nvfp4", torch.zeros(2, 32))


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_reference_is_the_same_on_cuda_and_cpu(name: str) -> None:
    """The reference is the spec, so its bits must not depend on the device. ATen's CUDA division by a
    Python number multiplies by the rounded reciprocal; before model.quant divided by a device tensor,
    10 kv_fp4 scale bytes of the scale-tie case (9 packed code bytes) came out one step off on an H200."""
    ref_pack = REF_PACK[name][0]
    inputs = list(cases(name).values()) + [torch.randn(4096, 512, generator=torch.Generator().manual_seed(0))]
    for x in inputs:
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            cpu_codes, cpu_scales = ref_pack(xd)
            cuda_codes, cuda_scales = ref_pack(xd.cuda())
            assert_same(cuda_scales.cpu(), cpu_scales)
            assert_same(cuda_codes.cpu(), cpu_codes)
            assert_same(REF_FAKE[name](xd.cuda()).cpu(), REF_FAKE[name](xd))


@pytest.mark.gpu
@pytest.mark.parametrize("name, dtype", [pytest.param(n, d, id=f"{n}-{i}")
                                         for n in NAMES
                                         for d, i in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"))])
def test_matches_reference_on_cuda(name: str, dtype: torch.dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 512, generator=g, device="cuda")
    x *= 10.0 ** torch.randint(-4, 5, (4096, 1), generator=g, device="cuda")  # rows across 8 decades
    check(name, x.to(dtype))
    for t in cases(name, "cuda").values():  # the hand-made cases, on the GPU's arithmetic
        check(name, t.to(dtype))
    for shape in _odd_shapes(BLOCK[name]):
        check(name, torch.randn(*shape, device="cuda").to(dtype))
