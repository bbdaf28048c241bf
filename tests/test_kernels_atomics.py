"""model/kernels/atomics.py: `add_rows_f32` against torch's index_put_(accumulate=True) on the
same rows, and the column split it builds its vector groups from. On a CPU the kernels run in
Triton's interpreter (tests/conftest.py), which has no inline PTX: there the scalar path and the
split are checked; the gpu test runs the vector reductions, their scalar fallback included."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from model.kernels.atomics import _column_quads, add_rows_f32, vector_reductions


@triton.jit
def _quads_kernel(X, OUT, R: tl.constexpr, N: tl.constexpr):
    offs_r, offs_n = tl.arange(0, R), tl.arange(0, N)
    x0, x1, x2, x3 = _column_quads(tl.load(X + offs_r[:, None] * N + offs_n[None, :]), R, N)
    offs_g = tl.arange(0, N // 4)
    at = OUT + offs_r[:, None] * N + offs_g[None, :]
    tl.store(at, x0)
    tl.store(at + N // 4, x1)
    tl.store(at + 2 * (N // 4), x2)
    tl.store(at + 3 * (N // 4), x3)


@triton.jit
def _add_kernel(DST, ROWS, VALS, MASK, SHIFT, R: tl.constexpr, N: tl.constexpr, ROW_STRIDE: tl.constexpr,
                VEC: tl.constexpr):
    offs_r, offs_n = tl.arange(0, R), tl.arange(0, N)
    rows = tl.load(ROWS + offs_r).to(tl.int64)
    tile = offs_r[:, None] * N + offs_n[None, :]
    add_rows_f32(DST + SHIFT + rows[:, None] * ROW_STRIDE + offs_n[None, :], tl.load(VALS + tile),
                 tl.load(MASK + tile) != 0, R, N, VEC)


def test_column_quads_are_the_four_columns_of_each_group():
    R, N = 16, 32
    x = torch.arange(R * N, dtype=torch.float32).view(R, N)
    out = torch.empty(R, 4, N // 4)
    _quads_kernel[(1,)](x, out, R=R, N=N)
    for j in range(4):
        assert torch.equal(out[:, j], x[:, j::4]), j


def _case(device, R=32, N=64, n_rows=20, seed=0):
    """Rows with repeats (several adds land on one row), random values and a random mask."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, n_rows, (R,), generator=g)
    vals = torch.randn(R, N, generator=g)
    mask = (torch.rand(R, N, generator=g) < 0.8).to(torch.int32)
    mask[: R // 2] = 1  # whole rows enabled: the vector path where aligned
    return rows.to(device), vals.to(device), mask.to(device)


def _expected(rows, vals, mask, n_rows, row_stride, shift):
    flat = torch.zeros(n_rows * row_stride + shift + 8, device=vals.device)
    cols = torch.arange(vals.shape[1], device=vals.device)
    at = (shift + rows[:, None] * row_stride + cols[None, :])[mask.bool()]
    return flat.index_put_((at,), vals[mask.bool()], accumulate=True)


def _run(rows, vals, mask, n_rows, row_stride, shift, vec):
    R, N = vals.shape
    dst = torch.zeros(n_rows * row_stride + shift + 8, device=vals.device)
    _add_kernel[(1,)](dst, rows, vals, mask, shift, R=R, N=N, ROW_STRIDE=row_stride, VEC=vec)
    return dst


LAYOUTS = pytest.mark.parametrize("shift,row_stride", [(0, 64), (0, 66), (1, 64), (2, 64)],
                                  ids=["aligned", "rows-8-byte-aligned", "unaligned-4", "unaligned-8"])


@LAYOUTS
def test_scalar_path_adds_every_enabled_lane(shift, row_stride):
    rows, vals, mask = _case("cuda" if torch.cuda.is_available() else "cpu")
    got = _run(rows, vals, mask, 20, row_stride, shift, vec=False)
    torch.testing.assert_close(got, _expected(rows, vals, mask, 20, row_stride, shift), atol=1e-5, rtol=1e-5)


def test_vector_reductions_only_when_asked_and_on_sm90():
    assert not vector_reductions(True, torch.device("cpu"))
    assert not vector_reductions(False, torch.device("cpu"))
    if torch.cuda.is_available():
        cuda = torch.device("cuda", 0)
        assert vector_reductions(True, cuda) == (torch.cuda.get_device_capability(cuda) >= (9, 0))
        assert not vector_reductions(False, cuda)


@pytest.mark.gpu
@LAYOUTS
def test_gpu_vector_path_adds_every_enabled_lane(shift, row_stride):
    """Vector reductions where a group is enabled and 16-byte aligned, scalar ones elsewhere:
    partial groups (mask), and rows or columns off the 16-byte grid (row stride 66, shifts)."""
    rows, vals, mask = _case("cuda")
    got = _run(rows, vals, mask, 20, row_stride, shift, vec=True)
    torch.testing.assert_close(got, _expected(rows, vals, mask, 20, row_stride, shift), atol=1e-5, rtol=1e-5)
