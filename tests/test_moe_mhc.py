"""MoE routing and mHC reference tests."""
import math

import pytest
import torch

from model.mhc import (
    HyperConnection,
    initial_pre,
    mix_streams,
    sinkhorn_comb,
    sinkhorn_comb_explicit,
    update_streams,
)
from model.moe import MoE, RoutedExperts, Router, clamped_swiglu, expert_counts


# ---------------------------------------------------------------- MoE
def test_router_respects_topk_and_scores():
    torch.manual_seed(0)
    r = Router(dim=16, n_experts=8, topk=3, route_scale=2.0)
    torch.nn.init.normal_(r.weight)
    x = torch.randn(50, 16)
    scores, chosen, weights = r(x)
    expected = torch.sqrt(torch.nn.functional.softplus(x @ r.weight.T))
    torch.testing.assert_close(scores, expected)
    assert chosen.shape == (50, 3)
    assert all(len(set(row)) == 3 for row in chosen.tolist())  # k distinct experts
    # without bias the chosen experts are the k highest scores
    assert torch.equal(chosen.sort(-1).values, scores.topk(3, -1).indices.sort(-1).values)
    torch.testing.assert_close(weights.sum(-1), torch.full((50,), 2.0))  # normalised x route scale


def test_router_logits_stay_fp32_under_autocast():
    """Under bf16 autocast the router still ranks fp32 logits of its input: autocast must not
    round the widened input and weight back to bf16 for the linear."""
    torch.manual_seed(4)
    r = Router(dim=64, n_experts=16, topk=4, route_scale=1.0)
    torch.nn.init.normal_(r.weight)
    x = torch.randn(200, 64).to(torch.bfloat16)  # a bf16 activation, as a norm gives it under autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scores, chosen, _ = r(x)
    fp32 = torch.sqrt(torch.nn.functional.softplus(x.double() @ r.weight.double().T))
    assert scores.dtype == torch.float32
    torch.testing.assert_close(scores.double(), fp32, rtol=1e-5, atol=1e-6)  # bf16 logits: ~4e-3 off
    assert torch.equal(chosen.sort(-1).values, fp32.topk(4, -1).indices.sort(-1).values)


def test_bias_changes_selection_only():
    torch.manual_seed(1)
    r = Router(dim=16, n_experts=8, topk=2, route_scale=1.0)
    torch.nn.init.normal_(r.weight)
    x = torch.randn(40, 16)
    scores0, chosen0, _ = r(x)
    r.bias[5] = 100.0  # force expert 5 into every selection
    scores1, chosen1, weights1 = r(x)
    torch.testing.assert_close(scores0, scores1)  # affinities untouched
    assert (chosen1 == 5).any(-1).all()
    # weights are the unbiased scores of the chosen experts, normalised
    expected = scores1.gather(-1, chosen1)
    torch.testing.assert_close(weights1, expected / expected.sum(-1, keepdim=True))
    assert not r.bias.requires_grad and "bias" not in dict(r.named_parameters())


def test_expert_counts_and_router_load():
    """Counts per expert, unused experts included (0), as a per-id Python count gives them; the
    router's load accumulates them over forwards."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 6, (40, 3), generator=g)  # experts 6 and 7 never chosen
    want = [sum(int(i) == e for i in ids.flatten()) for e in range(8)]
    assert expert_counts(ids, 8).tolist() == want and expert_counts(ids, 8).dtype == torch.int64
    assert expert_counts(ids, 8, chunk=7).tolist() == want  # 7 ids a chunk: the last one short
    try:
        torch.use_deterministic_algorithms(True)
        assert expert_counts(ids, 8).tolist() == want
    finally:
        torch.use_deterministic_algorithms(False)
    r = Router(dim=16, n_experts=8, topk=3, route_scale=1.0)
    torch.nn.init.normal_(r.weight)
    x = torch.randn(40, 16, generator=g)
    chosen = r(x)[1]
    r(x)
    per_expert = [2 * sum(int(i) == e for i in chosen.flatten()) for e in range(8)]
    assert r.load.tolist() == per_expert and r.load.dtype == torch.float32


def test_one_expert_keeps_its_raw_score_times_the_route_scale():
    """As the public router: normalising one weight by itself would make every token's weight 1."""
    r = Router(dim=2, n_experts=3, topk=1, route_scale=1.5)
    with torch.no_grad():
        r.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]]))
    _, chosen, weights = r(torch.tensor([[2.0, 0.5]]))
    assert chosen.tolist() == [[0]]
    torch.testing.assert_close(weights, torch.tensor([[math.sqrt(math.log1p(math.exp(2.0))) * 1.5]]))


def test_bias_update_moves_towards_balance():
    r = Router(dim=4, n_experts=4, topk=1, route_scale=1.0)
    r.load.copy_(torch.tensor([10.0, 0.0, 5.0, 5.0]))
    r.update_bias(0.1)
    torch.testing.assert_close(r.bias, torch.tensor([-0.1, 0.1, 0.0, 0.0]))
    assert r.load.sum() == 0  # counters reset after the update


def test_moe_dispatch_equals_per_token_loop():
    torch.manual_seed(2)
    moe = MoE(dim=8, n_routed=6, n_shared=1, topk=2, inter_dim=12, route_scale=1.5, limit=10.0,
              seq_aux_alpha=0.0).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    y, _ = moe(x)
    flat = x.view(-1, 8)
    scores, chosen, weights = moe.router(flat)
    ref = moe.shared(flat)
    e = moe.experts
    for n in range(flat.shape[0]):
        for slot in range(2):
            i = chosen[n, slot]
            h = clamped_swiglu(e.w1[i] @ flat[n], e.w3[i] @ flat[n], 10.0)
            ref[n] += weights[n, slot] * (e.w2[i] @ h)
    torch.testing.assert_close(y.view(-1, 8), ref)


def test_moe_dispatch_gradient():
    """dispatch's gathers carry hand-written gradients (a gather back, not a scatter-add): gradcheck
    in x and the routing weights; every token takes 3 of the 4 experts (expert 3 stays idle)."""
    torch.manual_seed(3)
    moe = MoE(dim=6, n_routed=4, n_shared=0, topk=3, inter_dim=5, route_scale=1.0, limit=10.0,
              seq_aux_alpha=0.0).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    chosen = torch.tensor([[0, 1, 2], [2, 1, 0], [1, 2, 0], [0, 2, 1], [2, 0, 1]])
    weights = torch.rand(5, 3, dtype=torch.float64, requires_grad=True)
    w1 = moe.experts.w1
    assert torch.autograd.gradcheck(lambda a, b: moe.dispatch(a, chosen, b), (x, weights))
    out = moe.dispatch(x, chosen, weights)
    (g_w1,) = torch.autograd.grad(out.square().sum(), [w1])
    # the idle one gets nothing
    assert g_w1[3].abs().max() == 0 and (g_w1[:3].flatten(1).norm(dim=1) > 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_equal_the_per_expert_loop(dtype):
    """torch._grouped_mm over all experts (the fast path) against the loop of one matmul per
    expert: outputs and gradients, with an expert that gets no rows (fp32 on CPU; bf16 within
    bf16 rounding)."""
    torch.manual_seed(3)
    experts = RoutedExperts(n_experts=5, dim=32, inter_dim=48, limit=7.0)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.2)
    experts.to(dtype)
    counts = [7, 0, 12, 3, 10]
    x = torch.randn(sum(counts), 32, dtype=dtype)
    g = torch.randn(sum(counts), 32, dtype=dtype)
    got = {}
    for grouped, stacked in ((False, True), (True, True), (True, False)):
        experts.grouped, experts.stack_gate_up = grouped, stacked  # stacked: one GEMM by [w1 | w3]
        experts.zero_grad()
        xi = x.clone().requires_grad_()
        y = experts(xi, torch.tensor(counts))
        y.backward(g)
        got[grouped, stacked] = (y.float(), xi.grad.float(), *(p.grad.float() for p in experts.parameters()))
    tol = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for key in ((True, True), (True, False)):
        for a, b in zip(got[False, True], got[key]):
            torch.testing.assert_close(b, a, **tol)
        assert got[key][2][1].abs().max() == 0  # the empty expert's gate weights get no gradient


@pytest.mark.gpu
def test_grouped_experts_on_gpu_under_autocast():
    """The auto choice on an H200: fp32 master weights under bf16 autocast take the grouped path;
    against the fp32 loop, within bf16 rounding, values and gradients."""
    torch.manual_seed(4)
    experts = RoutedExperts(n_experts=16, dim=256, inter_dim=512, limit=7.0).cuda()
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.05)
    counts = torch.tensor([300, 0, 17, 1, 500, 64, 0, 9, 128, 77, 3, 200, 31, 0, 45, 250], device="cuda")
    x = torch.randn(int(counts.sum()), 256, device="cuda")
    g = torch.randn_like(x)
    got = {}
    for grouped in (False, None):
        experts.grouped = grouped
        experts.zero_grad()
        xi = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=grouped is None):
            assert experts.use_grouped(xi) == (grouped is None)
            y = experts(xi, counts)
        y.float().backward(g)
        got[grouped] = (y.float(), xi.grad, *(p.grad for p in experts.parameters()))
    for a, b in zip(got[False], got[None]):
        scale = a.abs().max()
        assert (b.float() - a).abs().max() <= 2e-2 * scale, ((b.float() - a).abs().max(), scale)


@pytest.mark.gpu
@pytest.mark.parametrize("stacked", [True, False])
def test_grouped_experts_with_weights_off_the_16_byte_boundary(stacked):
    """bf16 weights that are views into one flat buffer at an odd element offset (as DeepSpeed's bf16
    partitions place them): the grouped path runs and gives the loop's values and gradients."""
    torch.manual_seed(5)
    experts = RoutedExperts(n_experts=4, dim=64, inter_dim=96, limit=7.0).cuda().bfloat16()
    experts.stack_gate_up = stacked
    flat = torch.empty(1 + sum(p.numel() for p in experts.parameters()), dtype=torch.bfloat16, device="cuda")
    at = 1
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.05)
        view = flat[at:at + p.numel()].view_as(p)
        view.copy_(p.data)
        p.data = view
        at += p.numel()
    assert experts.w2.data_ptr() % 16 != 0
    counts = torch.tensor([40, 0, 7, 81], device="cuda")
    x = torch.randn(int(counts.sum()), 64, device="cuda", dtype=torch.bfloat16)
    got = {}
    for grouped in (False, True):
        experts.grouped = grouped
        experts.zero_grad()
        xi = x.clone().requires_grad_()
        y = experts(xi, counts)
        y.float().sum().backward()
        got[grouped] = (y.float(), xi.grad.float(), *(p.grad.float() for p in experts.parameters()))
    for a, b in zip(got[False], got[True]):
        torch.testing.assert_close(b, a, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_expert_counts_on_gpu_without_host_wait():
    """On CUDA the counts equal torch.bincount's, the unused experts included, and computing them
    does not make the host wait for the GPU (sync debug mode "error" raises if it does)."""
    g = torch.Generator(device="cuda").manual_seed(5)
    for n, m in ((32, 131072), (384, 196608)):
        ids = torch.randint(0, n - 3, (m,), device="cuda", generator=g)
        want = torch.bincount(ids, minlength=n)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = expert_counts(ids, n)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(got, want) and got[-3:].sum() == 0


def test_clamped_swiglu():
    gate = torch.tensor([20.0, -3.0, 1.0])
    up = torch.tensor([50.0, -40.0, 2.0])
    out = clamped_swiglu(gate, up, 10.0)
    silu = lambda v: v / (1 + torch.exp(-v))
    torch.testing.assert_close(out,
                               torch.stack([silu(torch.tensor(10.0)) * 10, silu(torch.tensor(-3.0)) * -10,
                                            silu(torch.tensor(1.0)) * 2]))


def test_sequence_balance_loss_formula():
    moe = MoE(dim=4, n_routed=4, n_shared=0, topk=1, inter_dim=4, route_scale=1.0, limit=0, seq_aux_alpha=0.5)
    scores = torch.tensor([[1.0, 1.0, 1.0, 1.0], [3.0, 1.0, 0.0, 0.0]])  # B=1, T=2
    chosen = torch.tensor([[0], [0]])
    # f_0 = 4/(1*2) * 2 = 4, others 0; P_0 = mean(1/4, 3/4) = 0.5 -> 0.5 * 4 * 0.5 = 1.0
    torch.testing.assert_close(moe.sequence_balance_loss(scores, chosen, 1, 2), torch.tensor(1.0))


# ---------------------------------------------------------------- mHC
def test_comb_is_doubly_stochastic():
    """20 rounds reach 1e-5 for logits of the size mHC produces (std <= ~0.7); much sharper
    logits converge more slowly (columns are exact after every round, rows lag)."""
    torch.manual_seed(3)
    logits = torch.randn(1000, 4, 4) * 0.5
    comb = sinkhorn_comb(logits, iters=20, eps=1e-6)
    torch.testing.assert_close(comb.sum(-1), torch.ones(1000, 4), atol=1e-5, rtol=0)
    torch.testing.assert_close(comb.sum(-2), torch.ones(1000, 4), atol=1e-5, rtol=0)
    assert (comb > 0).all()
    sharp = torch.randn(1000, 4, 4) * 3
    err = [(sinkhorn_comb(sharp, n, 1e-6).sum(-1) - 1).abs().max() for n in (1, 5, 20)]
    assert err[0] > err[1] > err[2]


@pytest.mark.parametrize("shape, iters",
                         [((8, 64, 4, 4), 20), ((3, 5, 4, 4), 1), ((2, 4, 4), 0), ((7, 3, 3), 2)])
def test_explicit_backward_sinkhorn_equals_autograd_through_the_reference(shape, iters):
    """The default path's hand-written backward against autograd through `sinkhorn_comb`, fp64;
    the logits arrive non-contiguous, as HyperConnection's slice of the mixing logits does."""
    torch.manual_seed(0)
    logits = (torch.randn(*shape[:-1], 2 * shape[-1], dtype=torch.float64) * 3)[..., 1::2].requires_grad_()
    cot = torch.randn(shape, dtype=torch.float64)
    ref = sinkhorn_comb(logits, iters, 1e-6)
    out = sinkhorn_comb_explicit(logits, iters, 1e-6)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-15)
    g_ref, = torch.autograd.grad(ref, logits, cot)
    g, = torch.autograd.grad(out, logits, cot)
    torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-14)
    assert out.is_contiguous() and HyperConnection(4, 4, 20, 1e-6, 1e-6).sinkhorn is sinkhorn_comb_explicit
    small = torch.randn(2, 3, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: sinkhorn_comb_explicit(t, 3, 1e-6), (small,))


def test_hyper_connection_coefficients_and_update():
    torch.manual_seed(4)
    hc = HyperConnection(dim=8, n_streams=4, sinkhorn_iters=20, eps=1e-6, norm_eps=1e-6)
    hc.reset_parameters()
    torch.nn.init.normal_(hc.fn, std=0.08)  # mixing logits of std ~0.5
    h = torch.randn(2, 3, 4, 8)
    post, comb, pre = hc(h)
    assert post.shape == (2, 3, 4) and comb.shape == (2, 3, 4, 4) and pre.shape == (2, 3, 4)
    assert ((post > 0) & (post < 2)).all() and (pre > 0).all() and (pre < 1 + 1e-5).all()
    torch.testing.assert_close(comb.sum(-1), torch.ones(2, 3, 4), atol=1e-5, rtol=0)
    torch.testing.assert_close(comb.sum(-2), torch.ones(2, 3, 4), atol=1e-5, rtol=0)
    y = torch.randn(2, 3, 8)
    new = update_streams(h, y, post, comb)
    b, t, dst = 1, 2, 3
    expected = post[b, t, dst] * y[b, t] + sum(comb[b, t, src, dst] * h[b, t, src] for src in range(4))
    torch.testing.assert_close(new[b, t, dst], expected)
    x = mix_streams(pre, h)
    torch.testing.assert_close(x[b, t], sum(pre[b, t, s] * h[b, t, s] for s in range(4)))


def test_hyper_connection_logits_stay_fp32_under_autocast():
    """ARCHITECTURE.md §6: the coefficients come from one fp32 linear. Under bf16 autocast F.linear would
    round its inputs to bf16 (logit errors ~1e-3 here); the projection must give the fp32 values."""
    torch.manual_seed(5)
    hc = HyperConnection(dim=64, n_streams=4, sinkhorn_iters=20, eps=1e-6, norm_eps=1e-6)
    hc.reset_parameters()
    torch.nn.init.normal_(hc.fn, std=0.05)
    h = torch.randn(2, 7, 4, 64)
    want = hc.project(h)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = hc.project(h)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_hyper_connection_normalises_with_norm_eps_and_shifts_pre_by_hc_eps():
    """The RMS normalisation before the mHC linear uses the model's norm_eps; hc_eps is what pre
    is shifted by (and Sinkhorn's eps). The two are set far apart, so swapping them shows."""
    torch.manual_seed(6)
    n, dim, norm_eps, hc_eps = 4, 8, 0.5, 1e-3
    hc = HyperConnection(dim=dim, n_streams=n, sinkhorn_iters=20, eps=hc_eps, norm_eps=norm_eps).double()
    hc.reset_parameters()
    with torch.no_grad():
        hc.base.normal_(std=0.3)
    h = torch.randn(2, 3, n, dim, dtype=torch.float64) * 0.7  # mean square ~0.5: norm_eps matters
    b, t = 1, 2
    flat = [float(v) for v in h[b, t].flatten()]
    rms = (sum(v * v for v in flat) / len(flat) + norm_eps) ** 0.5
    fn = hc.fn.detach()
    want = torch.tensor([sum(fn[j, i].item() * flat[i] / rms for i in range(n * dim))
                         for j in range(fn.shape[0])],
                        dtype=torch.float64)
    mix = hc.project(h)
    torch.testing.assert_close(mix[b, t], want, rtol=1e-12, atol=1e-12)
    rms_hc = (sum(v * v for v in flat) / len(flat) + hc_eps) ** 0.5
    assert (mix[b, t] - want * rms / rms_hc).abs().max() > 1e-3  # hc_eps there would be caught
    _, _, pre = hc(h)
    base = hc.base.detach()
    want_pre = [1 / (1 + math.exp(-(mix[b, t, s].item() * hc.scale[0].item() + base[s].item()))) + hc_eps
                for s in range(n)]
    torch.testing.assert_close(pre[b, t], torch.tensor(want_pre, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_block_gives_its_hyper_connections_both_epsilons():
    from conf.model import TinyModelConfig
    from model.plan import build_layer_plan
    from model.transformer import Block

    cfg = TinyModelConfig(vocab_size=97, norm_eps=1e-2, hc_eps=1e-5, engram_layers=[])
    block = Block(cfg, build_layer_plan(cfg).layers[0])
    for hc in (block.attn_hc, block.ffn_hc):
        assert (hc.norm_eps, hc.eps) == (1e-2, 1e-5)


def test_initial_pre_is_one_hot():
    h = torch.randn(2, 3, 4, 5)
    pre = initial_pre(h)
    assert pre[..., 0].eq(1).all() and pre[..., 1:].eq(0).all()
    torch.testing.assert_close(mix_streams(pre, h), h[:, :, 0])
