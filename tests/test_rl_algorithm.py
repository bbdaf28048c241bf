"""The RL objective's pieces: length penalty, group advantages, staleness mask, clipped and
truncated importance-sampled policy loss."""
import math

import pytest
import torch

from rl.algorithm import (
    FlatRewardWatch,
    group_advantages,
    length_penalty_coef,
    percentile,
    policy_loss,
    shaped_reward,
    stale_mask,
)


def test_length_penalty_grows_exponentially_as_effort_falls():
    base, scale = 8.0, 0.2
    assert float(length_penalty_coef(100, base, scale)) == pytest.approx(scale)
    assert float(length_penalty_coef(1, base, scale)) == pytest.approx(scale * base)
    coefs = length_penalty_coef(torch.arange(1, 101), base, scale)
    steps = coefs[:-1] / coefs[1:]  # one effort point lower multiplies by the same factor
    torch.testing.assert_close(steps, torch.full_like(steps, base ** (1 / 99)))
    # same answer, same length: the lower effort pays more
    r = shaped_reward(torch.ones(3), torch.full((3,), 20.0), torch.tensor([100, 75, 50]), 40, base, scale)
    assert r[0] > r[1] > r[2] and float(r[0]) == pytest.approx(math.exp(-scale * 0.5))
    # a wrong answer scores 0 at any length
    wrong = shaped_reward(torch.zeros(2), torch.tensor([2.0, 40.0]), torch.tensor([1, 1]), 40, base, scale)
    assert wrong.tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="effort"):
        length_penalty_coef(0, base, scale)
    with pytest.raises(ValueError, match="base"):
        length_penalty_coef(50, 0.5, scale)
    with pytest.raises(ValueError, match="underflow"):
        length_penalty_coef(50, 1000.0, 1.0)


@pytest.mark.parametrize("base,scale", [(8.0, 0.2), (50.0, 0.5), (1000.0, 0.7)])
def test_a_right_answer_beats_a_wrong_one_at_every_effort_and_length(base, scale):
    """The whole surface, efforts 1-100 x lengths 0-max_len, including penalties far above 1 at low
    effort (8 x 0.2 = 1.6 is the default's at effort 1): a right answer keeps a positive reward,
    shorter is better at a given effort, and lower effort penalises the same length more."""
    max_len = 64
    effort, length = torch.meshgrid(torch.arange(1, 101), torch.arange(0, max_len + 1), indexing="ij")
    args = (length.flatten(), effort.flatten(), max_len, base, scale)
    right = shaped_reward(torch.ones(effort.numel()), *args).view(effort.shape)
    wrong = shaped_reward(torch.zeros(effort.numel()), *args).view(effort.shape)
    assert bool((right > wrong).all()) and bool((wrong == 0).all())
    assert bool((right[:, 1:] < right[:, :-1]).all())  # each token longer costs, at every effort
    assert bool((right[1:, 1:] > right[:-1, 1:]).all())  # the same length costs more at a lower effort


def test_group_advantages_are_normalised_per_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.3, 0.3, 0.3, 0.3, 2.0, -1.0, 0.5, 0.5])
    adv = group_advantages(rewards, 4).view(3, 4)
    torch.testing.assert_close(adv.mean(1), torch.zeros(3, dtype=torch.float64), atol=1e-12, rtol=0)
    assert torch.all(adv[1] == 0)  # no signal in a group that scores alike
    assert float(adv[0].std(unbiased=False)) == pytest.approx(1.0, abs=1e-5)
    assert adv[2].argmax() == 0 and adv[2].argmin() == 1
    with pytest.raises(ValueError, match="groups"):
        group_advantages(torch.ones(5), 4)
    # two right answers a token apart: plain std normalisation makes that a full +-1 signal
    close = torch.tensor([0.99, 0.98])
    assert group_advantages(close, 2).abs().max() == pytest.approx(1.0, abs=1e-3)
    assert group_advantages(close, 2, std_floor=0.1).abs().max() == pytest.approx(0.05, abs=1e-3)


def test_stale_mask_and_version_checks():
    versions = torch.tensor([7, 6, 5, 4])
    assert stale_mask(versions, current=7, max_staleness=1).tolist() == [True, True, False, False]
    assert stale_mask(versions, current=7, max_staleness=0).tolist() == [True, False, False, False]
    with pytest.raises(ValueError, match="trainer version"):
        stale_mask(torch.tensor([8]), current=7, max_staleness=1)


def _grads(logp0, behaviour, adv, mask, **kw):
    logp = logp0.clone().requires_grad_()
    loss, stats = policy_loss(logp, behaviour, adv, mask, **kw)
    loss.backward()
    return loss, logp.grad, stats


def test_on_policy_loss_is_the_policy_gradient():
    """ratio = 1 everywhere: d loss / d logp = -A / (unmasked tokens), masked tokens get 0."""
    logp = torch.log(torch.rand(3, 5, dtype=torch.float64))
    adv = torch.tensor([1.5, -0.5, 0.0], dtype=torch.float64)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1, 3:] = False
    loss, grad, stats = _grads(logp, logp.clone(), adv, mask, clip_low=0.2, clip_high=0.28, is_cap=2.0)
    want = -adv[:, None].expand(3, 5) / mask.sum() * mask
    torch.testing.assert_close(grad, want)
    assert (stats["clip_frac"] == 0 and stats["truncated_frac"] == 0
            and stats["ratio_mean"] == pytest.approx(1.0))


def test_clipping_and_truncation_stop_the_gradient():
    behaviour = torch.zeros(1, 4, dtype=torch.float64)
    # ratios 1.1 (inside), 1.5 (above 1 + clip_high), 3.0 (above the IS cap), 0.5 (below 1 - clip_low)
    logp = torch.log(torch.tensor([[1.1, 1.5, 3.0, 0.5]], dtype=torch.float64))
    mask = torch.ones(1, 4, dtype=torch.bool)
    _, g_pos, stats = _grads(logp, behaviour, torch.tensor([1.0]), mask, clip_low=0.2, clip_high=0.28,
                             is_cap=2.0)
    # A > 0: clipped above 1.28 and truncated at 2.0 pass nothing; 0.5 (below) still learns
    assert g_pos[0, 1] == 0 and g_pos[0, 2] == 0
    assert g_pos[0, 0] == pytest.approx(-1.1 / 4) and g_pos[0, 3] == pytest.approx(-0.5 / 4)
    assert stats["truncated_frac"] == pytest.approx(0.25)
    loss_neg, g_neg, _ = _grads(logp, behaviour, torch.tensor([-1.0]), mask, clip_low=0.2, clip_high=0.28,
                                is_cap=2.0)
    # A < 0: the ratio 0.5 is clipped at 0.8 (no gradient); 1.5 keeps its gradient; 3.0 is truncated
    assert g_neg[0, 3] == 0 and g_neg[0, 1] == pytest.approx(1.5 / 4) and g_neg[0, 2] == 0
    assert float(loss_neg.detach()) == pytest.approx((1.1 + 1.5 + 2.0 + 0.8) / 4)


def test_percentile_nearest_rank():
    assert percentile([5.0], 90) == 5.0
    assert percentile(list(range(1, 11)), 90) == 9
    assert percentile([3, 1, 2], 50) == 2
    assert not math.isnan(percentile([0.0, 0.0], 99))


def test_a_run_that_learns_nothing_is_said_once():
    """All-equal rewards in every group (a policy that never finishes an answer): advantages 0."""
    watch = FlatRewardWatch(steps=3)
    flat = group_advantages(torch.zeros(8), group_size=4)
    learning = group_advantages(torch.tensor([0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]), group_size=4)
    # the run restarts
    assert [watch.update(a, 0.0) for a in (flat, flat, learning, flat, flat)] == [None] * 5
    said = watch.update(flat, 0.0)
    assert said is not None and "for 3 steps" in said and "mean task reward 0" in said
    assert watch.update(flat, 0.0) is None  # once
    assert FlatRewardWatch(steps=0).update(flat, 0.0) is None
