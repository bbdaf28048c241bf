"""The `dspark` stage: train the DSpark drafter (docs/ARCHITECTURE.md §8) against a frozen target.

`model` is the *target's* config (the drafter's shape comes from its `dspark_*` keys) and `data` the
pretraining corpus (its tokenizer, so ids match the target). `dspark.target` names the target's
weights: a flashtrain checkpoint, a run's checkpoints/ dir or run dir, or a public-layout directory.
`dspark.source` says what the drafter learns on:
  corpus    the pretraining corpus's rows
  samples   the target's own continuations of prompts cut from those rows (temperature
            `sample_temperature`), generated once when the run starts
"""
from dataclasses import dataclass, field
from typing import Any, Optional

from conf.stage import TrainingStage, training_defaults


@dataclass
class DSparkTrainConfig:
    target: Optional[str] = None  # the frozen target's weights (required)
    source: str = "corpus"  # corpus | samples
    samples: int = 256  # rows of target samples (source=samples), each data.seq_len tokens
    sample_prompt_tokens: int = 16  # each sample continues this many tokens of a corpus row
    sample_temperature: float = 1.0
    anchor_stride: int = 2  # a draft block is trained at every this-many-th position of a row


# Drafter-training values over the group presets (stored as the root config `dspark_tuning` by
# launch/stages/dspark.py); command-line overrides still win.
DSPARK_TUNING: dict[str, Any] = {
    "optim": {"lr": 3e-3, "warmup_steps": 10},
    "trainer": {"max_steps": 200, "eval_every": 50, "save_every": 100},
}


@dataclass
class DSparkConfig(TrainingStage):
    defaults: list[Any] = field(default_factory=lambda: training_defaults("muon", "dspark_tuning"))
    stage: str = "dspark"
    dspark: DSparkTrainConfig = field(default_factory=DSparkTrainConfig)
