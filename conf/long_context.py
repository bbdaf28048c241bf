"""The `long_context` stage: sub-stages of increasing sequence length (docs/ARCHITECTURE.md §3, §7).

Each sub-stage has its own sequence length, token budget, lr, micro-batch, YaRN settings
for the compressed layers and indexer regime:
  dense_warmup  only the indexers train, towards the dense attention distribution, while the
                model attends to every visible entry (DeepSeek-V3.2's warm-up)
  sparse        everything trains with top-k selection and the layer-20 candidate pool exactly
                as inference uses them; the indexers keep their KL on the selected set
A sub-stage starts from the previous one's final checkpoint. The schedule group picks the
sub-stages for a model size: at full scale 64K, then 1M tokens from the 34T-token mark.
"""
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from conf.stage import TrainingStage, training_defaults


@dataclass
class ContextStage:
    name: str = MISSING
    seq_len: int = MISSING
    tokens: int = MISSING  # token budget: steps = tokens / (global batch x seq_len), rounded up
    lr: float = 1e-3
    micro_batch_size: int = 1
    indexer: str = "sparse"  # dense_warmup | sparse
    rope_factor: Optional[float] = None  # YaRN on compressed layers (None: the model's)
    original_seq_len: Optional[int] = None


@dataclass
class ScheduleConfig:
    name: str = "custom"
    stages: list[ContextStage] = field(default_factory=list)


def _tiny() -> list[ContextStage]:
    return [ContextStage("indexer_warmup", 512, 60 * 8 * 512, lr=1e-2, micro_batch_size=8,
                         indexer="dense_warmup"),
            ContextStage("sparse_512", 512, 60 * 8 * 512, lr=3e-3, micro_batch_size=8),
            ContextStage("sparse_1k", 1024, 40 * 4 * 1024, lr=3e-3, micro_batch_size=4,
                         rope_factor=2.0, original_seq_len=512)]


def _small() -> list[ContextStage]:
    return [ContextStage("indexer_warmup", 4096, 200 * 8 * 4096, lr=1e-3, micro_batch_size=8,
                         indexer="dense_warmup"),
            ContextStage("sparse_16k", 16384, 2_000 * 4 * 16384, lr=3e-4, micro_batch_size=4),
            ContextStage("sparse_64k", 65536, 500 * 65536, lr=2e-4, micro_batch_size=1,
                         rope_factor=4.0, original_seq_len=16384)]


def _flash() -> list[ContextStage]:
    # ARCHITECTURE.md §3 and §7: the DeepSeek-V3.2 warm-up (lr 1e-3, 1000 steps), sparse from 64K, 1M at 34T
    return [ContextStage("indexer_warmup", 65536, 1000 * 16 * 65536, lr=1e-3, micro_batch_size=1,
                         indexer="dense_warmup"),
            ContextStage("sparse_64k", 65536, 34 * 10**12, lr=2.2e-4, micro_batch_size=1),
            ContextStage("sparse_1m", 1_048_576, 11 * 10**12, lr=7.3e-6, micro_batch_size=1,
                         rope_factor=16.0, original_seq_len=65536)]


@dataclass
class TinySchedule(ScheduleConfig):
    name: str = "tiny"
    stages: list[ContextStage] = field(default_factory=_tiny)


@dataclass
class SmallSchedule(ScheduleConfig):
    name: str = "small"
    stages: list[ContextStage] = field(default_factory=_small)


@dataclass
class FlashSchedule(ScheduleConfig):
    name: str = "flash"
    stages: list[ContextStage] = field(default_factory=_flash)


@dataclass
class LongContextConfig(TrainingStage):
    defaults: list[Any] = field(default_factory=lambda: training_defaults("muon", {"schedule": "tiny"}))
    stage: str = "long_context"
    schedule: ScheduleConfig = MISSING
