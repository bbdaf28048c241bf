"""The `sft` stage: supervised fine-tuning on chat data (data/chat.py's format), loss on assistant
tokens only, the reasoning effort in the system prompt ("Reasoning Effort: {effort}").

`data` is the *pretraining* corpus config: the SFT run builds its tokenizer exactly as the
pretraining run did (same corpus, same cache), so token ids match the checkpoint in `model.init_from`.
`sft` says where the chat data comes from:
  source=builtin            problems of an RL task (tasks) with worked reasoning whose length
                            grows with the effort, generated offline and deterministically
  source=PATH|GLOB          .jsonl / .json / .parquet files, read with `datasets`
  source=NAME               anything else: a `datasets.load_dataset` name (hub or local script)
A row is either `messages_field` (a list of {role, content, reasoning?}) or, when
`prompt_field` is set, the flat schema prompt / response / reasoning. Its effort is `effort_field`
(1-100 or a tier name); rows without one get an effort drawn from `tiers`. Images (a model with a
vision tower): a turn's content as a list of {"type": "text", "text"} / {"type": "image", "image"}
parts, or `images_field` with `<image>` markers in the turns' text (data/sft.py).
"""
from dataclasses import dataclass, field
from typing import Any, Optional

from conf.stage import TrainingStage, training_defaults


@dataclass
class EffortTiers:
    """Named reasoning efforts (the value goes into the system prompt)."""
    low: int = 50
    high: int = 75
    max: int = 100


@dataclass
class SFTDataConfig:
    source: str = "builtin"  # builtin | path or glob of .jsonl/.json/.parquet | a `datasets` name
    hub_split: str = "train"  # split of a `datasets` name
    messages_field: str = "messages"  # a list of {role, content, reasoning?}
    # the flat schema (used when prompt_field is set): one user turn, one assistant turn
    prompt_field: Optional[str] = None
    response_field: str = "response"
    reasoning_field: Optional[str] = "reasoning"  # optional column (absent or null: no reasoning)
    effort_field: Optional[str] = "effort"  # optional column: 1-100 or a tier name (null: drawn from tiers)
    images_field: Optional[str] = "images"  # optional column: image(s) at the <image> markers of the turns
    max_samples: Optional[int] = None  # cap on conversations read (None = all)
    builtin_samples: int = 4000  # conversations of the built-in set
    builtin_task: str = "arithmetic"  # the tasks task it is generated from (a name or package.module:Class)
    builtin_task_kwargs: dict[str, Any] = field(default_factory=dict)
    builtin_seed: int = 0
    tiers: list[str] = field(default_factory=lambda: ["low", "high", "max"])  # efforts drawn from these
    val_fraction: float = 0.05  # conversations held out for validation
    split_seed: int = 1234
    seq_len: int = 256  # tokens per training row
    pack: bool = True  # several conversations per row (kept apart by doc_ids); false: one per row, padded


@dataclass
class SFTEvalConfig:
    """After training: greedy generation on held-out built-in problems, per effort tier."""
    problems: int = 32  # per tier (0: no generation eval); the built-in set holds these problems out
    max_new_tokens: int = 64  # built-in arithmetic answers take 4-25 tokens
    seed: int = 99  # problems are drawn from this seed (built-in training prompts excluded)
    packed_cache: bool = True  # FP4 / MXFP4 / FP8 decode cache, as inference stores it


# Fine-tuning values over the group presets (stored as the root config `sft_tuning` by
# launch/stages/sft.py); command-line overrides still win.
SFT_TUNING: dict[str, Any] = {
    "optim": {"lr": 3e-3, "warmup_steps": 20},
    "trainer": {"max_steps": 200, "eval_every": 50, "save_every": 100},
}


@dataclass
class SFTConfig(TrainingStage):
    # data: the pretraining corpus (its tokenizer); sft_tuning: SFT_TUNING over the group presets
    defaults: list[Any] = field(default_factory=lambda: training_defaults("muon", "sft_tuning"))
    stage: str = "sft"
    sft: SFTDataConfig = field(default_factory=SFTDataConfig)
    efforts: EffortTiers = field(default_factory=EffortTiers)
    eval: SFTEvalConfig = field(default_factory=SFTEvalConfig)
