"""Fused mHC step kernel (model/kernels/mhc.py) against the plain-PyTorch reference chain.

The reference composes, as Block.forward does around a sub-layer boundary:
    h_new = update_streams(h, y, post, comb)
    post2, comb2, next_pre = next_hc(h_new)       # its RMS norm + linear gives `mix`
    x = mix_streams(pre, h_new)
The fused step returns (h_new, x, mix); hc_coefficients(next_hc, mix) finishes the
HyperConnection. `reference_mhc_step` is that composition up to `mix`; the chain test uses
the real HyperConnection module. CPU runs use Triton's interpreter, in fp32 plus one small
bf16 check of the split-bf16 logit path; the model-size bf16 tests need a GPU.
"""

import pytest
import torch

from model.kernels.mhc import (
    MHCKernelConfig,
    fused_mhc_mix,
    fused_mhc_step,
    hc_coefficients,
    reference_mhc_mix,
    reference_mhc_step,
)
from model.mhc import HyperConnection, mix_streams, sinkhorn_comb, update_streams

DEV = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
# the model's RMSNorm eps, which the HyperConnection's normalisation (and so the fused step) uses;
# far from hc_eps (EPS), so passing the wrong one to the kernel would show at the tolerances below
NORM_EPS = 0.1
# default D blocks; small blocks so D=64 spans several D blocks, forward splits and backward
# token groups (T=37 with 16-token tiles also leaves a partial tile); and the defaults, where fp32
# streams run the backward on other tiles than the forward (16 tokens x 64 columns vs 32 x 32)
CONFIGS = [MHCKernelConfig(block_t=16),
           MHCKernelConfig(block_t=16, fwd_block_d=16, bwd_block_d=16, fwd_splits=3, bwd_groups=2),
           MHCKernelConfig()]


def make_inputs(lead=(1, 37), n=4, dim=64, dtype=torch.float32, seed=0, device=DEV):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g)
    h = rnd(*lead, n, dim).to(device, dtype)
    y = rnd(*lead, dim).to(device, dtype)
    post = (2 * torch.sigmoid(rnd(*lead, n))).to(device)
    comb = sinkhorn_comb(rnd(*lead, n, n), 20, EPS).to(device)
    pre = torch.sigmoid(rnd(*lead, n)).to(device)
    fn = (rnd(2 * n + n * n, n * dim) / (n * dim) ** 0.5).to(device)  # O(1) logits
    return [t.requires_grad_() for t in (h, y, post, comb, pre, fn)]


def grads(outputs, inputs, cotangents):
    gs = torch.autograd.grad(outputs, inputs, cotangents, allow_unused=True)
    return [torch.zeros_like(i) if g is None else g for g, i in zip(gs, inputs)]


NAMES = ["h", "y", "post", "comb", "pre", "fn"]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["tiles16", "split", "defaults"])
def test_forward_and_gradients_match_reference(cfg):
    inputs = make_inputs()
    fused = fused_mhc_step(*inputs, EPS, config=cfg)
    ref = reference_mhc_step(*inputs, EPS)
    for name, a, b in zip(["h_new", "x", "mix"], fused, ref):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    g = torch.Generator().manual_seed(1)
    cot = [torch.randn(o.shape, generator=g).to(DEV) for o in ref]
    for name, a, b in zip(NAMES, grads(fused, inputs, cot), grads(ref, inputs, cot)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"grad {name}")


@pytest.mark.parametrize("used", [(1,), (2,), (0, 2)], ids=["x_only", "mix_only", "h_and_mix"])
def test_unused_outputs_get_no_gradient_traffic(used):
    """Outputs that do not reach the loss come back as None cotangents (skipped loads)."""
    inputs = make_inputs(seed=2)
    cfg = CONFIGS[1]
    fused = fused_mhc_step(*inputs, EPS, config=cfg)
    ref = reference_mhc_step(*inputs, EPS)
    g = torch.Generator().manual_seed(3)
    cot = [torch.randn(ref[i].shape, generator=g).to(DEV) for i in used]
    a = grads([fused[i] for i in used], inputs, cot)
    b = grads([ref[i] for i in used], inputs, cot)
    for name, ga, gb in zip(NAMES, a, b):
        torch.testing.assert_close(ga, gb, rtol=1e-4, atol=1e-4, msg=f"grad {name}")


def test_other_stream_counts_and_ragged_dim():
    """n=3 (padded stream and logit axes) and D=40 (a partial D block)."""
    inputs = make_inputs(lead=(2, 9), n=3, dim=40, seed=4)
    cfg = MHCKernelConfig(block_t=16, fwd_block_d=16, bwd_block_d=16, fwd_splits=2, bwd_groups=1)
    fused = fused_mhc_step(*inputs, EPS, config=cfg)
    ref = reference_mhc_step(*inputs, EPS)
    for a, b in zip(fused, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    cot = [torch.randn_like(o) for o in ref]
    for name, a, b in zip(NAMES, grads(fused, inputs, cot), grads(ref, inputs, cot)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"grad {name}")


def test_chain_matches_block_composition():
    """The sub-layer boundary of Block.forward, end to end: the fused step + hc_coefficients
    give the same h', next input, next (post, comb, pre) and gradients (including the next
    HyperConnection's fn, base and scale) as update_streams -> next_hc -> mix_streams."""
    torch.manual_seed(5)
    n, dim = 4, 64
    hc = HyperConnection(dim, n, sinkhorn_iters=20, eps=EPS, norm_eps=NORM_EPS).to(DEV)
    torch.nn.init.normal_(hc.fn, std=1.0 / (n * dim) ** 0.5)
    with torch.no_grad():
        hc.base.normal_(std=0.5)
        hc.scale.copy_(torch.tensor([0.9, 1.1, 1.3]))
    h, y, post, comb, pre, _ = make_inputs(n=n, dim=dim, seed=6)
    leaves = [h, y, post, comb, pre, hc.fn, hc.base, hc.scale]

    h_ref = update_streams(h, y, post, comb)
    ref = (h_ref, mix_streams(pre, h_ref), *hc(h_ref))
    h_new, x, mix = fused_mhc_step(h, y, post, comb, pre, hc.fn, hc.norm_eps, config=CONFIGS[1])
    fused = (h_new, x, *hc_coefficients(hc, mix))
    for name, a, b in zip(["h_new", "x", "post", "comb", "next_pre"], fused, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    g = torch.Generator().manual_seed(7)
    cot = [torch.randn(o.shape, generator=g).to(DEV) for o in ref]
    for name, a, b in zip(NAMES[:5] + ["fn", "base", "scale"], grads(fused, leaves, cot),
                          grads(ref, leaves, cot)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"grad {name}")


@pytest.mark.parametrize("used", [(0, 1), (0,), (1,)], ids=["x_and_mix", "x_only", "mix_only"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=["tiles16", "split", "defaults"])
def test_mix_without_update_matches_reference(cfg, used):
    """`fused_mhc_mix` (the boundaries with no update before them): x and the logits from h, and
    the gradients of h, pre and fn, as mix_streams + the RMS norm + linear give them."""
    h, _, _, _, pre, fn = make_inputs(seed=20)
    fused = fused_mhc_mix(h, pre, fn, EPS, config=cfg)
    ref = reference_mhc_mix(h, pre, fn, EPS)
    for name, a, b in zip(["x", "mix"], fused, ref):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    g = torch.Generator().manual_seed(21)
    cot = [torch.randn(ref[i].shape, generator=g).to(DEV) for i in used]
    a = grads([fused[i] for i in used], [h, pre, fn], cot)
    b = grads([ref[i] for i in used], [h, pre, fn], cot)
    for name, ga, gb in zip(["h", "pre", "fn"], a, b):
        torch.testing.assert_close(ga, gb, rtol=1e-4, atol=1e-4, msg=f"grad {name}")


def test_mix_without_update_ragged_and_first_sub_layer():
    """n = 3, D = 40 (partial D blocks), and the first sub-layer's one-hot pre, where x is
    stream 0 itself; the HyperConnection's coefficients from the fused logits match hc(h)."""
    h, _, _, _, pre, _ = make_inputs(lead=(2, 9), n=3, dim=40, seed=22)
    hc = HyperConnection(40, 3, sinkhorn_iters=20, eps=EPS, norm_eps=NORM_EPS).to(DEV)
    torch.nn.init.normal_(hc.fn, std=1.0 / 120 ** 0.5)
    cfg = MHCKernelConfig(block_t=16, fwd_block_d=16, bwd_block_d=16, fwd_splits=2, bwd_groups=1)
    one_hot = torch.zeros_like(pre.detach())
    one_hot[..., 0] = 1.0
    x, mix = fused_mhc_mix(h, one_hot, hc.fn, hc.norm_eps, config=cfg)
    torch.testing.assert_close(x, h[..., 0, :], rtol=0, atol=0)
    fused = (x, *hc_coefficients(hc, mix))
    ref = (mix_streams(one_hot, h), *hc(h))
    for name, a, b in zip(["x", "post", "comb", "next_pre"], fused, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    cot = [torch.randn_like(o) for o in ref]
    for name, a, b in zip(["h", "fn", "base", "scale"], grads(fused, [h, hc.fn, hc.base, hc.scale], cot),
                          grads(ref, [h, hc.fn, hc.base, hc.scale], cot)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"grad {name}")


def test_mix_without_update_bf16_split_logits():
    """bf16 streams: the logits and the fn gradient take the split-bf16 path as in the fused
    step, so they match fp32 math on the same streams to ~fp32 accuracy."""
    h, _, _, _, pre, fn = make_inputs(dtype=torch.bfloat16, seed=23)
    x, mix = fused_mhc_mix(h, pre, fn, EPS, config=CONFIGS[1])
    assert x.dtype == torch.bfloat16 and mix.dtype == torch.float32
    assert rel_err(mix, rms_linear(h.detach(), fn.detach())) < 2e-5
    g_mix = torch.randn(mix.shape, generator=torch.Generator().manual_seed(24)).to(DEV)
    (g_fn,) = torch.autograd.grad(mix, [fn], g_mix)
    fn_leaf = fn.detach().clone().requires_grad_()
    (g_ref,) = torch.autograd.grad(rms_linear(h.detach(), fn_leaf), [fn_leaf], g_mix)
    assert rel_err(g_fn, g_ref) < 2e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def rms_linear(h_new: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
    """HyperConnection's logits of given streams, in fp32 (its forward up to `mix`)."""
    flat = h_new.float().flatten(-2)
    return (flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + EPS)) @ fn.T


def test_bf16_streams_split_logits():
    """bf16 streams take the GPU path: h' is exact in bf16, so the logits and the fn gradient
    use bf16 hi/lo halves of fn and g_dot (two bf16 MMAs, fp32 accumulation), the fn gradient
    as a host GEMM over the saved h' (on the CPU an fp32 matmul).
    Both must match fp32 math on the same rounded h' to ~fp32 accuracy, not bf16's 4e-3. (Under
    the interpreter, which truncates fp32 -> bf16 where GPUs round to nearest, h' and x are
    compared at bf16 tolerance only.)"""
    inputs = make_inputs(dtype=torch.bfloat16, seed=10)
    h_new, x, mix = fused_mhc_step(*inputs, EPS, config=CONFIGS[1])
    fn = inputs[5]
    assert h_new.dtype == x.dtype == torch.bfloat16 and mix.dtype == torch.float32
    assert rel_err(mix, rms_linear(h_new.detach(), fn.detach())) < 2e-5
    assert rel_err(x, (inputs[4].detach()[..., None] * h_new.detach().float()).sum(-2)) < 1e-2
    truth = reference_mhc_step(*[t.detach().float() for t in inputs], EPS)
    assert rel_err(h_new, truth[0]) < 1e-2
    # fn gradient through mix only: g_dot^T @ h' with the same h'
    g_mix = torch.randn(mix.shape, generator=torch.Generator().manual_seed(11)).to(DEV)
    (g_fn,) = torch.autograd.grad(mix, [fn], g_mix)
    fn_leaf = fn.detach().clone().requires_grad_()
    (g_ref,) = torch.autograd.grad(rms_linear(h_new.detach(), fn_leaf), [fn_leaf], g_mix)
    assert rel_err(g_fn, g_ref) < 2e-5


def test_autocast_bf16_output_and_input():
    """Under bf16 autocast with fp32 streams (training with the kernels): the sub-layer output y
    goes in bf16 as it is and its gradient comes back bf16 from the kernel, and x comes out bf16,
    as the reference's mix_streams einsum gives it under autocast. Values and gradients match the
    fp32 reference of the same inputs up to the rounding of x and of y's gradient to bf16."""
    inputs = make_inputs(seed=12)
    inputs[1] = inputs[1].detach().to(torch.bfloat16).requires_grad_()
    with torch.autocast(DEV, dtype=torch.bfloat16):
        fused = fused_mhc_step(*inputs, EPS, config=CONFIGS[1])
    assert [o.dtype for o in fused] == [torch.float32, torch.bfloat16, torch.float32]
    wide = [t.detach().float().requires_grad_() for t in inputs]
    ref = reference_mhc_step(*wide, EPS)
    for name, a, b, tol in zip(["h_new", "x", "mix"], fused, ref, [1e-6, 1e-2, 1e-5]):
        assert rel_err(a, b) < tol, (name, rel_err(a, b))
    g = torch.Generator().manual_seed(13)
    cot = [torch.randn(o.shape, generator=g).to(DEV, o.dtype) for o in fused]
    got, want = grads(fused, inputs, cot), grads(ref, wide, [c.float() for c in cot])
    assert got[1].dtype == torch.bfloat16
    for name, a, b in zip(NAMES, got, want):
        assert rel_err(a, b) < (1e-2 if name == "y" else 1e-5), (name, rel_err(a, b))


def test_forward_token_tile_for_narrow_io():
    """fp32 streams with a bf16 y or x take 16-token forward tiles (the 32-token tile spills on
    sm_90); same-width y and x, and an explicit fwd_block_t, keep theirs. Values match either way."""
    cfg = MHCKernelConfig()
    assert cfg.resolved(torch.float32, narrow_io=True).fwd_block_t == 16
    assert cfg.resolved(torch.float32).fwd_block_t == cfg.block_t == 32
    assert cfg.resolved(torch.bfloat16, narrow_io=False).fwd_block_t == 64  # bf16 streams: timed
    assert MHCKernelConfig(fwd_block_t=64).resolved(torch.float32, narrow_io=True).fwd_block_t == 64
    inputs = make_inputs(seed=14)
    inputs[1] = inputs[1].detach().to(torch.bfloat16)
    with torch.autocast(DEV, dtype=torch.bfloat16):
        a = fused_mhc_step(*inputs, EPS, config=CONFIGS[2])  # resolves to 16-token tiles
        b = fused_mhc_step(*inputs, EPS, config=MHCKernelConfig(fwd_block_t=32))
    for u, v in zip(a, b):
        torch.testing.assert_close(u, v, atol=1e-6, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [1024, 4096])
def test_bf16_streams_on_gpu(dim):
    """bf16 h/y, fp32 coefficients, default tiles: fused vs the fp32 reference of the same
    inputs is within bf16 rounding, and no further from it than the eager bf16 reference; the fn
    gradient matches fp32 math on the same h' to ~fp32 accuracy."""
    inputs = make_inputs(lead=(2, 333), dim=dim, dtype=torch.bfloat16, seed=8, device="cuda")
    fused = fused_mhc_step(*inputs, EPS)
    eager = reference_mhc_step(*inputs, EPS)
    wide = [t.detach().float().requires_grad_() for t in inputs]
    truth = reference_mhc_step(*wide, EPS)
    for name, a, e, b in zip(["h_new", "x", "mix"], fused, eager, truth):
        assert a.dtype == e.dtype, name
        assert rel_err(a, b) < max(1e-2, 2 * rel_err(e, b)), name
    assert rel_err(fused[2], rms_linear(fused[0].detach(), inputs[5].detach())) < 2e-5  # split-bf16 logits
    g = torch.Generator().manual_seed(9)
    cot = [torch.randn(o.shape, generator=g).to("cuda", o.dtype) for o in eager]
    cot_wide = [c.float() for c in cot]
    for name, a, e, b in zip(NAMES, grads(fused, inputs, cot), grads(eager, inputs, cot),
                             grads(truth, wide, cot_wide)):
        assert rel_err(a, b) < max(2e-2, 2 * rel_err(e, b)), f"grad {name}: {rel_err(a, b)}"
    h_new, _, mix = fused_mhc_step(*inputs, EPS)
    (g_fn,) = torch.autograd.grad(mix, [inputs[5]], cot[2])
    fn_leaf = inputs[5].detach().clone().requires_grad_()
    (g_ref,) = torch.autograd.grad(rms_linear(h_new.detach(), fn_leaf), [fn_leaf], cot[2])
    assert rel_err(g_fn, g_ref) < 2e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [1024, 4096])
def test_fp32_streams_under_autocast_on_gpu(dim):
    """Training's case: fp32 streams, bf16 y, bf16 autocast, default tiles (the logits a 3-pass
    tf32 dot, the fn gradient a host fp32 matmul). Every output and gradient matches an fp64
    reference of the same inputs to ~fp32 accuracy (x and y's gradient to bf16 rounding)."""
    inputs = make_inputs(lead=(2, 333), dim=dim, seed=15, device="cuda")
    inputs[1] = inputs[1].detach().to(torch.bfloat16).requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        fused = fused_mhc_step(*inputs, EPS)
    wide = [t.detach().double().requires_grad_() for t in inputs]
    truth = reference_mhc_step(*wide, EPS)
    for name, a, b, tol in zip(["h_new", "x", "mix"], fused, truth, [1e-6, 1e-2, 1e-5]):
        assert rel_err(a, b) < tol, (name, rel_err(a, b))
    g = torch.Generator().manual_seed(16)
    cot = [torch.randn(o.shape, generator=g).to("cuda", o.dtype) for o in fused]
    for name, a, b in zip(NAMES, grads(fused, inputs, cot), grads(truth, wide, [c.double() for c in cot])):
        assert rel_err(a, b) < (1e-2 if name == "y" else 1e-5), f"grad {name}: {rel_err(a, b)}"


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [1024, 4096])
def test_mix_without_update_bf16_on_gpu(dim):
    """`fused_mhc_mix` at default tiles, bf16 streams under bf16 autocast (training's first
    sub-layer and post-Engram boundaries): x, mix and the gradients of h, pre and fn within bf16
    rounding of an fp64 reference of the same inputs, the logits to ~fp32 accuracy."""
    h, _, _, _, pre, fn = make_inputs(lead=(2, 333), dim=dim, dtype=torch.bfloat16, seed=25, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        fused = fused_mhc_mix(h, pre, fn, EPS)
    wide = [t.detach().double().requires_grad_() for t in (h, pre, fn)]
    truth = reference_mhc_mix(*wide, EPS)
    assert fused[0].dtype == torch.bfloat16
    for name, a, b, tol in zip(["x", "mix"], fused, truth, [1e-2, 2e-5]):
        assert rel_err(a, b) < tol, (name, rel_err(a, b))
    g = torch.Generator().manual_seed(26)
    cot = [torch.randn(o.shape, generator=g).to("cuda", o.dtype) for o in fused]
    for name, a, b in zip(["h", "pre", "fn"], grads(fused, [h, pre, fn], cot),
                          grads(truth, wide, [c.double() for c in cot])):
        assert rel_err(a, b) < 1e-2, f"grad {name}: {rel_err(a, b)}"
