"""Optimiser and learning-rate schedule configs."""
from dataclasses import dataclass


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 3e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    # Schedule: linear warmup, then `schedule` down to lr * min_lr_ratio at trainer.max_steps.
    schedule: str = "cosine"  # cosine | linear | constant | wsd
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2  # wsd: share of the steps spent decaying


@dataclass
class AdamWConfig(OptimConfig):
    name: str = "adamw"
