"""Hydra structured configs. The dataclasses live in this package's modules and import
nothing heavier than omegaconf; `register()` puts them and their presets in Hydra's
ConfigStore, group by group."""
from __future__ import annotations

from conf.data import FilesDataConfig, HubDataConfig, StdlibDataConfig
from conf.launcher import LocalLauncherConfig, MultinodeLauncherConfig, RayLauncherConfig, SlurmLauncherConfig
from conf.logger import NoLoggerConfig, WandbLoggerConfig
from conf.long_context import FlashSchedule, SmallSchedule, TinySchedule
from conf.model import FlashModelConfig, SmallModelConfig, TinyModelConfig
from conf.optim import AdamWConfig, MuonConfig, RLAdamWConfig
from conf.trainer import TrainerConfig

GROUPS = {
    "model": {"tiny": TinyModelConfig, "small": SmallModelConfig, "flash": FlashModelConfig},
    "data": {"stdlib": StdlibDataConfig, "files": FilesDataConfig, "hub": HubDataConfig},
    "optim": {"adamw": AdamWConfig, "muon": MuonConfig, "rl": RLAdamWConfig},
    "trainer": {"default": TrainerConfig},
    "logger": {"wandb": WandbLoggerConfig, "none": NoLoggerConfig},
    "schedule": {"tiny": TinySchedule, "small": SmallSchedule, "flash": FlashSchedule},
    "launcher": {"local": LocalLauncherConfig, "multinode": MultinodeLauncherConfig,
                 "slurm": SlurmLauncherConfig, "ray": RayLauncherConfig},
}


def register(stage_configs: dict[str, type]) -> None:
    """Store every group preset and each stage's top-level config (named after the stage)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    for group, presets in GROUPS.items():
        for name, node in presets.items():
            cs.store(group=group, name=name, node=node)
    for stage, node in stage_configs.items():
        cs.store(name=stage, node=node)
