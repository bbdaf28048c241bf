"""The RL objective: GRPO-style group-normalised advantages, a clipped importance ratio against
the rollout engine's own log-probs (truncated), effort-dependent length penalties and masking
of stale tokens. Pure functions on tensors; the loop lives in rl/coordinator.py.

Notation per response token t: logp = log pi_theta(token) under the weights being trained,
behaviour = the log-prob the rollout engine sampled it with (its weights, temperature and top-p),
version = the policy version that produced it (inference stamps every Generation).
"""
from __future__ import annotations

import math

import torch

from data.chat import EFFORT_MAX, EFFORT_MIN

MAX_PENALTY = 700.0  # exp(-700) ~ 1e-304, still a positive float64


def length_penalty_coef(effort: torch.Tensor | int, base: float, scale: float) -> torch.Tensor:
    """scale * base ** ((100 - effort) / 99): `scale` at effort 100, `base` times stronger at
    effort 1, exponential in between (each effort point lower multiplies it by base^(1/99))."""
    effort = torch.as_tensor(effort, dtype=torch.float64)
    if bool(((effort < EFFORT_MIN) | (effort > EFFORT_MAX)).any()):
        raise ValueError(f"effort must be in {EFFORT_MIN}-{EFFORT_MAX}, got {effort.tolist()}")
    if base < 1 or scale < 0:
        raise ValueError(f"length penalty needs base >= 1 and scale >= 0, got base={base}, scale={scale}")
    if scale * base > MAX_PENALTY:
        # exp(-coef) of a full-length answer would underflow float64 to 0, a wrong answer's reward
        raise ValueError(f"length penalty scale * base = {scale * base:g} is above {MAX_PENALTY:g}: a right "
                         "full-length answer's reward would underflow to 0")
    return scale * base ** ((EFFORT_MAX - effort) / (EFFORT_MAX - EFFORT_MIN))


def shaped_reward(task_reward: torch.Tensor, length: torch.Tensor, effort: torch.Tensor, max_len: int,
                  base: float, scale: float) -> torch.Tensor:
    """task reward * exp(-coef(effort) * length / max_len), per sample [N].

    The penalty multiplies the task reward, so a wrong answer scores 0 whatever its length and a
    group of wrong answers carries no length signal (without that, a weak policy learns to be
    short before it learns to be right). Being a factor in (0, 1] rather than 1 - coef * length,
    it never turns a right answer's reward negative: at every effort and length a right answer
    scores above a wrong one, however strong the penalty at low effort (coef > 1 included).
    For small coef * length it is 1 - coef * length / max_len to first order."""
    coef = length_penalty_coef(effort, base, scale)
    return task_reward.double() * torch.exp(-coef * length.double() / max_len)


def group_advantages(rewards: torch.Tensor, group_size: int, std_floor: float = 0.0,
                     eps: float = 1e-6) -> torch.Tensor:
    """rewards [G * n] in groups of n samples of one prompt -> (r - group mean) / max(group std,
    std_floor) (+ eps). A group whose samples all score alike carries no signal: advantages 0.
    The floor keeps tiny differences (two right answers a token apart in length) from being
    blown up to unit advantages, as plain std normalisation does."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.double().view(-1, group_size)
    std = r.std(dim=1, unbiased=False, keepdim=True).clamp(min=std_floor)
    return ((r - r.mean(dim=1, keepdim=True)) / (std + eps)).view(-1)


class FlatRewardWatch:
    """Counts consecutive training batches whose every group scored all its samples alike (all
    advantages 0, so the policy loss and its gradient are 0: nothing is learned), and says once
    when the count reaches `steps` (0: never). A policy that never finishes an answer scores 0
    everywhere and would otherwise "succeed" in silence."""

    def __init__(self, steps: int):
        self.steps, self.run, self.warned = steps, 0, False

    def update(self, advantages: torch.Tensor, task_reward: float) -> str | None:
        """The batch's advantages -> the warning to print, the first time the run is long enough."""
        self.run = self.run + 1 if bool((advantages == 0).all()) else 0
        if self.steps <= 0 or self.run < self.steps or self.warned:
            return None
        self.warned = True
        return (f"flashtrain rl: warning: for {self.run} steps every sample scored the same as the rest of "
                f"its group (mean task reward {task_reward:.3g}): advantages and policy loss are 0 and the "
                "policy does not change; check rl.task's rewards, rl.max_new_tokens and the starting policy")


def stale_mask(versions: torch.Tensor, current: int, max_staleness: int) -> torch.Tensor:
    """versions [...] of the policy that produced each token -> True where the token may train:
    at most `max_staleness` versions older than `current` (a version from the future is a bug)."""
    if bool((versions > current).any()):
        raise ValueError(f"token versions {int(versions.max())} > trainer version {current}")
    return current - versions <= max_staleness


def policy_loss(logp: torch.Tensor, behaviour: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip_low: float, clip_high: float, is_cap: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level clipped surrogate with truncated importance sampling.

    logp, behaviour, mask [N, T]; advantages [N] (one per sample, broadcast over its tokens).
    ratio = pi_theta / pi_behaviour, truncated at is_cap (its value; a truncated token keeps the
    capped weight and passes no gradient through the ratio). The loss is
    -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A), averaged over unmasked tokens.
    Returns (loss, stats: clip fraction, truncated fraction, mean ratio)."""
    ratio = torch.exp(logp - behaviour)
    truncated = ratio.detach() > is_cap
    ratio = torch.where(truncated, torch.full_like(ratio, is_cap), ratio)
    adv = advantages.to(logp.dtype).unsqueeze(-1).expand_as(logp)
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high)
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    m = mask.to(logp.dtype)
    n = m.sum().clamp(min=1)
    loss = -(surrogate * m).sum() / n
    with torch.no_grad():
        was_clipped = ((ratio * adv) != surrogate) & mask
        stats = {"clip_frac": float(was_clipped.sum() / n),
                 "truncated_frac": float((truncated & mask).sum() / n),
                 "ratio_mean": float((ratio * m).sum() / n)}
    return loss, stats


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of a non-empty list."""
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))])
