"""Fused clamped SwiGLU (model/kernels/swiglu.py) against model.moe.clamped_swiglu on the two
halves of gate_up [..., 2I]: output and gate_up's gradient, with values beyond and exactly at the
clamp bounds. CPU: Triton's interpreter in fp32; the gpu test runs bf16 at the MoE's shape."""
from __future__ import annotations

import pytest
import torch

from model.kernels.swiglu import clamped_swiglu_packed_triton
from model.moe import clamped_swiglu


def _inputs(shape, limit, dtype=torch.float32, device="cpu", seed=0):
    """gate_up [*shape[:-1], 2 * shape[-1]]."""
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(*shape, generator=g) * 6  # beyond +-limit often
    up = torch.randn(*shape, generator=g) * 6
    if limit > 0:  # exactly at the bounds: the gradient passes there (torch.clamp's rule)
        gate.view(-1)[:5] = limit
        up.view(-1)[:5] = -limit
        up.view(-1)[5:10] = limit
    return torch.cat((gate, up), -1).to(device, dtype)


def _unpacked(gate_up, limit):
    """The reference on separately made gate and up tensors: no slicing of one gate_up."""
    half = gate_up.shape[-1] // 2
    return clamped_swiglu(gate_up[..., :half].clone(), gate_up[..., half:].clone(), limit)


def _run(fn, gate_up, limit, dh):
    gate_up = gate_up.clone().requires_grad_()
    h = fn(gate_up, limit)
    (h.float() * dh).sum().backward()
    return h, gate_up.grad


@pytest.mark.parametrize("limit", [7.0, 0.0], ids=["clamped", "no-clamp"])
@pytest.mark.parametrize("shape", [(3, 37), (2, 5, 1100), (9, 256)],
                         ids=["small", "several-blocks", "whole-tiles"])
def test_matches_reference(limit, shape):
    gate_up = _inputs(shape, limit)
    dh = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    got, want = _run(clamped_swiglu_packed_triton, gate_up, limit, dh), _run(_unpacked, gate_up, limit, dh)
    assert got[0].shape == shape and got[1].shape == gate_up.shape
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_gate_gradient_is_the_first_half():
    """Only the gate half's values matter to the gate gradient: perturbing up's clamp bounds moves
    only the up half of the gradient, which would fail with the halves swapped in the kernel."""
    gate_up = _inputs((4, 40), 5.0)
    dh = torch.ones(4, 40)
    _, grad = _run(clamped_swiglu_packed_triton, gate_up, 5.0, dh)
    up = gate_up[:, 40:]
    assert torch.all(grad[:, 40:][up.abs() > 5.0] == 0)  # clamped up: no gradient there
    gate = gate_up[:, :40]
    assert torch.all(grad[:, :40][gate > 5.0] == 0)
    assert torch.any(grad[:, :40][gate < -5.0] != 0)  # gate is clamped from above only


@pytest.mark.gpu
def test_gpu_bf16_moe_shape():
    gate_up = _inputs((131072, 768), 10.0, torch.bfloat16, "cuda")
    dh = torch.randn(131072, 768, device="cuda")
    want = _run(_unpacked, gate_up.float(), 10.0, dh)
    got = _run(clamped_swiglu_packed_triton, gate_up, 10.0, dh)
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16
        assert ((g.float() - w).norm() / w.norm()).item() < 1e-2


def test_inputs_the_kernel_does_not_take_fall_back_to_the_reference(monkeypatch):
    """float64 or an odd width: the reference runs (never the kernel), with its output and
    gradient (an odd width is the reference's own error: chunk gives unequal halves)."""
    import model.kernels.swiglu as sw

    def no_kernel(*_):
        raise AssertionError("the kernel must not run for these inputs")

    monkeypatch.setattr(sw, "_swiglu_kernel", no_kernel)
    gate_up = _inputs((4, 8), 5.0).double()
    dh = torch.randn(4, 8, dtype=torch.float64)
    for g, w in zip(_run(clamped_swiglu_packed_triton, gate_up, 5.0, dh), _run(_unpacked, gate_up, 5.0, dh)):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    with pytest.raises(RuntimeError):
        clamped_swiglu_packed_triton(torch.randn(4, 9), 5.0)
