"""Experiment tracking: Weights & Biases (imported lazily) or nothing.

Only rank 0 tracks. With logger.mode=auto the run is online when an API key is configured
and offline otherwise, so a fresh machine never blocks on a login prompt.
"""
from __future__ import annotations

import netrc
import os
from pathlib import Path
from typing import Any, Optional

from conf.errors import ConfigError
from conf.logger import LoggerConfig

MODES = ("auto", "offline", "online")
LOGGERS = ("wandb", "none")


class NullTracker:
    run_id: Optional[str] = None

    def log(self, row: dict[str, Any], step: int) -> None:
        pass

    def restore(self, rows: list[dict[str, Any]]) -> int:
        return 0

    def finish(self) -> None:
        pass


def _has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def resolve_mode(cfg: LoggerConfig) -> str:
    if cfg.mode not in MODES:
        raise ConfigError(f"logger.mode={cfg.mode!r}: expected one of {MODES}")
    if cfg.mode != "auto":
        return cfg.mode
    env = os.environ.get("WANDB_MODE")
    if env in ("offline", "online", "disabled"):
        return env
    return "online" if _has_api_key() else "offline"


class WandbTracker:
    def __init__(self, cfg: LoggerConfig, run_dir: Path, config: dict, run_id: Optional[str]):
        import wandb

        self._wandb = wandb
        self.run = wandb.init(project=cfg.project, entity=cfg.entity, name=cfg.run_name, tags=list(cfg.tags),
                              dir=str(run_dir), config=config, mode=resolve_mode(cfg),
                              id=run_id, resume="allow" if run_id else None)
        self.run_id = self.run.id
        # the step W&B accepts next: a resumed run's history already ends below it, and W&B drops
        # (with a warning per row) any row logged at an earlier step
        self.next_step = int(self.run.step or 0)

    def log(self, row: dict[str, Any], step: int) -> None:
        if step < self.next_step:  # W&B has this step from the segment before a resume: same values
            return
        # W&B charts numbers; a list (an RL step's prompt ids) stays in metrics.jsonl only
        self.run.log({k: v for k, v in row.items() if not isinstance(v, (list, tuple, dict))}, step=step)
        self.next_step = step

    def restore(self, rows: list[dict[str, Any]]) -> int:
        """Log the rows of metrics.jsonl (those the resumed checkpoint covers) that W&B never
        received: a killed process loses what its W&B client had queued but not yet handed to
        W&B's own service, while metrics.jsonl was written row by row. Returns how many."""
        restored = 0
        for row in rows:
            if "step" in row and row["step"] >= self.next_step:
                self.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])
                restored += 1
        return restored

    def finish(self) -> None:
        self.run.finish()


def build_tracker(cfg: LoggerConfig, run_dir: Path, config: dict, run_id: Optional[str], rank: int):
    if cfg.name not in LOGGERS:
        raise ConfigError(f"logger.name={cfg.name!r}: expected one of {LOGGERS}")
    if rank != 0 or cfg.name == "none":
        return NullTracker()
    return WandbTracker(cfg, run_dir, config, run_id)
