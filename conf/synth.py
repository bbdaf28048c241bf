"""`flashtrain synth`: the policy proposes Python tasks (problem, reference solution, tests), the
sandbox filters them, the policy tries to solve the kept ones; writes the RL task pool."""
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from conf.data import DataConfig
from conf.model import ModelConfig


@dataclass
class SynthSettings:
    checkpoint: Optional[str] = None  # the policy: a checkpoint or a run's checkpoints/ dir (None: untrained)
    proposals: int = 64  # proposal prompts, one sample each
    attempts: int = 4  # solver samples per kept triple: its pass rate sets the difficulty reward
    effort: int = 50  # reasoning effort of every prompt
    max_new_tokens: int = 224  # per proposal (a templated triple is up to ~200 `tiny` tokens)
    solve_new_tokens: int = 96  # per solver attempt
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    difficulty_weight: float = 0.5  # w in the proposer reward c * ((1 - w) + w * 4p(1 - p))
    wall_s: float = 5.0  # sandbox limits of every filter and solver run
    cpu_s: float = 2.0
    memory_mb: int = 256
    sandbox_workers: int = 2  # sandbox runs at once (each a subprocess)
    max_batch: int = 64  # sequences decoded together
    packed_cache: bool = True  # FP4 / MXFP4 / FP8 decode cache, as inference stores it
    device: str = "auto"  # auto | cpu | cuda


@dataclass
class SynthConfig:
    defaults: list[Any] = field(default_factory=lambda: ["_self_", {"model": "tiny"}, {"data": "stdlib"}])
    stage: str = "synth"
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    synth: SynthSettings = field(default_factory=SynthSettings)
