"""model/kernels/indexer.py against its references in model/indexer.py (index_scores,
index_scores_at) and model/runtime.py (AttentionRuntime.visible). On a CPU the kernels run in
Triton's interpreter (tests/conftest.py), in fp32 at small sizes."""
from __future__ import annotations

import pytest
import torch

from model.indexer import NEG_INF, index_scores, index_scores_at
from model.kernels.indexer import index_scores_at_triton, index_scores_triton
from model.runtime import AttentionRuntime, SequenceShard, document_starts

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def inputs(B, T, S, H, Di, dtype=torch.float32, seed=0, device=DEV):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, Di, generator=g).to(device, dtype)
    w = (torch.randn(B, T, H, generator=g) * (Di ** -0.5 * H ** -0.5)).to(device)
    k = torch.randn(B, S, Di, generator=g).to(device, dtype)
    return q, w, k


def assert_scores(got, want, atol=1e-4, rtol=1e-4):
    """Values within tolerance and -inf at exactly the same entries."""
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], atol=atol, rtol=rtol)


def candidates(B, T, P, S, seed=1, device=DEV):
    """Distinct ids per query (like a pool or a top-k), some -1 slots."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(S, generator=g)[:P] for _ in range(B * T)]).view(B, T, P)
    ids[torch.rand(B, T, P, generator=g) < 0.2] = -1
    ids[0, 0] = -1  # a query without candidates
    return ids.to(device)


@pytest.mark.parametrize("B,T,S,H,Di", [(2, 37, 45, 4, 32), (1, 16, 16, 16, 16), (1, 5, 70, 3, 24)])
def test_index_scores_matches_reference(B, T, S, H, Di):
    q, w, k = inputs(B, T, S, H, Di)
    assert_scores(index_scores_triton(q, w, k), index_scores(q, w, k))


def test_index_scores_non_contiguous_rows():
    # the model passes iq[:, rows] (a query chunk) and expanded/transposed views
    q, w, k = inputs(2, 40, 33, 4, 32)
    rows = slice(7, 30)
    kt = k.transpose(1, 2).contiguous().transpose(1, 2)  # same values, strided rows
    assert_scores(index_scores_triton(q[:, rows], w[:, rows], kt), index_scores(q[:, rows], w[:, rows], k))


@pytest.mark.parametrize("m,offset,rows", [(1, 0, slice(None)), (2, 0, slice(None)), (4, 12, slice(9, 31)),
                                           (2, 6, slice(0, 17))])
def test_index_scores_fused_visibility(m, offset, rows):
    """The fused mask equals _select's index_scores(...).masked_fill(~rt.visible(m, rows), -inf),
    with documents, a context-parallel offset and a query chunk."""
    B, T = 2, 40
    total = offset + T
    doc_ids = torch.tensor([[0] * 11 + [1] * 20 + [2] * 9, [0] * 40], device=DEV)
    rt = AttentionRuntime(B, T, torch.device(DEV),
                          shard=SequenceShard(offset=offset, total_len=total,
                                              doc_start=document_starts(doc_ids) + offset))
    S = total // m
    Tc = len(range(T)[rows])
    q, w, k = inputs(B, Tc, S, 4, 32, seed=3)
    want = index_scores(q, w, k).masked_fill(~rt.visible(m, rows), NEG_INF)
    got = index_scores_triton(q, w, k, positions=rt.positions[:, rows], doc_start=rt.doc_start[:, rows], m=m)
    assert torch.isneginf(want).any() and torch.isfinite(want).any()
    assert_scores(got, want)


@pytest.mark.parametrize("B,T,S,P,H,Di",
                         [(2, 6, 50, 24, 4, 32), (1, 3, 40, 40, 16, 16), (1, 4, 20, 7, 5, 24)])
def test_index_scores_at_matches_reference(B, T, S, P, H, Di):
    q, w, k = inputs(B, T, S, H, Di)
    cand = candidates(B, T, P, S)
    assert_scores(index_scores_at_triton(q, w, k, cand), index_scores_at(q, w, k, cand))
    # int32 ids, as a caller might hold them
    assert_scores(index_scores_at_triton(q, w, k, cand.int()), index_scores_at(q, w, k, cand))


def test_index_scores_at_agrees_with_dense_scores():
    q, w, k = inputs(1, 5, 30, 4, 32)
    cand = candidates(1, 5, 12, 30)
    dense = index_scores_triton(q, w, k)
    want = dense.gather(-1, cand.clamp(min=0)).masked_fill(cand < 0, NEG_INF)
    assert_scores(index_scores_at_triton(q, w, k, cand), want)


def _grads(fn, q, w, k, cand, upstream):
    q, w, k = (t.detach().clone().requires_grad_() for t in (q, w, k))
    out = fn(q, w, k, cand)
    out.masked_fill(cand < 0, 0.0).mul(upstream).sum().backward()  # finite loss over -inf slots
    return out.detach(), q.grad, w.grad, k.grad


@pytest.mark.parametrize("B,T,S,P,H,Di", [(2, 5, 30, 20, 4, 32), (1, 3, 40, 33, 16, 16)])
def test_index_scores_at_gradients(B, T, S, P, H, Di):
    q, w, k = inputs(B, T, S, H, Di, seed=5)
    cand = candidates(B, T, P, S, seed=6)
    up = torch.randn(B, T, P, generator=torch.Generator().manual_seed(7)).to(DEV)
    ref = _grads(index_scores_at, q, w, k, cand, up)
    got = _grads(index_scores_at_triton, q, w, k, cand, up)
    assert_scores(got[0], ref[0])
    for g, r in zip(got[1:], ref[1:]):
        assert g.shape == r.shape and g.dtype == r.dtype
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)


def test_index_scores_at_gradient_through_log_softmax():
    """The indexer KL's use: log_softmax over the scores (-inf slots included), keys shared by
    queries (atomic adds to the same rows)."""
    q, w, k = inputs(1, 6, 10, 4, 32, seed=8)
    cand = torch.tensor([[0, 1, 2, 3, 4, 5, -1, -1, 9, 8, 7, 6, -1, -1, -1, -1]] * 6).unsqueeze(0).to(DEV)
    target = torch.softmax(torch.randn(1, 6, 16, generator=torch.Generator().manual_seed(9)).to(DEV), -1)
    target = target.masked_fill(cand < 0, 0.0)

    def loss_grads(fn):
        qq, ww, kk = (t.detach().clone().requires_grad_() for t in (q, w, k))
        logq = torch.log_softmax(fn(qq, ww, kk, cand), dim=-1)
        torch.where(target > 0, target * (target.clamp(min=1e-30).log() - logq), 0.0).sum().backward()
        return qq.grad, ww.grad, kk.grad

    for g, r in zip(loss_grads(index_scores_at_triton), loss_grads(index_scores_at)):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)


def test_gradients_only_where_asked():
    q, w, k = inputs(1, 4, 20, 4, 32)
    cand = candidates(1, 4, 8, 20)
    k.requires_grad_(False)
    qq, ww = q.clone().requires_grad_(), w.clone().requires_grad_()
    out = index_scores_at_triton(qq, ww, k, cand)
    out.masked_fill(cand < 0, 0.0).sum().backward()
    assert qq.grad is not None and ww.grad is not None and k.grad is None


def test_rejects_float64():
    q, w, k = inputs(1, 4, 20, 4, 32, dtype=torch.float64)
    with pytest.raises(TypeError):
        index_scores_triton(q, w, k)


# --------------------------------------------------------------------------- GPU, realistic sizes
def _bf16_case(T, S, H, Di, seed=0):
    q, w, k = inputs(1, T, S, H, Di, dtype=torch.bfloat16, seed=seed, device="cuda")
    return q, w, k


@pytest.mark.gpu
@pytest.mark.parametrize("H", [16, 64])
def test_gpu_index_scores_bf16(H):
    q, w, k = _bf16_case(1024, 4096, H, 128)
    want = index_scores(q, w, k)  # fp32 reference of the bf16 values
    # bf16 products are exact in the MMA; only the fp32 summation order differs
    assert_scores(index_scores_triton(q, w, k), want, atol=2e-3, rtol=2e-3)
    rt = AttentionRuntime(1, 4096, torch.device("cuda"))
    rows = slice(3072, 4096)
    got = index_scores_triton(q, w, k, positions=rt.positions[:, rows], doc_start=rt.doc_start[:, rows], m=1)
    assert_scores(got, want.masked_fill(~rt.visible(1, rows), NEG_INF), atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
def test_gpu_index_scores_fp32_ieee():
    q, w, k = inputs(1, 512, 2048, 64, 128, device="cuda")
    assert_scores(index_scores_triton(q, w, k), index_scores(q, w, k))


@pytest.mark.gpu
def test_gpu_index_scores_at_bf16_with_gradients():
    T, S, P, H, Di = 256, 8192, 1024, 64, 128
    q, w, k = _bf16_case(T, S, H, Di, seed=1)
    g = torch.Generator(device="cuda").manual_seed(2)
    cand = torch.argsort(torch.rand(1, T, S, device="cuda", generator=g), dim=-1)[..., :P]
    cand[..., -100:] = -1
    up = torch.randn(1, T, P, device="cuda", generator=g)
    ref = _grads(index_scores_at, q, w, k, cand, up)
    got = _grads(index_scores_at_triton, q, w, k, cand, up)
    assert_scores(got[0], ref[0], atol=2e-3, rtol=2e-3)
    for a, b in zip(got[1:], ref[1:]):  # dx is rounded to bf16 for the backward MMAs: relative L2
        err = (a.float() - b.float()).norm() / b.float().norm()
        assert err <= 2e-2, err.item()
