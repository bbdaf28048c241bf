"""`flashtrain rl`: GRPO-style RL with reasoning-effort length penalties on Ray."""
from pathlib import Path

from conf.rl import RLConfig
from launch.stages import register_stage


def builtin_sft_config(cfg):
    """The sft stage's config with rl.sft_overrides: what RL and distillation train their starting
    policy with when model.init_from names none."""
    from omegaconf import OmegaConf

    from launch.cli import compose

    return OmegaConf.to_object(compose("sft", list(cfg.rl.sft_overrides))[0])


@register_stage("rl", RLConfig, help="RL post-training (rollout, reward and trainer actors on Ray)")
def rl(cfg: RLConfig, run_dir: Path, config_yaml: str):
    from rl.run import run_rl  # heavy imports only when the stage runs

    return run_rl(cfg, run_dir, config_yaml, builtin_sft_config(cfg))
