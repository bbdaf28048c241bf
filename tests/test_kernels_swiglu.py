"""Fused clamped SwiGLU (model/kernels/swiglu.py) against model.moe.clamped_swiglu: output and
both gradients, with values beyond and exactly at the clamp bounds. CPU: Triton's interpreter in
fp32; the gpu test runs bf16 at the MoE's shape."""
from __future__ import annotations

import pytest
import torch

from model.kernels.swiglu import clamped_swiglu_triton
from model.moe import clamped_swiglu


def _inputs(shape, limit, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(*shape, generator=g) * 6  # beyond +-limit often
    up = torch.randn(*shape, generator=g) * 6
    if limit > 0:  # exactly at the bounds: the gradient passes there (torch.clamp's rule)
        gate.view(-1)[:5] = limit
        up.view(-1)[:5] = -limit
        up.view(-1)[5:10] = limit
    return gate.to(device, dtype), up.to(device, dtype)


def _run(fn, gate, up, limit, dh):
    gate, up = gate.clone().requires_grad_(), up.clone().requires_grad_()
    h = fn(gate, up, limit)
    (h.float() * dh).sum().backward()
    return h, gate.grad, up.grad


@pytest.mark.parametrize("limit", [7.0, 0.0], ids=["clamped", "no-clamp"])
@pytest.mark.parametrize("shape", [(3, 37), (2, 5, 1100)], ids=["small", "several-blocks"])
def test_matches_reference(limit, shape):
    gate, up = _inputs(shape, limit)
    dh = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    for got, want in zip(_run(clamped_swiglu_triton, gate, up, limit, dh), _run(clamped_swiglu, gate, up, limit, dh)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_strided_halves_of_one_projection():
    """gate and up as the two halves of one [N, 2I] output (non-contiguous views)."""
    both = torch.randn(6, 2, 40, generator=torch.Generator().manual_seed(2)) * 6
    gate, up = both[:, 0], both[:, 1]
    dh = torch.randn(6, 40)
    for got, want in zip(_run(clamped_swiglu_triton, gate, up, 5.0, dh), _run(clamped_swiglu, gate, up, 5.0, dh)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_gpu_bf16_moe_shape():
    gate, up = _inputs((131072, 768), 10.0, torch.bfloat16, "cuda")
    dh = torch.randn(131072, 768, device="cuda")
    wide = [t.float() for t in (gate, up)]
    want = _run(clamped_swiglu, *wide, 10.0, dh)
    got = _run(clamped_swiglu_triton, gate, up, 10.0, dh)
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16
        assert ((g.float() - w).norm() / w.norm()).item() < 1e-2


def test_inputs_the_kernel_does_not_take_fall_back_to_the_reference(monkeypatch):
    """float64, mismatched dtypes or broadcast shapes: the reference runs (never the kernel), with
    its output and gradients."""
    import model.kernels.swiglu as sw

    def no_kernel(*_):
        raise AssertionError("the kernel must not run for these inputs")

    monkeypatch.setattr(sw, "_swiglu_kernel", no_kernel)
    g = torch.Generator().manual_seed(4)
    cases = [(torch.randn(4, 8, generator=g, dtype=torch.float64) * 6,
              torch.randn(4, 8, generator=g, dtype=torch.float64) * 6),
             (torch.randn(4, 8, generator=g) * 6, (torch.randn(4, 8, generator=g) * 6).double()),
             (torch.randn(4, 8, generator=g) * 6, torch.randn(1, 8, generator=g) * 6)]
    for gate, up in cases:
        dh = torch.randn(4, 8, generator=g)
        for got, want in zip(_run(clamped_swiglu_triton, gate, up, 5.0, dh), _run(clamped_swiglu, gate, up, 5.0, dh)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
