"""Triton top-k selection (model/kernels/topk.py) against model.indexer.select_topk: the same ids,
exactly (ties to the lowest columns, -inf dropped, ascending, -1 padded). CPU: Triton's
interpreter; the gpu test runs the training shape (S = 4096, k = 512)."""
from __future__ import annotations

import pytest
import torch

from model.indexer import select_topk
from model.kernels.topk import select_topk_triton


def _scores(B, T, S, seed=0, ties=False, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    if ties:  # few distinct values: many ties at the k-th, both signs of zero
        x = torch.randint(-2, 3, (B, T, S), generator=g).float()
        x = torch.where(torch.rand(B, T, S, generator=g) < 0.2, torch.tensor(-0.0), x)
    else:
        x = torch.randn(B, T, S, generator=g)
    visible = torch.arange(S)[None, None, :] <= (torch.arange(T) * S // T)[None, :, None]  # causal-like
    x = x.masked_fill(~visible, float("-inf"))
    x[0, 1] = float("-inf")  # a row with nothing visible
    return x.to(device)


@pytest.mark.parametrize("S,k", [(40, 8), (37, 16), (64, 64), (12, 20)],
                         ids=["k<S", "S-not-pow2", "k=S", "S<k"])
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_matches_reference(S, k, ties):
    scores = _scores(2, 9, S, ties=ties)
    got = select_topk_triton(scores, k)
    torch.testing.assert_close(got, select_topk(scores, k), rtol=0, atol=0)
    assert got.dtype == torch.int64 and got.shape == (2, 9, k)


def test_ties_pick_the_lowest_columns():
    scores = torch.tensor([[[0.0, 2.0, -0.0, 0.0, 1.0, 0.0, float("-inf")]]])
    assert select_topk_triton(scores, 4).tolist() == [[[0, 1, 2, 4]]]
    assert select_topk_triton(scores, 7).tolist() == [[[0, 1, 2, 3, 4, 5, -1]]]


def test_scores_one_ulp_apart_at_the_kth():
    """The radix select stops once exactly k keys are >= its candidate: with the k-th and the
    (k+1)-th score one ulp apart it must run to the last bit; with a wide gap it stops early.
    Either way the ids are the reference's."""
    base = torch.tensor(1.0)
    ulps = [base]
    for _ in range(12):
        ulps.append(torch.nextafter(ulps[-1], torch.tensor(2.0)))
    row = torch.stack(ulps)[torch.randperm(13, generator=torch.Generator().manual_seed(4))]
    wide = torch.cat([torch.full((5,), 100.0), torch.full((8,), -3.0)])  # the 5th and 6th far apart
    scores = torch.stack([row, wide, -row])[None]  # [1, 3, 13]
    for k in (1, 5, 6, 12):
        torch.testing.assert_close(select_topk_triton(scores, k), select_topk(scores, k), rtol=0, atol=0)


def test_positions_map_columns_to_entry_ids():
    """Reindex: columns are pool slots; ids come from positions (-1 slots score -inf), sorted."""
    g = torch.Generator().manual_seed(3)
    B, T, P, k = 2, 6, 24, 8
    positions = torch.stack([torch.randperm(100, generator=g)[:P] for _ in range(B * T)]).view(B, T, P)
    positions[:, :, ::5] = -1
    scores = torch.randn(B, T, P, generator=g).masked_fill(positions < 0, float("-inf"))
    got = select_topk_triton(scores, k, positions)
    torch.testing.assert_close(got, select_topk(scores, k, positions), rtol=0, atol=0)


def test_wide_rows_take_the_reference(monkeypatch):
    import model.kernels.topk as topk

    monkeypatch.setattr(topk, "MAX_S", 16)
    scores = _scores(1, 4, 40)
    torch.testing.assert_close(select_topk_triton(scores, 8), select_topk(scores, 8), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_gpu_training_shape(ties):
    scores = _scores(2, 512, 4096, ties=ties, device="cuda")
    torch.testing.assert_close(select_topk_triton(scores, 512), select_topk(scores, 512), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("T,S,k", [(1024, 1024, 64), (1024, 128, 8)], ids=["entries", "pool-blocks"])
def test_gpu_compiled_reference_matches_eager(T, S, k):
    """trainer.compile with model.kernels=false traces select_topk: inductor's version must pick
    the same ids (torch 2.11 miscompiled `topk_ids` on the H200: see
    bench/reports/2026-12-06-design-history.md)."""
    scores = _scores(2, T, S, ties=True, device="cuda")
    try:
        got = torch.compile(select_topk)(scores, k)
        torch.testing.assert_close(got, select_topk(scores, k), rtol=0, atol=0)
    finally:
        torch._dynamo.reset()
