"""Muon and Sinkhorn optimiser math, checked against reference math written here (SVD polar factors,
explicit per-head / per-expert loops, a loop-form Newton-Schulz and Sinkhorn), plus resume exactness."""
import io
import math

import pytest
import torch
import torch.nn.functional as F

from optim.muon import Muon, muon_blocks, muon_direction, newton_schulz, same_shape_batches
from optim.sinkhorn import Sinkhorn, sinkhorn_balance


# ---------------------------------------------------------------- references
def ref_newton_schulz(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """One matrix at a time, fp32: normalise, iterate on the wide side, transpose back."""
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G.float().T if G.shape[0] > G.shape[1] else G.float()
    X = X / (torch.sqrt((X * X).sum()) + 1e-7)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + b * (A @ X) + c * (A @ (A @ X))
    return X.T if G.shape[0] > G.shape[1] else X


def polar(G: torch.Tensor) -> torch.Tensor:
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    return (U @ Vh).float()


def rms(t: torch.Tensor) -> float:
    return t.double().pow(2).mean().sqrt().item()


def ref_sinkhorn(U: torch.Tensor, iters: int = 11, tau: float = 1e-3) -> torch.Tensor:
    """fp64, row by row and column by column."""
    X = U.double().clone()
    norms = [X[i].norm().item() for i in range(X.shape[0])]
    live = [n for n in norms if n > 0]
    mean = sum(live) / max(len(live), 1)
    for i, n in enumerate(norms):
        if n <= tau * mean:
            X[i] = 0
    for k in range(iters):
        if k % 2 == 0:
            for i in range(X.shape[0]):
                X[i] = X[i] / (X[i].norm() + 1e-12)
        else:
            for j in range(X.shape[1]):
                X[:, j] = X[:, j] / (X[:, j].norm() + 1e-12)
    return X * math.sqrt(X.shape[1])


def skewed(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random matrix with row and column scales spread over two decades."""
    g = torch.Generator().manual_seed(seed)
    row_scale = torch.logspace(-1, 1, rows)[torch.randperm(rows, generator=g)]
    col_scale = torch.logspace(-1, 1, cols)[torch.randperm(cols, generator=g)]
    return torch.randn(rows, cols, generator=g) * row_scale[:, None] * col_scale


def run_steps(opt: torch.optim.Optimizer, params: list[torch.Tensor],
              grads: list[list[torch.Tensor]]) -> None:
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()


# ---------------------------------------------------------------- Newton-Schulz
@pytest.mark.parametrize("shape", [(48, 16), (16, 48), (3, 24, 40), (2, 3, 20, 12)])
def test_newton_schulz_near_orthogonal(shape):
    G = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    X = newton_schulz(G)
    assert X.shape == G.shape and X.dtype == G.dtype
    s = torch.linalg.svdvals(X)
    assert s.min() > 0.5 and s.max() < 1.5
    P = polar(G)
    cos = (X * P).sum((-2, -1)) / (X.norm(dim=(-2, -1)) * P.norm(dim=(-2, -1)))
    assert cos.min() > 0.9


def test_newton_schulz_square():
    # 5 quintic steps lift a singular value by ~3.44^5 ~ 500 at most, so a Gaussian square matrix's
    # near-null directions (sigma_min ~ n^-1.5 of the Frobenius norm) stay short: build a
    # square matrix with condition number 100 for the singular-value bound; direction holds regardless.
    g = torch.Generator().manual_seed(1)
    Q1, _ = torch.linalg.qr(torch.randn(32, 32, generator=g))
    Q2, _ = torch.linalg.qr(torch.randn(32, 32, generator=g))
    G = Q1 @ torch.diag(torch.logspace(-2, 0, 32)) @ Q2.T
    s = torch.linalg.svdvals(newton_schulz(G))
    assert s.min() > 0.5 and s.max() < 1.5
    G = torch.randn(4, 32, 32, generator=g)
    X, P = newton_schulz(G), polar(G)
    assert ((X * P).sum((-2, -1)) / (X.norm(dim=(-2, -1)) * P.norm(dim=(-2, -1)))).min() > 0.9


def test_newton_schulz_matches_loop_reference_and_dtypes():
    G = torch.randn(3, 20, 12, generator=torch.Generator().manual_seed(2))
    expected = torch.stack([ref_newton_schulz(m) for m in G])
    torch.testing.assert_close(newton_schulz(G), expected, atol=1e-5, rtol=1e-5)
    out64 = newton_schulz(G.double())  # computed in fp32 on CPU, returned in the input dtype
    assert out64.dtype == torch.float64
    bf = newton_schulz(G, compute_dtype=torch.bfloat16)
    assert bf.dtype == torch.float32 and torch.linalg.svdvals(bf).min() > 0.5
    assert torch.equal(newton_schulz(torch.zeros(2, 5, 7)), torch.zeros(2, 5, 7))


# ---------------------------------------------------------------- Muon
def test_muon_blocks_layout():
    W = torch.arange(4 * 3 * 5.0).reshape(12, 5)  # 4 heads of 3 rows
    B = muon_blocks(W, heads=4)
    assert B.shape == (4, 3, 5)
    for h in range(4):
        assert torch.equal(B[h], W[h * 3:(h + 1) * 3])
    E = torch.randn(6, 4, 8)
    assert torch.equal(muon_blocks(E), E) and muon_blocks(W).shape == (1, 12, 5)
    assert torch.equal(muon_blocks(E, heads=2)[3], E[1, 2:4])


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_step_matches_reference(nesterov):
    g = torch.Generator().manual_seed(3)
    W0 = torch.randn(24, 10, generator=g)
    grads = [torch.randn(24, 10, generator=g) for _ in range(3)]
    lr, mu, wd = 0.05, 0.9, 0.1
    W = W0.clone().requires_grad_()
    opt = Muon([W], lr=lr, momentum=mu, nesterov=nesterov, weight_decay=wd)
    ref, buf = W0.clone(), torch.zeros_like(W0)
    for grad in grads:
        W.grad = grad.clone()
        opt.step()
        buf = mu * buf + grad
        u = grad + mu * buf if nesterov else buf
        ref = ref * (1 - lr * wd) - lr * 0.2 * math.sqrt(24) * ref_newton_schulz(u)
    torch.testing.assert_close(W.detach(), ref, atol=1e-6, rtol=0)


def test_headwise_muon_equals_per_head_loop():
    H, C, R = 4, 6, 16
    g = torch.Generator().manual_seed(4)
    W0 = torch.randn(H * C, R, generator=g)
    grads = [torch.randn(H * C, R, generator=g) for _ in range(3)]
    W = W0.clone().requires_grad_()
    opt = Muon([{"params": [W], "heads": H}], lr=0.1, weight_decay=0.01)
    run_steps(opt, [W], [[gr] for gr in grads])
    for h in range(H):
        rows = slice(h * C, (h + 1) * C)
        Wh = W0[rows].clone().requires_grad_()
        opt_h = Muon([Wh], lr=0.1, weight_decay=0.01)
        run_steps(opt_h, [Wh], [[gr[rows]] for gr in grads])
        torch.testing.assert_close(W.detach()[rows], Wh.detach(), atol=1e-6, rtol=0)
    # and head-wise differs from treating the projection as one matrix
    W1 = W0.clone().requires_grad_()
    run_steps(Muon([W1], lr=0.1, weight_decay=0.01), [W1], [[gr] for gr in grads])
    assert (W1 - W).abs().max() > 1e-3


def test_per_expert_muon_equals_loop():
    E, inter, D = 3, 10, 6  # w1 / w3 layout [E, I, D]
    g = torch.Generator().manual_seed(5)
    W0 = torch.randn(E, inter, D, generator=g)
    grads = [torch.randn(E, inter, D, generator=g) for _ in range(3)]
    W = W0.clone().requires_grad_()
    run_steps(Muon([W], lr=0.1, rms_mode="fixed"), [W], [[gr] for gr in grads])
    for e in range(E):
        We = W0[e].clone().requires_grad_()
        run_steps(Muon([We], lr=0.1, rms_mode="fixed"), [We], [[gr[e]] for gr in grads])
        torch.testing.assert_close(W.detach()[e], We.detach(), atol=1e-6, rtol=0)


def test_same_shape_batches_group_by_block_shape_and_bound_size():
    ps = [torch.zeros(6, 10), torch.zeros(2, 6, 10), torch.zeros(10, 6), torch.zeros(12, 10),
          torch.zeros(6, 10)]
    assert same_shape_batches(ps, heads=1) == [[0, 1, 4], [2], [3]]
    # [2, 6, 10] alone is 120
    assert same_shape_batches(ps, heads=1, max_numel=120) == [[0], [1], [4], [2], [3]]
    assert same_shape_batches(ps, heads=1, max_numel=180) == [[0, 1], [4], [2], [3]]
    with pytest.raises(ValueError, match="not divisible by heads=4"):
        same_shape_batches(ps, heads=4)


@pytest.mark.parametrize("rms_mode,nesterov", [("moonlight", True), ("fixed", False)])
def test_batched_muon_step_equals_one_optimiser_per_parameter(rms_mode, nesterov):
    """Parameters stepped together (same block shape, stacked) move exactly as when each has its own Muon."""
    g = torch.Generator().manual_seed(11)
    shapes = [(6, 10), (3, 6, 10), (10, 6), (6, 10), (2, 10, 6), (4, 8)]
    W0 = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(3)]
    kw = dict(lr=0.05, momentum=0.9, nesterov=nesterov, weight_decay=0.1, rms_mode=rms_mode)
    W = [w.clone().requires_grad_() for w in W0]
    run_steps(Muon(W, **kw), W, grads)
    for i, w0 in enumerate(W0):
        Wi = w0.clone().requires_grad_()
        run_steps(Muon([Wi], **kw), [Wi], [[step[i]] for step in grads])
        torch.testing.assert_close(W[i].detach(), Wi.detach(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("shape,heads", [((64, 16), 1), ((16, 64), 1), ((4 * 16, 32), 4), ((3, 12, 40), 1)])
def test_rms_modes(shape, heads):
    u = torch.randn(shape, generator=torch.Generator().manual_seed(6))
    # moonlight: 0.2 * sqrt(max(A, B)) of the BLOCK, times an NS output whose singular values are ~1
    d = muon_direction(u, heads, rms_mode="moonlight")
    blocks = muon_blocks(d, heads)
    sv = torch.linalg.svdvals(blocks / (0.2 * math.sqrt(max(blocks.shape[-2:]))))
    for b in range(blocks.shape[0]):
        assert rms(blocks[b]) == pytest.approx(0.2 * sv[b].pow(2).mean().sqrt().item(), rel=1e-4)
        assert 0.15 < rms(blocks[b]) < 0.25
    d = muon_direction(u, heads, rms_mode="fixed", target_rms=0.18)
    for block in muon_blocks(d, heads):
        assert rms(block) == pytest.approx(0.18, rel=1e-6)


def test_weight_decay_is_decoupled_and_zero_grad_is_safe():
    g = torch.Generator().manual_seed(7)
    W0, grad = torch.randn(3, 8, 12, generator=g), torch.randn(3, 8, 12, generator=g)
    grad[1] = 0  # one all-zero expert block
    for mode in ("moonlight", "fixed"):
        W = W0.clone().requires_grad_()
        W.grad = torch.zeros_like(W0)
        Muon([W], lr=0.1, weight_decay=0.5, rms_mode=mode).step()
        assert torch.equal(W.detach(), W0 * (1 - 0.1 * 0.5))  # zero grad: decay only, no NaN
        Wd, Wn = W0.clone().requires_grad_(), W0.clone().requires_grad_()
        Wd.grad, Wn.grad = grad.clone(), grad.clone()
        Muon([Wd], lr=0.1, weight_decay=0.5, rms_mode=mode).step()
        Muon([Wn], lr=0.1, weight_decay=0.0, rms_mode=mode).step()
        assert torch.isfinite(Wd).all()
        assert torch.equal(Wd.detach()[1], W0[1] * (1 - 0.1 * 0.5))
        torch.testing.assert_close(Wd.detach(), W0 * (1 - 0.1 * 0.5) + (Wn.detach() - W0), atol=1e-6, rtol=0)


def test_muon_state_dict_resume_is_bitwise():
    g = torch.Generator().manual_seed(8)
    shapes = [(4 * 5, 12), (3, 10, 6), (10, 20)]
    P0 = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(5)]

    def make(params):
        return Muon([{"params": [params[0]], "heads": 4}, {"params": [params[1]], "nesterov": False},
                     {"params": [params[2]], "rms_mode": "fixed", "weight_decay": 0.1}], lr=0.05)

    straight = [p.clone().requires_grad_() for p in P0]
    run_steps(make(straight), straight, grads)
    first = [p.clone().requires_grad_() for p in P0]
    opt = make(first)
    run_steps(opt, first, grads[:2])
    blob = io.BytesIO()
    torch.save(opt.state_dict(), blob)
    blob.seek(0)
    resumed = [p.detach().clone().requires_grad_() for p in first]
    opt2 = make(resumed)
    opt2.load_state_dict(torch.load(blob, weights_only=True))
    run_steps(opt2, resumed, grads[2:])
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))


@pytest.mark.parametrize("kwargs", [dict(lr=-1.0), dict(momentum=1.0), dict(ns_steps=0), dict(rms_mode="rms"),
                                    dict(target_rms=0.0), dict(weight_decay=-0.1), dict(heads=0)])
def test_muon_bad_options(kwargs):
    with pytest.raises(ValueError):
        Muon([torch.zeros(8, 4, requires_grad=True)], **kwargs)


def test_muon_bad_params():
    with pytest.raises(ValueError, match="2-D or 3-D"):
        Muon([torch.zeros(8, requires_grad=True)])
    with pytest.raises(ValueError, match="divisible"):
        Muon([{"params": [torch.zeros(10, 4, requires_grad=True)], "heads": 4}])
    opt = Muon([torch.zeros(8, 4, requires_grad=True)])
    with pytest.raises(ValueError):
        opt.add_param_group({"params": [torch.zeros(2, 2, 2, 2, requires_grad=True)]})
    assert len(opt.param_groups) == 1


# ---------------------------------------------------------------- Sinkhorn balancing
def test_sinkhorn_balance_rows_and_columns():
    for rows, cols, seed in [(64, 32, 0), (32, 64, 1), (200, 16, 2)]:
        U = skewed(rows, cols, seed)
        N = sinkhorn_balance(U)
        torch.testing.assert_close(N.pow(2).mean(1).sqrt(), torch.ones(rows), atol=1e-6, rtol=0)
        before, after = U.pow(2).mean(0).sqrt(), N.pow(2).mean(0).sqrt()
        assert before.max() / before.min() > 10  # deliberately skewed
        assert after.max() / after.min() < 1.03
        torch.testing.assert_close(N.double(), ref_sinkhorn(U), atol=1e-5, rtol=1e-5)


def test_sinkhorn_balance_zeroes_weak_rows():
    U = skewed(40, 16, 3)
    U[[3, 17]] *= 1e-5  # well below tau * mean
    U[25] = 0
    N = sinkhorn_balance(U)
    assert torch.equal(N[[3, 17, 25]], torch.zeros(3, 16))
    kept = [i for i in range(40) if i not in (3, 17, 25)]
    torch.testing.assert_close(N[kept].pow(2).mean(1).sqrt(), torch.ones(37), atol=1e-6, rtol=0)
    torch.testing.assert_close(N.double(), ref_sinkhorn(U), atol=1e-5, rtol=1e-5)
    # all-zero rows do not move the threshold: padding with them leaves the other rows as they were
    padded = sinkhorn_balance(torch.cat([U, torch.zeros(1000, 16)]))
    torch.testing.assert_close(padded[:40], N, atol=1e-6, rtol=0)
    assert torch.equal(padded[40:], torch.zeros(1000, 16))


def test_sinkhorn_balance_degenerate_and_dtype():
    assert torch.equal(sinkhorn_balance(torch.zeros(5, 7)), torch.zeros(5, 7))
    # an all-zero column, and one whose only entries sit on a zeroed weak row: both stay zero
    # (no NaN) through 101 passes, and the rest matches the pass-by-pass reference
    U = skewed(30, 8, 5)
    U[:, 2] = 0
    U[:, 5] = 0
    U[7, 5] = 1e-9
    U[7] *= 1e-6
    N = sinkhorn_balance(U, iters=101)
    assert torch.isfinite(N).all() and torch.equal(N[:, [2, 5]], torch.zeros(30, 2))
    torch.testing.assert_close(N.double(), ref_sinkhorn(U, iters=101), atol=1e-5, rtol=1e-5)
    out = sinkhorn_balance(skewed(6, 4, 4).bfloat16())
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    with pytest.raises(ValueError):
        sinkhorn_balance(torch.ones(4, 4), iters=10)


# ---------------------------------------------------------------- Sinkhorn optimiser
def test_sinkhorn_step_matches_reference():
    g = torch.Generator().manual_seed(9)
    W0 = torch.randn(30, 8, generator=g)
    grads = [skewed(30, 8, 10 + i) for i in range(3)]
    lr, mu, wd = 0.1, 0.95, 0.2
    W = W0.clone().requires_grad_()
    opt = Sinkhorn([W], lr=lr, momentum=mu, weight_decay=wd)
    ref, buf = W0.double(), torch.zeros(30, 8, dtype=torch.float64)
    for grad in grads:
        W.grad = grad.clone()
        opt.step()
        buf = mu * buf + grad.double()
        ref = ref * (1 - lr * wd) - lr * 0.18 * ref_sinkhorn(grad.double() + mu * buf)
    torch.testing.assert_close(W.detach().double(), ref, atol=1e-5, rtol=0)


def sparse_grad(W: torch.Tensor, rows: torch.Tensor, seed: int) -> torch.Tensor:
    """A real F.embedding sparse gradient over `rows` (each at least once, some repeated)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.cat([rows, rows[torch.randint(len(rows), (20,), generator=g)]])
    idx = idx[torch.randperm(len(idx), generator=g)].view(2, -1)
    leaf = W.detach().clone().requires_grad_()
    out = F.embedding(idx, leaf, sparse=True)  # [2, n/2, cols]
    (out * torch.randn(out.shape, generator=g)).sum().backward()
    assert leaf.grad.is_sparse
    return leaf.grad


@pytest.mark.parametrize("n_steps", [1, 3])
def test_sparse_step_equals_dense_step(n_steps):
    V, D = 500, 16
    W0 = torch.randn(V, D, generator=torch.Generator().manual_seed(11))
    rows = torch.tensor([3, 7, 8, 42, 99, 100, 250, 311, 498, 499])
    untouched = torch.ones(V, dtype=torch.bool)
    untouched[rows] = False
    Ws, Wd = W0.clone().requires_grad_(), W0.clone().requires_grad_()
    opt_s, opt_d = Sinkhorn([Ws], lr=1.0), Sinkhorn([Wd], lr=1.0)
    for step in range(n_steps):
        grad = sparse_grad(W0, rows, seed=20 + step)
        assert not grad.is_coalesced()  # repeated rows: the optimiser must sum them
        Ws.grad, Wd.grad = grad, grad.coalesce().to_dense()
        opt_s.step()
        opt_d.step()
    assert (Ws[rows] - W0[rows]).abs().max() > 0.1  # the touched rows moved
    torch.testing.assert_close(Ws.detach()[rows], Wd.detach()[rows], atol=1e-6, rtol=0)
    assert torch.equal(Ws.detach()[untouched], W0[untouched])
    assert torch.equal(Wd.detach()[untouched], W0[untouched])  # dense: zero rows fall under tau
    buf_s, buf_d = opt_s.state[Ws]["momentum_buffer"], opt_d.state[Wd]["momentum_buffer"]
    assert torch.equal(buf_s, buf_d)


def test_sinkhorn_state_dict_resume_is_bitwise():
    g = torch.Generator().manual_seed(12)
    E0, H0 = torch.randn(300, 8, generator=g), torch.randn(40, 8, generator=g)
    steps = [(sparse_grad(E0, torch.randperm(300, generator=g)[:12], seed=30 + i), skewed(40, 8, 40 + i))
             for i in range(5)]

    def make(params):
        return Sinkhorn([{"params": [params[0]]},
                         {"params": [params[1]], "weight_decay": 0.1, "nesterov": False}],
                        lr=0.3)

    straight = [E0.clone().requires_grad_(), H0.clone().requires_grad_()]
    run_steps(make(straight), straight, steps)
    first = [E0.clone().requires_grad_(), H0.clone().requires_grad_()]
    opt = make(first)
    run_steps(opt, first, steps[:2])
    blob = io.BytesIO()
    torch.save(opt.state_dict(), blob)
    blob.seek(0)
    resumed = [p.detach().clone().requires_grad_() for p in first]
    opt2 = make(resumed)
    opt2.load_state_dict(torch.load(blob, weights_only=True))
    run_steps(opt2, resumed, steps[2:])
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))


@pytest.mark.parametrize("kwargs", [dict(lr=-1.0), dict(momentum=-0.1), dict(momentum=1.0), dict(gamma=0.0),
                                    dict(iters=10), dict(iters=0), dict(tau=-1.0), dict(weight_decay=-1.0)])
def test_sinkhorn_bad_options(kwargs):
    with pytest.raises(ValueError):
        Sinkhorn([torch.zeros(8, 4, requires_grad=True)], **kwargs)


def test_sinkhorn_bad_params():
    with pytest.raises(ValueError, match="2-D"):
        Sinkhorn([torch.zeros(2, 8, 4, requires_grad=True)])
    with pytest.raises(ValueError, match="2-D"):
        Sinkhorn([torch.zeros(8, requires_grad=True)])
