"""Chunked full-vocabulary reverse KL (rl/distill/kl.py) against the unchunked computation:
values and gradients, both teacher forms, masking, gradcheck, and bounded memory."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rl.distill.kl import (
    TeacherHidden,
    TeacherLogprobs,
    bytes_per_token,
    chunked_reverse_kl,
    reverse_kl_reference,
)

N, V, D, DT = 37, 1000, 16, 12  # N not a multiple of token_chunk, V not of vocab_chunk
TC, VC = 8, 128


def _case(dtype, seed=0, n=N, v=V, d=D, dt=DT):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)
    h, w = r(n, d), r(v, d) * 0.5
    th, tw = r(n, dt), r(v, dt) * 0.5
    mask = torch.rand(n, generator=g) > 0.3
    mask[0] = mask[-1] = True
    return h, w, th, tw, mask


def _teacher(kind, th, tw, temperature=1.0):
    if kind == "hidden":
        return TeacherHidden(th, tw, temperature)
    return TeacherLogprobs(torch.log_softmax((th @ tw.T) / temperature, -1))


def _reference(h, w, th, tw, mask, temperature=1.0):
    return reverse_kl_reference(h @ w.T, torch.log_softmax((th @ tw.T) / temperature, -1), mask)



@pytest.mark.parametrize("kind", ["logprobs", "hidden"])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_matches_reference(kind, dtype, tol, temperature):
    h, w, th, tw, mask = _case(dtype)
    hc, wc = h.clone().requires_grad_(), w.clone().requires_grad_()
    got = chunked_reverse_kl(hc, wc, _teacher(kind, th, tw, temperature), mask, token_chunk=TC,
                             vocab_chunk=VC)
    got.backward()
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    want = _reference(hr, wr, th, tw, mask, temperature)
    want.backward()
    assert got.dtype == want.dtype == dtype
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(hc.grad, hr.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(wc.grad, wr.grad, rtol=tol, atol=tol)
    assert got.item() > 0


@pytest.mark.parametrize("kind", ["logprobs", "hidden"])
def test_chunk_sizes_do_not_matter(kind):
    h, w, th, tw, mask = _case(torch.float64, seed=1)
    vals = [chunked_reverse_kl(h, w, _teacher(kind, th, tw), mask, token_chunk=tc, vocab_chunk=vc)
            for tc, vc in [(1, 1000), (37, 1), (5, 333), (100, 4096)]]
    for v in vals[1:]:
        torch.testing.assert_close(v, vals[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["logprobs", "hidden"])
def test_masked_tokens_contribute_nothing(kind):
    h, w, th, tw, mask = _case(torch.float64, seed=2)
    assert (~mask).any()
    hc = h.clone().requires_grad_()
    base = chunked_reverse_kl(hc, w, _teacher(kind, th, tw), mask, token_chunk=TC, vocab_chunk=VC)
    base.backward()
    assert torch.all(hc.grad[~mask] == 0)
    # Garbage (even NaN) in masked-out rows of student and teacher changes nothing.
    h2, th2 = h.clone(), th.clone()
    h2[~mask], th2[~mask] = float("nan"), 1e6
    teacher = _teacher(kind, th2, tw)
    if kind == "logprobs":
        lp = teacher.logprobs.clone()
        lp[~mask] = float("nan")
        teacher = TeacherLogprobs(lp)
    got = chunked_reverse_kl(h2, w, teacher, mask, token_chunk=TC, vocab_chunk=VC)
    torch.testing.assert_close(got, base.detach(), rtol=1e-12, atol=1e-12)
    # The mean is over masked tokens: the same as the unmasked mean of the selected rows.
    sub = chunked_reverse_kl(h[mask], w, _teacher(kind, th[mask], tw), None, token_chunk=TC, vocab_chunk=VC)
    torch.testing.assert_close(sub, base.detach(), rtol=1e-12, atol=1e-12)


def test_empty_mask_is_zero_with_zero_grads():
    h, w, th, tw, _ = _case(torch.float64)
    hc, wc = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = chunked_reverse_kl(hc, wc, TeacherHidden(th, tw), torch.zeros(N, dtype=torch.bool))
    loss.backward()
    assert loss.item() == 0 and not hc.grad.any() and not wc.grad.any()
    assert reverse_kl_reference(h @ w.T, torch.zeros(N, V, dtype=h.dtype),
                                torch.zeros(N, dtype=torch.bool)) == 0


@pytest.mark.parametrize("kind", ["logprobs", "hidden"])
def test_kl_nonnegative_and_zero_when_student_is_teacher(kind):
    for seed in range(3):
        h, w, th, tw, mask = _case(torch.float64, seed=seed)
        assert chunked_reverse_kl(h, w, _teacher(kind, th, tw), mask, token_chunk=TC, vocab_chunk=VC) >= 0
    hc, wc = h.clone().requires_grad_(), w.clone().requires_grad_()
    same = chunked_reverse_kl(hc, wc, _teacher(kind, h, w), mask, token_chunk=TC, vocab_chunk=VC)
    same.backward()
    assert abs(same.item()) < 1e-12
    # At the minimum the gradient vanishes too.
    assert hc.grad.abs().max() < 1e-12 and wc.grad.abs().max() < 1e-12


def test_teacher_gets_no_gradient():
    h, w, th, tw, mask = _case(torch.float64)
    hc, thc, twc = h.clone().requires_grad_(), th.clone().requires_grad_(), tw.clone().requires_grad_()
    chunked_reverse_kl(hc, w, TeacherHidden(thc, twc), mask, token_chunk=TC, vocab_chunk=VC).backward()
    assert hc.grad is not None and thc.grad is None and twc.grad is None


def test_teacher_minus_inf_where_student_has_zero_probability():
    # A teacher that masks a vocab entry with -inf, which the student also gives probability 0
    # (exp(-1e4) underflows in fp64): finite KL and gradients, equal to the reference.
    h, w, _, _, mask = _case(torch.float64, seed=3)
    h[:, 0], w[0] = 1.0, 0.0
    w[0, 0] = -1e4
    lp = torch.log_softmax(torch.randn(N, V, dtype=torch.float64, generator=torch.Generator().manual_seed(4)),
                           -1)
    lp[:, 0] = float("-inf")
    lp = torch.log_softmax(lp, -1)
    hc, wc = h.clone().requires_grad_(), w.clone().requires_grad_()
    got = chunked_reverse_kl(hc, wc, TeacherLogprobs(lp), mask, token_chunk=TC, vocab_chunk=VC)
    got.backward()
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    want = reverse_kl_reference(hr @ wr.T, lp, mask)
    want.backward()
    assert torch.isfinite(got) and torch.isfinite(hc.grad).all() and torch.isfinite(wc.grad).all()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(hc.grad, hr.grad, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(wc.grad, wr.grad, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", ["logprobs", "hidden"])
def test_gradcheck(kind):
    h, w, th, tw, mask = _case(torch.float64, seed=5, n=5, v=11, d=3, dt=4)
    teacher = _teacher(kind, th, tw, 0.9)
    fn = lambda h_, w_: chunked_reverse_kl(h_, w_, teacher, mask, token_chunk=2, vocab_chunk=4)
    assert torch.autograd.gradcheck(fn, (h.requires_grad_(), w.requires_grad_()))


class _LargestAllocation(TorchDispatchMode):
    """Largest numel of any tensor an op creates (outputs that alias an input, i.e. views and
    in-place results, allocate nothing and are skipped)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("kind", ["logprobs", "hidden"])
def test_never_allocates_tokens_by_vocab(kind):
    n, v, d, dt, tc, vc = 64, 2048, 8, 12, 8, 128  # N*V = 131072; chunk 1024; heads <= 24576
    h, w, th, tw, mask = _case(torch.float32, seed=6, n=n, v=v, d=d, dt=dt)
    teacher = _teacher(kind, th, tw)
    hc, wc = h.clone().requires_grad_(), w.clone().requires_grad_()
    with _LargestAllocation() as mode:
        chunked_reverse_kl(hc, wc, teacher, mask, token_chunk=tc, vocab_chunk=vc).backward()
    assert hc.grad is not None and wc.grad is not None
    assert mode.largest <= max(tc * vc, v * max(d, dt), n * d) < n * v // 4
    # The probe does see [N, V] allocations: the reference makes them.
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    with _LargestAllocation() as ref_mode:
        reverse_kl_reference(hr @ wr.T,
                             teacher.logprobs if kind == "logprobs" else torch.log_softmax(th @ tw.T, -1),
                             mask).backward()
    assert ref_mode.largest >= int(mask.sum()) * v


def test_bytes_per_token():
    b = bytes_per_token(129_280, 4096, 2)
    assert b["logprobs"] == 258_560 and b["hidden"] == 8192 and b["head_once"] == 129_280 * 4096 * 2
    assert b["ratio"] == pytest.approx(258_560 / 8192)
    assert b["break_even_tokens"] == pytest.approx(b["head_once"] / (258_560 - 8192))


def test_rejects_bad_inputs():
    h, w, th, tw, mask = _case(torch.float64)
    with pytest.raises(ValueError):
        chunked_reverse_kl(h, w, TeacherHidden(th, tw), mask, token_chunk=0)
    with pytest.raises(ValueError):
        chunked_reverse_kl(h, w, TeacherLogprobs(torch.zeros(N, V + 1, dtype=h.dtype)), mask)
    with pytest.raises(ValueError):
        chunked_reverse_kl(h, w[:, :-1], TeacherHidden(th, tw), mask)
    with pytest.raises(TypeError):
        chunked_reverse_kl(h, w, th, mask)
