"""Optimisers and schedules. `build_optimizer` routes parameters to optimisers by rule."""
from __future__ import annotations

import torch
from torch import nn

from conf.errors import ConfigError
from conf.optim import OptimConfig
from optim.schedule import lr_multiplier

__all__ = ["build_optimizer", "lr_multiplier", "param_groups"]

OPTIMIZERS = ("adamw",)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Matrices and tables decay; vectors and scalars (norms, biases, sinks, mHC gains) do not."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
              {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    if cfg.name not in OPTIMIZERS:
        raise ConfigError(f"optim.name={cfg.name!r}: expected one of {OPTIMIZERS}")
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr,
                             betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)
