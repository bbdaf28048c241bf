"""The `inspect` stage: build a model on the meta device and account for it."""
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from conf.model import ModelConfig


@dataclass
class InspectOptions:
    json: bool = False  # one JSON object instead of the table
    vocab_size: int = 129_280  # for models whose vocabulary comes from a tokenizer


@dataclass
class InspectConfig:
    defaults: list[Any] = field(default_factory=lambda: ["_self_", {"model": "flash"}])
    stage: str = "inspect"
    model: ModelConfig = MISSING
    inspect: InspectOptions = field(default_factory=InspectOptions)
