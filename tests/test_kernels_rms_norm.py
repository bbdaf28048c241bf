"""Fused RMSNorm (model/kernels/rms_norm.py) against `model.numerics.RMSNorm`'s reference path:
output, input and weight gradients. CPU: Triton's interpreter in fp32 (D a power of two and
not, rows not a tile multiple, several tiles a backward program); the gpu test runs bf16 and
autocast at the `small` step's shapes."""
from __future__ import annotations

import pytest
import torch

from model.numerics import RMSNorm
from model.ops import KernelPolicy

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _norms(D: int, seed: int = 0, device: str = DEV):
    """(reference, kernel) RMSNorm with the same random weight."""
    ref = RMSNorm(D, eps=1e-6).to(device)
    with torch.no_grad():
        ref.weight.copy_(1 + 0.5 * torch.randn(D, generator=torch.Generator().manual_seed(seed)))
    ker = KernelPolicy(["rms_norm"]).apply(RMSNorm(D, eps=1e-6)).to(device)
    ker.load_state_dict(ref.state_dict())
    return ref, ker


def _run(norm: RMSNorm, x: torch.Tensor, dy: torch.Tensor, autocast: bool = False):
    norm.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        y = norm(x)
    (y.float() * dy).sum().backward()
    return y, x.grad, norm.weight.grad


@pytest.mark.parametrize("shape", [(3, 7, 64), (2, 5, 48), (1, 300, 16)], ids=["pow2", "D48", "many-tiles"])
def test_matches_reference_fp32(shape):
    ref, ker = _norms(shape[-1])
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(*shape, generator=g) * 3).to(DEV)
    dy = torch.randn(*shape, generator=g).to(DEV)
    (y_r, dx_r, dw_r), (y_k, dx_k, dw_k) = _run(ref, x, dy), _run(ker, x, dy)
    assert y_k.dtype == y_r.dtype == torch.float32
    torch.testing.assert_close(y_k, y_r, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx_k, dx_r, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dw_k, dw_r, atol=1e-4, rtol=1e-5)
    assert dw_k.dtype == torch.float32


def test_reference_where_the_kernel_does_not_apply():
    """fp64 runs the reference (the kernel computes in fp32): same values as the plain norm."""
    ref, ker = _norms(32)
    x = torch.randn(4, 32, dtype=torch.float64, device=DEV)
    torch.testing.assert_close(ker.double()(x), ref.double()(x), atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("D,autocast", [(1024, False), (512, False), (1024, True)],
                         ids=["bf16-1024", "bf16-512", "fp32-autocast-1024"])
def test_gpu_matches_reference(D, autocast):
    """bf16 input (the q / kv norms after a matmul; the block norms after the fused mHC step) and an
    fp32 input under autocast (bf16 out): the kernel against the reference in fp32."""
    ref, ker = _norms(D)
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(8, 4096, D, generator=g) * 3).cuda()
    # dy in bf16 values: the kernel's y is bf16, so its gradient arrives rounded; the fp32
    # reference then sees the same dy, and dw (which does not involve w) differs only by the
    # order of the fp32 sums
    dy = torch.randn(8, 4096, D, generator=g).bfloat16().float().cuda()
    if not autocast:
        x = x.bfloat16()
    y_k, dx_k, dw_k = _run(ker, x, dy, autocast)
    y_r, dx_r, dw_r = _run(ref, x.float(), dy)
    assert y_k.dtype == torch.bfloat16 and dx_k.dtype == x.dtype and dw_k.dtype == torch.float32
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()
    # y and dx: the output's bf16 rounding, and (bf16 x) the kernel's weight rounded to bf16
    assert rel(y_k, y_r) < 5e-3, rel(y_k, y_r)
    assert rel(dx_k, dx_r) < 1e-2, rel(dx_k, dx_r)
    assert rel(dw_k, dw_r) < 1e-4, rel(dw_k, dw_r)
