"""Fused head + cross-entropy kernel (model/kernels/cross_entropy.py) against the reference
`F.cross_entropy(head(x))` (the whole model's loss with kernels on and off: tests/test_kernels_model.py).

CPU runs use Triton's interpreter in fp32; the bf16 autocast check at `small`'s vocabulary needs a GPU.
"""
import pytest
import torch
import torch.nn.functional as F

from model.kernels.cross_entropy import linear_cross_entropy_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def data(n=50, d=24, v=203, seed=0, ignore=(3, 17, 18)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g).to(DEV)
    w = (torch.randn(v, d, generator=g) * 0.5).to(DEV)
    y = torch.randint(0, v, (n,), generator=g)
    y[list(ignore)] = -100
    return x, w, y.to(DEV)


def loss_and_grads(fn, x, w, y):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fn(x, w, y)
    gx, gw = torch.autograd.grad(loss * 0.37, [x, w])  # a non-unit upstream gradient
    return loss, gx, gw


def reference(x, w, y):
    return F.cross_entropy(x @ w.t(), y, ignore_index=-100, reduction="sum")


@pytest.mark.parametrize("chunk", [50, 16, 7], ids=["one-chunk", "chunks", "ragged-chunks"])
def test_matches_reference(chunk):
    """V = 203: not a multiple of the kernel's 64-wide vocabulary block; rows 3, 17, 18 ignored."""
    x, w, y = data()
    got = loss_and_grads(lambda *a: linear_cross_entropy_triton(*a, chunk=chunk), x, w, y)
    want = loss_and_grads(reference, x, w, y)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert got[1][[3, 17, 18]].abs().max() == 0  # ignored rows: no gradient


def test_loss_only_when_no_gradient_is_wanted():
    x, w, y = data(seed=1)
    with torch.no_grad():
        got = linear_cross_entropy_triton(x, w, y, chunk=16)
    torch.testing.assert_close(got, reference(x, w, y), rtol=1e-5, atol=1e-5)
    # only the weight wants a gradient (a frozen trunk): dx is not formed
    wr = w.clone().requires_grad_()
    (gw,) = torch.autograd.grad(linear_cross_entropy_triton(x, wr, y, chunk=16), [wr])
    (gw_ref,) = torch.autograd.grad(reference(x, wr, y), [wr])
    torch.testing.assert_close(gw, gw_ref, rtol=1e-5, atol=1e-5)


def test_all_ignored_and_bad_labels():
    x, w, y = data(n=6, ignore=range(6))
    loss, gx, gw = loss_and_grads(linear_cross_entropy_triton, x, w, y)
    assert loss.item() == 0 and gx.abs().max() == 0 and gw.abs().max() == 0
    y[2] = w.shape[0]
    with pytest.raises(ValueError, match=r"labels outside \[0, 203\)"):
        linear_cross_entropy_triton(x, w, y)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_autocast_at_small_vocab_on_gpu():
    """4096 tokens x 129280 vocabulary x 1024, bf16 autocast with fp32 master weights, 2 chunks:
    against the reference's fp32 loss over bf16 logits (what lm_loss did)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 1024, device="cuda", generator=g)
    w = torch.randn(129280, 1024, device="cuda", generator=g) * 0.02
    y = torch.randint(0, 129280, (4096,), device="cuda", generator=g)
    y[:100] = -100

    def ref(x, w, y):
        return F.cross_entropy((x @ w.t()).float(), y, ignore_index=-100, reduction="sum")

    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = loss_and_grads(lambda *a: linear_cross_entropy_triton(*a, chunk=2048), x, w, y)
        want = loss_and_grads(ref, x, w, y)
    assert got[1].dtype == torch.float32 and got[2].dtype == torch.float32
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=0)
    for a, b in zip(got[1:], want[1:]):
        assert ((a - b).norm() / b.norm()).item() < 1e-2
