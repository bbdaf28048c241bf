"""Learning-rate schedules as multipliers of the peak lr, for `torch.optim.lr_scheduler.LambdaLR`.

All start with a linear warmup from lr/warmup to lr. After it:
  cosine    half cosine down to min_lr_ratio at max_steps
  linear    straight line down to min_lr_ratio at max_steps
  constant  stays at the peak
  wsd       warmup-stable-decay: flat, then a linear decay over the last decay_fraction
"""
from __future__ import annotations

import math
from collections.abc import Callable

from conf.errors import ConfigError
from conf.optim import OptimConfig

SCHEDULES = ("cosine", "linear", "constant", "wsd")


def lr_multiplier(cfg: OptimConfig, max_steps: int) -> Callable[[int], float]:
    if cfg.schedule not in SCHEDULES:
        raise ConfigError(f"optim.schedule={cfg.schedule!r}: expected one of {SCHEDULES}")
    if cfg.warmup_steps < 0:
        raise ConfigError(f"optim.warmup_steps={cfg.warmup_steps}: must be >= 0")
    warmup, floor = cfg.warmup_steps, cfg.min_lr_ratio
    decay_start = warmup
    if cfg.schedule == "wsd":
        decay_start = max(warmup, int(round(max_steps * (1 - cfg.decay_fraction))))

    def multiplier(step: int) -> float:
        # `step` = optimizer steps already taken; the lr of step s+1 is multiplier(s)
        if step < warmup:
            return (step + 1) / warmup
        if cfg.schedule == "constant":
            return 1.0
        span = max(max_steps - decay_start, 1)
        progress = min(max(step - decay_start, 0) / span, 1.0)
        if cfg.schedule == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0 - (1 - floor) * progress  # linear, and wsd's decay phase

    return multiplier
