"""Rotary kernel (model/kernels/rope.py) against the plain-PyTorch `Rotary.forward`.

CPU runs use Triton's interpreter in fp32; the bf16 check at `small`'s q shape needs a GPU.
"""
import pytest
import torch

from model.ops import KernelPolicy
from model.rope import Rotary

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def pair(dim=16, theta=10_000.0, **kw):
    """(reference, kernel) rotaries with the same frequencies (YaRN on, so not just theta powers)."""
    args = (dim, theta, 4.0, 64, 32, 1)
    return Rotary(*args, **kw).to(DEV), KernelPolicy(["rotary"]).apply(Rotary(*args, **kw)).to(DEV)


def run(rotary, x, angles, inverse, cot):
    x = x.detach().clone().requires_grad_()
    out = rotary(x, angles, inverse=inverse)
    (g,) = torch.autograd.grad(out, [x], cot)
    return out, g


@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
@pytest.mark.parametrize("shape,heads", [((2, 37, 48), False), ((2, 19, 3, 48), True), ((3, 7, 16), False)],
                         ids=["rows", "heads-share-angles", "rope-only"])
def test_matches_reference(shape, heads, inverse):
    """Forward and gradient; 74 / 114 / 21 rows: partial last row blocks; "rope-only": no pass-through
    dims."""
    g = torch.Generator().manual_seed(0)
    ref, fast = pair()
    x = torch.randn(shape, generator=g).to(DEV)
    positions = torch.randint(0, 5000, shape[:2], generator=g).to(DEV)
    angles = ref.angles(positions)  # [B, T, 8]
    if heads:
        angles = angles.unsqueeze(-2)
    cot = torch.randn(shape, generator=g).to(DEV)
    out, grad = run(fast, x, angles, inverse, cot)
    want, want_grad = run(ref, x, angles, inverse, cot)
    assert out.shape == want.shape and out.dtype == want.dtype
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, want_grad, rtol=1e-6, atol=1e-6)
    # the pass-through dims are copied exactly, and the rotation keeps each pair's length
    lead = shape[-1] - 16
    assert torch.equal(out[..., :lead], x[..., :lead])
    pairs = lambda t: t[..., lead:].unflatten(-1, (8, 2)).norm(dim=-1)  # noqa: E731
    torch.testing.assert_close(pairs(out), pairs(x), rtol=1e-5, atol=1e-5)


def test_inverse_undoes_forward_and_other_broadcasts_fall_back():
    g = torch.Generator().manual_seed(1)
    _, fast = pair()
    x = torch.randn(2, 9, 32, generator=g).to(DEV)
    angles = fast.angles(torch.arange(9, device=DEV).expand(2, 9))
    torch.testing.assert_close(fast(fast(x, angles), angles, inverse=True), x, rtol=1e-5, atol=1e-5)
    # angles [1, T, R/2] broadcast over the batch: outside the kernel's contract, so the reference runs
    ref, _ = pair()
    one = angles[:1]
    torch.testing.assert_close(fast(x, one), ref(x, one), rtol=0, atol=0)


def test_float64_uses_the_reference():
    ref, fast = pair()
    x = torch.randn(2, 5, 32, dtype=torch.float64, device=DEV)
    angles = ref.angles(torch.arange(5, device=DEV).expand(2, 5))
    assert torch.equal(fast(x, angles), ref(x, angles))


def test_bad_angles_are_refused():
    from model.kernels.rope import rotary_triton

    x = torch.randn(2, 5, 32, device=DEV)
    with pytest.raises(ValueError, match="exceed"):
        rotary_triton(x, torch.ones(2, 5, 17, device=DEV))
    with pytest.raises(ValueError, match="do not match"):
        rotary_triton(x, torch.ones(2, 4, 8, device=DEV))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_small_q_shape_on_gpu():
    """`small`'s q [2, 4096, 16, 512], RoPE on 64 dims, bf16: both round the fp32 rotation once to
    bf16, so they differ at most by that rounding (fp32 contraction differs between the two)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    ref, fast = pair(64, 160_000.0)
    x = torch.randn(2, 4096, 16, 512, device="cuda", generator=g).to(torch.bfloat16)
    angles = ref.angles(torch.arange(4096, device="cuda").expand(2, 4096)).unsqueeze(-2)
    cot = torch.randn(x.shape, device="cuda", generator=g).to(torch.bfloat16)
    out, grad = run(fast, x, angles, False, cot)
    want, want_grad = run(ref, x, angles, False, cot)
    torch.testing.assert_close(out, want, rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(grad, want_grad, rtol=8e-3, atol=8e-3)
    assert (out != want).float().mean() < 1e-3
