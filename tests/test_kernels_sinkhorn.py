"""Sinkhorn kernel (model/kernels/sinkhorn.py) against the plain-PyTorch `sinkhorn_comb`, and
all three Sinkhorns against a hand-written golden of DeepSeek's definition.

CPU runs use Triton's interpreter in fp32 (plus fp64 for gradcheck); small token tiles make
a token count that is not a multiple of the tile. The large-token fp32 check needs a GPU.
"""
import math

import pytest
import torch

from model.kernels.sinkhorn import sinkhorn_comb_triton
from model.mhc import HyperConnection, sinkhorn_comb, sinkhorn_comb_explicit

DEV = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


def logits_of(shape, scale=1.0, seed=0, dtype=torch.float32, device=DEV):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(device, dtype).requires_grad_()


def forward_and_grad(fn, x, iters, cot):
    out = fn(x, iters, EPS)
    (g,) = torch.autograd.grad(out, [x], cot)
    return out, g


@pytest.mark.parametrize("iters", [1, 2, 20])
@pytest.mark.parametrize("block_t", [16, None], ids=["tile16", "default"])
@pytest.mark.parametrize("scale", [1.0, 3.0], ids=["mhc", "sharp"])
def test_forward_and_gradient_match_reference(iters, block_t, scale):
    """[2, 37, 4, 4]: 74 tokens, a partial last tile of 16."""
    x = logits_of((2, 37, 4, 4), scale=scale)
    cot = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(DEV)
    out, g = forward_and_grad(lambda *a: sinkhorn_comb_triton(*a, block_t=block_t), x, iters, cot)
    ref, g_ref = forward_and_grad(sinkhorn_comb, x, iters, cot)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [1, 3, 8])
def test_other_stream_counts(n):
    x = logits_of((5, 7, n, n), seed=2)
    cot = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).to(DEV)
    out, g = forward_and_grad(lambda *a: sinkhorn_comb_triton(*a, block_t=16), x, 20, cot)
    ref, g_ref = forward_and_grad(sinkhorn_comb, x, 20, cot)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-5)


def test_iters_zero_is_one_round_and_empty_input():
    """range(iters - 1) is empty for iters <= 1: the reference does the first round only."""
    x = logits_of((3, 4, 4), seed=4)
    torch.testing.assert_close(sinkhorn_comb_triton(x, 0, EPS), sinkhorn_comb(x, 0, EPS), rtol=1e-6,
                               atol=1e-6)
    empty = torch.zeros(0, 4, 4, device=DEV, requires_grad=True)
    out = sinkhorn_comb_triton(empty, 20, EPS)
    assert out.shape == (0, 4, 4)
    out.sum().backward()
    assert empty.grad.shape == (0, 4, 4)


def test_gradcheck_fp64():
    """fp64 inputs compute in fp64: the analytical backward against finite differences (every
    Jacobian entry for a short run; 20 rounds in fast mode, a random projection: the
    interpreter spends ~0.3 s a forward)."""
    small = logits_of((2, 4, 4), seed=5, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda t: sinkhorn_comb_triton(t, 2, EPS), (small,))
    x = logits_of((2, 5, 4, 4), seed=5, dtype=torch.float64)
    for iters in (1, 20):
        assert torch.autograd.gradcheck(lambda t, iters=iters: sinkhorn_comb_triton(t, iters, EPS, block_t=8),
                                        (x,), fast_mode=True)
    # and against the fp64 reference
    cot = torch.randn(x.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64).to(DEV)
    out, g = forward_and_grad(sinkhorn_comb_triton, x, 20, cot)
    ref, g_ref = forward_and_grad(sinkhorn_comb, x, 20, cot)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-10)


def test_low_precision_input_computes_in_fp32():
    """bf16 logits: fp32 math, one rounding of the result (and of the gradient) to bf16."""
    x = logits_of((2, 9, 4, 4), seed=7, dtype=torch.bfloat16)
    out = sinkhorn_comb_triton(x, 20, EPS)
    assert out.dtype == torch.bfloat16
    truth = sinkhorn_comb(x.detach().float(), 20, EPS)
    torch.testing.assert_close(out.float(), truth, rtol=4e-3, atol=1e-6)  # bf16 rounding only
    out.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16


# hand-picked logits (one token, and a second with sharper rows) and an eps large enough to matter
GOLDEN_LOGITS = [[[0.5, -1.0, 2.0, 0.0], [1.5, 0.25, -0.5, 1.0], [-2.0, 0.0, 0.75, -0.25],
                  [0.0, 3.0, -1.5, 0.5]],
                 [[4.0, -4.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [-3.0, 2.0, 2.5, -1.0], [1.0, -2.0, 0.5, 3.5]]]
GOLDEN_EPS = 1e-2


def golden_sinkhorn(logits, iters, eps, eps_in_sums=True):
    """DeepSeek's definition in plain Python floats: row softmax + eps, divide each column by its
    sum + eps, then iters - 1 times rows by their sum + eps and columns by theirs + eps.
    eps_in_sums=False divides by the plain sums (to show the eps there is visible)."""
    n = len(logits)
    d = eps if eps_in_sums else 0.0
    c = []
    for row in logits:
        e = [math.exp(v - max(row)) for v in row]
        c.append([v / sum(e) + eps for v in e])

    def cols():
        s = [sum(c[i][j] for i in range(n)) + d for j in range(n)]
        return [[c[i][j] / s[j] for j in range(n)] for i in range(n)]

    c = cols()
    for _ in range(iters - 1):
        c = [[v / (sum(row) + d) for v in row] for row in c]
        c = cols()
    return c


def definition_sinkhorn(logits, iters, eps):
    """The same definition in torch ops (differentiable), for reference gradients."""
    c = logits.softmax(-1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c


@pytest.mark.parametrize("iters", [1, 3, 20])
def test_all_sinkhorns_match_the_hand_written_golden(iters):
    """sinkhorn_comb, its explicit-backward twin and the Triton kernel against the golden; the
    golden without eps in the sums differs by far more than the tolerance."""
    want = torch.tensor([golden_sinkhorn(m, iters, GOLDEN_EPS) for m in GOLDEN_LOGITS], dtype=torch.float64)
    plain = torch.tensor([golden_sinkhorn(m, iters, GOLDEN_EPS, eps_in_sums=False) for m in GOLDEN_LOGITS],
                         dtype=torch.float64)
    assert (want - plain).abs().max() > 1e-3
    x64 = torch.tensor(GOLDEN_LOGITS, dtype=torch.float64)
    for fn in (sinkhorn_comb, sinkhorn_comb_explicit):
        torch.testing.assert_close(fn(x64, iters, GOLDEN_EPS), want, rtol=1e-13, atol=1e-13)
    x32 = x64.float().to(DEV)
    for fn in (sinkhorn_comb, sinkhorn_comb_explicit, sinkhorn_comb_triton):
        torch.testing.assert_close(fn(x32, iters, GOLDEN_EPS).double().cpu(), want, rtol=2e-6, atol=2e-7)
    # fp64 in the kernel: its eps arrives as an fp32 scalar (1e-2 to ~2e-10), hence the looser bound
    torch.testing.assert_close(sinkhorn_comb_triton(x64.to(DEV), iters, GOLDEN_EPS).cpu(), want,
                               rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("iters", [1, 3, 20])
def test_all_sinkhorn_gradients_match_the_definition(iters):
    """Backward with eps = 1e-2 in every divisor: the explicit and the Triton backward against
    autograd through the definition, fp64, and finite differences (gradcheck)."""
    x = torch.tensor(GOLDEN_LOGITS, dtype=torch.float64, requires_grad=True)
    cot = torch.randn(x.shape, generator=torch.Generator().manual_seed(13), dtype=torch.float64)
    (want,) = torch.autograd.grad(definition_sinkhorn(x, iters, GOLDEN_EPS), [x], cot)
    (got,) = torch.autograd.grad(sinkhorn_comb_explicit(x, iters, GOLDEN_EPS), [x], cot)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)
    assert torch.autograd.gradcheck(lambda t: sinkhorn_comb_explicit(t, iters, GOLDEN_EPS), (x,))
    xd = x.detach().to(DEV).requires_grad_()
    (got,) = torch.autograd.grad(sinkhorn_comb_triton(xd, iters, GOLDEN_EPS), [xd], cot.to(DEV))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-7, atol=1e-8)  # fp32 eps, as above
    # fast mode (a random projection of the Jacobian): the interpreter spends ~0.3 s a forward
    assert torch.autograd.gradcheck(lambda t: sinkhorn_comb_triton(t, iters, GOLDEN_EPS), (xd,),
                                    fast_mode=True)
    x32 = x.detach().float().to(DEV).requires_grad_()
    (got,) = torch.autograd.grad(sinkhorn_comb_triton(x32, iters, GOLDEN_EPS), [x32], cot.float().to(DEV))
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-5, atol=1e-6)


def test_hyper_connection_with_the_kernel():
    """HyperConnection.coefficients through the `sinkhorn` hook Block sets when kernels are on."""
    torch.manual_seed(8)
    ref = HyperConnection(dim=8, n_streams=4, sinkhorn_iters=20, eps=EPS, norm_eps=1e-3).to(DEV)
    ref.reset_parameters()
    torch.nn.init.normal_(ref.fn, std=0.2)
    ker = HyperConnection(dim=8, n_streams=4, sinkhorn_iters=20, eps=EPS, norm_eps=1e-3).to(DEV)
    ker.load_state_dict(ref.state_dict())
    ref.sinkhorn = sinkhorn_comb  # the definition (the default is its explicit-backward twin)
    ker.sinkhorn = sinkhorn_comb_triton
    h = torch.randn(2, 11, 4, 8, device=DEV)
    outs = [m(h) for m in (ref, ker)]
    for a, b in zip(outs[1], outs[0]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    cot = [torch.randn_like(o) for o in outs[0]]
    grads = [torch.autograd.grad(o, [m.fn, m.base, m.scale], cot) for o, m in zip(outs, (ref, ker))]
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("scale", [0.5, 3.0])
def test_fp32_on_gpu(scale):
    """2 x 8192 tokens (and a ragged count) with the default tiles, fp32, as the model runs."""
    for shape in [(2, 8192, 4, 4), (3, 1001, 4, 4)]:
        x = logits_of(shape, scale=scale, seed=9, device="cuda")
        cot = torch.randn(x.shape, generator=torch.Generator().manual_seed(10)).cuda()
        out, g = forward_and_grad(sinkhorn_comb_triton, x, 20, cot)
        ref, g_ref = forward_and_grad(sinkhorn_comb, x, 20, cot)
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-5)
        # against fp64 truth, the kernel is as close as the eager fp32 reference
        x64 = x.detach().double().requires_grad_()
        truth, g_truth = forward_and_grad(sinkhorn_comb, x64, 20, cot.double())
        assert (out.double() - truth).abs().max() <= 2 * (ref.double() - truth).abs().max() + 1e-7
        assert (g.double() - g_truth).abs().max() <= 2 * (g_ref.double() - g_truth).abs().max() + 1e-6


@pytest.mark.gpu
def test_decode_shape_and_bf16_on_gpu():
    """One token (a decode step), and bf16 logits (fp32 math inside)."""
    x = logits_of((1, 1, 4, 4), seed=11, device="cuda")
    torch.testing.assert_close(sinkhorn_comb_triton(x, 20, EPS), sinkhorn_comb(x, 20, EPS), rtol=1e-6,
                               atol=1e-6)
    xb = logits_of((2, 333, 4, 4), seed=12, dtype=torch.bfloat16, device="cuda")
    out = sinkhorn_comb_triton(xb, 20, EPS)
    truth = sinkhorn_comb(xb.detach().float(), 20, EPS)
    assert out.dtype == torch.bfloat16
    assert (out.float() - truth).abs().max() <= 4e-3
