"""Fused MoE combine (model/kernels/moe_combine.py) against the reference tail of
`MoE.dispatch` (gather back to token order, scale by the routing weights, sum over the k
experts): output, the expert rows' gradient and the weights' gradient. CPU: Triton's interpreter
in fp32; the gpu test runs bf16 rows at the `small` step's shape. Also the dispatch's cast
before its gather under autocast (`_Gather`'s dtype), and its gradient's fused gather + sum."""
from __future__ import annotations

import pytest
import torch

from model.kernels.moe_combine import moe_combine_triton, moe_gather_sum_triton
from model.moe import MoE, _Gather, combine_reference
from model.ops import KernelPolicy


def _reference(y, inv, weights, out_dtype):
    return combine_reference(y, inv, torch.argsort(inv), weights, out_dtype)


def _inputs(N, k, D, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(N * k, D, generator=g).to(device, dtype)
    inv = torch.randperm(N * k, generator=g).to(device)
    weights = torch.rand(N, k, generator=g).to(device)
    return y, inv, weights


def _run(fn, y, inv, weights, out_dtype, dout):
    y, weights = y.clone().requires_grad_(), weights.clone().requires_grad_()
    out = fn(y, inv, weights, out_dtype)
    (out.float() * dout).sum().backward()
    return out, y.grad, weights.grad


@pytest.mark.parametrize("N,k,D", [(37, 4, 48), (5, 2, 1100)], ids=["partial-tiles", "wide-rows"])
def test_matches_reference(N, k, D):
    y, inv, weights = _inputs(N, k, D)
    dout = torch.randn(N, D, generator=torch.Generator().manual_seed(1))
    got = _run(moe_combine_triton, y, inv, weights, torch.float32, dout)
    want = _run(_reference, y, inv, weights, torch.float32, dout)
    for name, a, b in zip(("out", "dy", "dweights"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_bad_shapes_are_refused():
    y, inv, weights = _inputs(6, 2, 16)
    with pytest.raises(ValueError, match="moe_combine_triton"):
        moe_combine_triton(y[:-1], inv, weights, torch.float32)


def _moe(kernels: bool) -> MoE:
    torch.manual_seed(0)
    moe = MoE(dim=32, n_routed=8, n_shared=1, topk=3, inter_dim=24, route_scale=2.5, limit=7.0,
              seq_aux_alpha=0.0)
    if kernels:
        KernelPolicy(["swiglu", "moe_combine"]).apply(moe)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return moe


def test_moe_with_the_combine_kernel_matches_the_reference_moe():
    x = torch.randn(2, 19, 32, generator=torch.Generator().manual_seed(2))
    outs = []
    for kernels in (False, True):
        moe = _moe(kernels)
        xi = x.clone().requires_grad_()
        y, _ = moe(xi)
        (y * torch.linspace(-1, 1, 32)).sum().backward()
        outs.append((y, xi.grad, {n: p.grad for n, p in moe.named_parameters()}))
    (y0, gx0, gp0), (y1, gx1, gp1) = outs
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx1, gx0, rtol=1e-5, atol=1e-5)
    for name in gp0:
        torch.testing.assert_close(gp1[name], gp0[name], rtol=1e-5, atol=1e-5, msg=name)


def test_dispatch_gather_casts_before_copying_rows():
    """dtype: the M rows are cast once, then copied; the gradient of a row's copies is summed
    in x's dtype. Same values as gathering in x's dtype and casting the copies."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 16, generator=g)
    copies = 3
    index = torch.randperm(7 * copies, generator=g) // copies  # each row `copies` times
    back = torch.argsort(index, stable=True)  # positions of row r's copies, row by row
    grad = torch.randn(7 * copies, 16, generator=g).to(torch.bfloat16)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    got = _Gather.apply(xa, index, back, copies, torch.bfloat16)
    want = xb.index_select(0, index).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    got.backward(grad)
    want.backward(grad)
    assert xa.grad.dtype == torch.float32
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-6, atol=1e-6)


def _copies_gradient_reference(grad, back, copies, out_dtype):
    """_Gather's own backward (no fused sum): gather into row order, sum each row's copies."""
    x = torch.zeros(grad.shape[0] // copies, grad.shape[1], dtype=out_dtype, requires_grad=True)
    index = torch.empty_like(back).scatter_(0, back, torch.arange(back.numel()) // copies)
    _Gather.apply(x, index, back, copies, grad.dtype).backward(grad)
    return x.grad


@pytest.mark.parametrize("rows,copies,D,dtype,out_dtype", [
    (37, 4, 48, torch.float32, torch.float32), (5, 3, 1100, torch.float32, torch.float32),
    (29, 4, 64, torch.bfloat16, torch.bfloat16), (29, 4, 64, torch.bfloat16, torch.float32)],
    ids=["fp32", "wide-rows", "bf16", "bf16-to-fp32"])
def test_gather_sum_matches_the_gathers_gradient(rows, copies, D, dtype, out_dtype):
    """moe_gather_sum_triton(g, back, k) is the gradient of k copies of each row placed at
    back[r*k : (r+1)*k]: row r = sum of those k rows of g, in fp32, rounded once."""
    g = torch.Generator().manual_seed(5)
    grad = torch.randn(rows * copies, D, generator=g).to(dtype)
    back = torch.randperm(rows * copies, generator=g)
    got = moe_gather_sum_triton(grad, back, copies, out_dtype)
    want = _copies_gradient_reference(grad, back, copies, out_dtype)
    by_hand = grad.float()[back].view(rows, copies, D).sum(1).to(out_dtype)
    assert got.dtype == out_dtype and got.shape == (rows, D)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(got, by_hand, **tol)
    with pytest.raises(ValueError, match="moe_gather_sum_triton"):
        moe_gather_sum_triton(grad[:-1], back[:-1], copies, out_dtype)


@pytest.mark.gpu
def test_gpu_gather_sum_small_step_shape():
    g = torch.Generator().manual_seed(6)
    grad = torch.randn(131072, 1024, generator=g).to("cuda", torch.bfloat16)
    back = torch.randperm(131072, generator=g).cuda()
    want = grad.float()[back].view(32768, 4, 1024).sum(1)
    got = moe_gather_sum_triton(grad, back, 4, torch.bfloat16)
    assert ((got.float() - want).norm() / want.norm()).item() < 4e-3


@pytest.mark.gpu
def test_gpu_bf16_small_step_shape():
    y, inv, weights = _inputs(32768, 4, 1024, torch.bfloat16, "cuda")
    dout = torch.randn(32768, 1024, device="cuda")
    want = _run(_reference, y.float(), inv, weights, torch.float32, dout)
    got = _run(moe_combine_triton, y, inv, weights, torch.float32, dout)
    for name, a, b in zip(("out", "dy", "dweights"), got, want):
        assert ((a.float() - b).norm() / b.norm()).item() < 1e-2, name
