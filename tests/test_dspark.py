"""The DSpark drafter (model/dspark.py) and speculative decoding (inference/speculative.py): shapes,
what the drafter may see, that training moves it toward the target, and that speculative decoding
leaves the target's output unchanged (greedy: the same tokens; sampled: the same distribution)."""
import copy
import dataclasses

import pytest
import torch

from conf.model import TinyModelConfig
from model.dspark import DSpark, TapRecorder
from model.transformer import Transformer

CFG = dataclasses.replace(TinyModelConfig(vocab_size=97), engram_min_rows=50, window=8, index_topk=4,
                          pool_block=2, pool_blocks=3)


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    model = Transformer(CFG).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _forward(target, drafter, ids):
    with TapRecorder(target, drafter.taps) as rec, torch.no_grad():
        logits = target(ids).logits
        return logits, rec.take()


def test_shapes_and_taps(target):
    torch.manual_seed(1)
    d = DSpark(CFG)
    assert d.taps == [3, 4, 5] and d.block == 5 and d.noise_id == 96
    assert len(d.layers) == 3 and all(layer.spec.mode == "swa" for layer in d.layers)
    assert d.layers[0].moe.router.weight.shape == (CFG.dspark_routed_experts, CFG.dim)
    ids = torch.randint(0, 97, (2, 20))
    logits, taps = _forward(target, d, ids)
    assert taps.shape == (2, 20, 3 * CFG.dim)
    out = d.draft_loss(target, taps, ids, logits)
    assert out.accept.shape == out.top1.shape == (5,) and out.kl > 0
    # the last anchor (position 18) has one next token: only draft position 0 counts there
    assert out.positions.tolist() == [2 * 18, 2 * 17, 2 * 16, 2 * 15, 2 * 14]


def test_a_draft_sees_only_the_past_window(target):
    """Hidden states at an anchor depend on context rows in [p - window, p) and on nothing later."""
    torch.manual_seed(2)
    d = DSpark(CFG).double()
    D, N, W = CFG.dim, 24, CFG.window
    ctx = torch.randn(1, N, D, dtype=torch.float64)
    pos = torch.arange(N)[None]
    p = torch.tensor([[15]])
    visible = (pos[:, None] < p[..., None]) & (pos[:, None] >= p[..., None] - W)
    anchor = torch.tensor([[7]])
    embed = copy.deepcopy(target.embed).double()
    base = d.hidden(embed, ctx, visible, pos, anchor, p)
    for j, moves in ((16, False), (15, False), (6, False), (14, True), (7, True)):
        edited = ctx.clone()
        edited[0, j] += 1.0
        out = d.hidden(embed, edited, visible, pos, anchor, p)
        assert (not torch.equal(out, base)) == moves, j


def test_training_moves_the_drafter_toward_the_target(target):
    torch.manual_seed(3)
    d = DSpark(CFG)
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(4))
    logits, taps = _forward(target, d, ids)
    opt = torch.optim.Adam(d.parameters(), lr=3e-3)
    first = d.draft_loss(target, taps, ids, logits)
    for _ in range(15):
        out = d.draft_loss(target, taps, ids, logits)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    last = d.draft_loss(target, taps, ids, logits)
    assert last.kl < 0.6 * first.kl
    assert last.accept.mean() > first.accept.mean() and last.top1.mean() > first.top1.mean()
    assert last.confidence < first.confidence  # the confidence head learns the acceptance
