"""`flashtrain generate`: a quick look at what a model writes, from a checkpoint."""
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from conf.data import DataConfig
from conf.model import ModelConfig


@dataclass
class SamplingConfig:
    checkpoint: Optional[str] = None  # a checkpoint or a run's checkpoints/ dir (None: untrained weights)
    prompt: str = MISSING
    max_new_tokens: int = 64
    temperature: float = 0.8  # 0: greedy
    top_p: float = 0.95
    seed: int = 0
    packed_cache: bool = True  # FP4 / MXFP4 / FP8 decode cache, as inference stores it
    max_batch: int = 64  # sequences decoded together (continuous batching)
    device: str = "auto"  # auto | cpu | cuda
    # image files read with the prompt (needs model.vision_n_layers > 0), one at each `<image>` of the
    # prompt in order (no marker: the images come first)
    images: list[str] = field(default_factory=list)


@dataclass
class GenerateConfig:
    defaults: list[Any] = field(default_factory=lambda: ["_self_", {"model": "tiny"}, {"data": "stdlib"}])
    stage: str = "generate"
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    generate: SamplingConfig = field(default_factory=SamplingConfig)
