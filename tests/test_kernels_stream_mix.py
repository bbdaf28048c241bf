"""Stream-mix kernels (model/kernels/stream_mix.py) against model.mhc's update_streams and
mix_streams: outputs and the gradients of every input. CPU: Triton's interpreter in fp32; the gpu
test runs `small`'s shape with fp32 streams and a bf16 sub-layer output, as training does."""
from __future__ import annotations

import pytest
import torch

from model.kernels.stream_mix import mix_streams_triton, update_streams_triton
from model.mhc import mix_streams, update_streams


def _inputs(lead, n, D, device="cpu", y_dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*lead, n, D, generator=g)
    y = torch.randn(*lead, D, generator=g)
    post = torch.rand(*lead, n, generator=g) * 2
    comb = torch.rand(*lead, n, n, generator=g)
    pre = torch.rand(*lead, n, generator=g)
    return h.to(device), y.to(device, y_dtype), post.to(device), comb.to(device), pre.to(device)


def _grads(fn, *args):
    """fn(*args) and the gradient of <out, cotangent> for each argument."""
    args = [a.detach().clone().requires_grad_() for a in args]
    out = fn(*args)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(out.device)
    grads = torch.autograd.grad((out.float() * cot).sum(), args)
    return out, grads


@pytest.mark.parametrize("lead, n, D", [((2, 5), 4, 48), ((1, 13), 4, 40), ((3, 2), 3, 16), ((1, 1), 1, 8)],
                         ids=["small", "partial-blocks", "n3", "one-stream"])
def test_update_streams_matches_reference(lead, n, D):
    h, y, post, comb, _ = _inputs(lead, n, D)
    out, grads = _grads(update_streams_triton, h, y, post, comb)
    want, want_grads = _grads(update_streams, h, y, post, comb)
    assert out.dtype == want.dtype and out.shape == want.shape
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    for name, got, ref in zip(("h", "y", "post", "comb"), grads, want_grads):
        assert got.shape == ref.shape and got.dtype == ref.dtype, name
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("lead, n, D", [((2, 5), 4, 48), ((1, 13), 4, 40), ((3, 2), 3, 16)],
                         ids=["small", "partial-blocks", "n3"])
def test_mix_streams_matches_reference(lead, n, D):
    h, _, _, _, pre = _inputs(lead, n, D, seed=1)
    out, grads = _grads(lambda p, x: mix_streams_triton(p, x), pre, h)
    want, want_grads = _grads(mix_streams, pre, h)
    assert out.shape == want.shape == (*lead, D)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    for got, ref in zip(grads, want_grads):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_gradients_only_of_the_inputs_that_need_them():
    """A constant pre (the first sub-layer's one-hot) or comb: only the streams' gradient, equal
    to the reference's."""
    h, y, post, comb, pre = _inputs((2, 5), 4, 48, seed=2)
    for fn, ref, consts, args in ((mix_streams_triton, mix_streams, (pre,), ()),
                                  (update_streams_triton, update_streams, (), (y, post, comb))):
        x = h.clone().requires_grad_()
        got = torch.autograd.grad(fn(*consts, x, *args).sum(), x)[0]
        x = h.clone().requires_grad_()
        want = torch.autograd.grad(ref(*consts, x, *args).sum(), x)[0]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_policy_takes_the_kernel_only_when_asked_and_shapes_match(monkeypatch):
    import model.kernels.stream_mix as sm
    from model.ops import KernelPolicy

    calls = []
    real = sm.update_streams_triton
    monkeypatch.setattr(sm, "update_streams_triton", lambda *a: calls.append(1) or real(*a))
    h, y, post, comb, _ = _inputs((2, 3), 4, 16)
    update_streams(h, y, post, comb)
    assert not calls  # no policy: the reference
    policy = KernelPolicy(["stream_mix"])
    update = policy._ops()["update_streams"]
    update(h, y, post, comb)
    assert len(calls) == 1 and not policy.fell_back
    # a broadcast comb [1, 3, n, n] is outside the kernel's contract: the reference runs
    got = update(h, y, post, comb[:1])
    assert len(calls) == 1 and policy.fell_back == {"stream_mix": "broadcast arguments"}
    torch.testing.assert_close(got, update_streams(h, y, post, comb[:1].expand_as(comb)))
    # fp64 stays on the reference (the interpreter would compute it in fp32)
    update(h.double(), y.double(), post.double(), comb.double())
    assert len(calls) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_small_shape_on_gpu():
    """8 x 4096 tokens, n = 4, D = 1024, fp32 streams, bf16 y: against the fp32 reference (the kernel
    computes in fp32 throughout; the reference on an fp32 y)."""
    h, y, post, comb, pre = _inputs((8, 4096), 4, 1024, device="cuda", y_dtype=torch.bfloat16)
    out, grads = _grads(update_streams_triton, h, y, post, comb)
    want, want_grads = _grads(update_streams, h, y.float(), post, comb)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)
    assert grads[1].dtype == torch.bfloat16
    for got, ref in zip(grads, want_grads):
        torch.testing.assert_close(got.float(), ref, rtol=1e-2, atol=1e-2)
    for got, ref in zip(grads[:1] + grads[2:], want_grads[:1] + want_grads[2:]):  # fp32 ones: fp32 accuracy
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-3)
    out, grads = _grads(mix_streams_triton, pre, h)
    want, want_grads = _grads(mix_streams, pre, h)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)
    for got, ref in zip(grads, want_grads):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-3)
