"""Experiment tracking configs."""
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class LoggerConfig:
    name: str = "wandb"  # wandb | none
    # auto: online when a W&B API key is configured, offline otherwise.
    mode: str = "auto"  # auto | offline | online
    project: str = "flashtrain"
    entity: Optional[str] = None
    run_name: Optional[str] = None
    tags: list[str] = field(default_factory=list)


@dataclass
class WandbLoggerConfig(LoggerConfig):
    name: str = "wandb"


@dataclass
class NoLoggerConfig(LoggerConfig):
    name: str = "none"
