"""Stage registry. A stage is a module in this package that calls `register_stage`; the CLI
imports every module here, so adding a stage never touches the existing ones."""
from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# run(cfg, run_dir, resolved config as YAML) -> summary dict
StageFn = Callable[[Any, Path, str], Any]


@dataclass(frozen=True)
class Stage:
    name: str
    config: type  # the top-level structured config (a dataclass with a Hydra defaults list)
    run: StageFn
    help: str


_STAGES: dict[str, Stage] = {}


def register_stage(name: str, config: type, help: str) -> Callable[[StageFn], StageFn]:
    def wrap(fn: StageFn) -> StageFn:
        if name in _STAGES:
            raise RuntimeError(f"stage {name!r} registered twice")
        _STAGES[name] = Stage(name, config, fn, help)
        return fn

    return wrap


def all_stages() -> dict[str, Stage]:
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")
    return dict(sorted(_STAGES.items()))
