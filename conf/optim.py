"""Optimiser and learning-rate schedule configs.

`name=adamw` trains everything with AdamW. `name=muon` routes parameters by rule (docs/ARCHITECTURE.md §7):
matrices to head-wise Muon, embedding / LM-head / Engram tables to the Sinkhorn optimiser,
the rest (norms, sinks, mHC gains) to AdamW. `rules` replaces the default routing.
"""
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class RouteRule:
    pattern: str  # regular expression searched in the parameter name
    optimizer: str  # muon | sinkhorn | adamw
    lr_mult: float = 1.0
    weight_decay: Optional[float] = None  # None: the optimiser's own default below
    min_dim: int = 0  # the rule applies to parameters with min_dim <= ndim <= max_dim
    max_dim: int = 8


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | muon
    lr: float = 3e-3
    weight_decay: float = 0.1  # AdamW, on >= 2-D parameters
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    # Muon (matrices, orthogonalised per head / group / expert)
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5
    muon_rms_mode: str = "moonlight"  # moonlight: 0.2*sqrt(max(A,B)) | fixed: update RMS = target
    muon_target_rms: float = 0.18
    muon_weight_decay: float = 0.1
    # Sinkhorn (embedding, LM head and Engram tables)
    sinkhorn_momentum: float = 0.95
    sinkhorn_gamma: float = 0.18
    sinkhorn_iters: int = 11
    sinkhorn_tau: float = 1e-3
    sinkhorn_weight_decay: float = 0.0
    rules: list[RouteRule] = field(default_factory=list)  # empty: the default routing of `name`
    # Schedule: linear warmup, then `schedule` down to lr * min_lr_ratio at trainer.max_steps.
    schedule: str = "cosine"  # cosine | linear | constant | wsd
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2  # wsd: share of the steps spent decaying


@dataclass
class AdamWConfig(OptimConfig):
    name: str = "adamw"


@dataclass
class MuonConfig(OptimConfig):
    name: str = "muon"
    # Muon's and Sinkhorn's updates have a fixed RMS (~0.2 lr), so they take a larger lr than
    # AdamW: on `tiny`, 1e-2 reaches val 4.75 in 100 steps where AdamW at 3e-3 reaches 5.30.
    lr: float = 1e-2


@dataclass
class RLAdamWConfig(OptimConfig):
    """Policy-gradient updates: AdamW at a fine-tuning lr, constant, no warm-up. On `tiny`
    after the built-in SFT (64 samples a version), 1e-4 raised the sampled accuracy slowly
    while 2e-4 and 3e-4 lowered it within 30 versions (docs/DESIGN.md, RL)."""
    name: str = "adamw"
    lr: float = 1e-4
    weight_decay: float = 0.0
    schedule: str = "constant"
    warmup_steps: int = 0
