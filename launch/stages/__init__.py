"""Stage registry. A stage is a module in this package that calls `register_stage`; the CLI
imports every module here, so adding a stage never touches the existing ones."""
from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

# run(cfg, run_dir, resolved config as YAML) -> summary dict
StageFn = Callable[[Any, Path, str], Any]
# preflight(cfg, world size) raises a UserError for a config its workers would reject
PreflightFn = Callable[[Any, int], None]


@dataclass(frozen=True)
class Stage:
    name: str
    config: type  # the top-level structured config (a dataclass with a Hydra defaults list)
    run: StageFn
    help: str
    # run by the CLI before a launcher starts the stage's workers (None: nothing to check)
    preflight: Optional[PreflightFn] = None


_STAGES: dict[str, Stage] = {}


def register_stage(name: str, config: type, help: str,
                   preflight: Optional[PreflightFn] = None) -> Callable[[StageFn], StageFn]:
    def wrap(fn: StageFn) -> StageFn:
        if name in _STAGES:
            raise RuntimeError(f"stage {name!r} registered twice")
        _STAGES[name] = Stage(name, config, fn, help, preflight)
        return fn

    return wrap


def all_stages() -> dict[str, Stage]:
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")
    return dict(sorted(_STAGES.items()))
