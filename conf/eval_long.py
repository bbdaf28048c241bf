"""`flashtrain eval_long`: needle and key-value retrieval at growing context lengths."""
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from conf.data import DataConfig
from conf.model import ModelConfig


@dataclass
class RetrievalConfig:
    checkpoint: Optional[str] = None  # a checkpoint or a run's checkpoints/ dir (None: untrained weights)
    lengths: list[int] = field(default_factory=lambda: [256, 512, 1024, 2048])
    depths: list[float] = field(default_factory=lambda: [0.1, 0.5, 0.9])  # where the needle sits
    samples: int = 4  # per (task, length, depth)
    tasks: list[str] = field(default_factory=lambda: ["needle", "kv"])
    kv_pairs: int = 8  # key-value lines in the kv task
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda


@dataclass
class EvalLongConfig:
    defaults: list[Any] = field(default_factory=lambda: ["_self_", {"model": "tiny"}, {"data": "stdlib"}])
    stage: str = "eval_long"
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    eval: RetrievalConfig = field(default_factory=RetrievalConfig)
