"""The `pretrain` stage's top-level config: one choice per group plus the run's identity."""
from dataclasses import dataclass

from conf.stage import TrainingStage


@dataclass
class PretrainConfig(TrainingStage):
    stage: str = "pretrain"
