"""The `pretrain` stage's top-level config: one choice per group plus the run's identity."""
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from conf.data import DataConfig
from conf.launcher import LauncherConfig
from conf.logger import LoggerConfig
from conf.model import ModelConfig
from conf.optim import OptimConfig
from conf.trainer import TrainerConfig

PRETRAIN_DEFAULTS = [
    "_self_",
    {"model": "tiny"},
    {"data": "stdlib"},
    {"optim": "muon"},  # ARCHITECTURE.md §7: Muon + Sinkhorn + AdamW
    {"trainer": "default"},
    {"logger": "wandb"},
    {"launcher": "local"},
]


@dataclass
class PretrainConfig:
    defaults: list[Any] = field(default_factory=lambda: list(PRETRAIN_DEFAULTS))
    stage: str = "pretrain"
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    optim: OptimConfig = MISSING
    trainer: TrainerConfig = MISSING
    logger: LoggerConfig = MISSING
    launcher: LauncherConfig = MISSING
