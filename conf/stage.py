"""What every training stage's config composes: one choice per group (model, data, optim, trainer,
logger, launcher) and the stage's name. A stage subclasses `TrainingStage`, names itself in
`stage`, and adds its own sections; its group defaults come from `training_defaults`."""
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from conf.data import DataConfig
from conf.launcher import LauncherConfig
from conf.logger import LoggerConfig
from conf.model import ModelConfig
from conf.optim import OptimConfig
from conf.trainer import TrainerConfig


def training_defaults(optim: str = "muon", *extra: Any) -> list[Any]:
    """Hydra's defaults list of a training stage: `tiny` on the stdlib corpus, W&B, the local
    launcher, the optimiser preset `optim` (ARCHITECTURE.md §7: Muon + Sinkhorn + AdamW), then
    `extra` entries (more groups, or a root config applied over the presets)."""
    return ["_self_", {"model": "tiny"}, {"data": "stdlib"}, {"optim": optim}, {"trainer": "default"},
            {"logger": "wandb"}, {"launcher": "local"}, *extra]


@dataclass
class TrainingStage:
    defaults: list[Any] = field(default_factory=training_defaults)
    stage: str = MISSING
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    optim: OptimConfig = MISSING
    trainer: TrainerConfig = MISSING
    logger: LoggerConfig = MISSING
    launcher: LauncherConfig = MISSING
