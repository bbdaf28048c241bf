"""`flashtrain rl`: GRPO-style RL with reasoning-effort length penalties on Ray."""
from pathlib import Path

from conf.rl import RLConfig
from launch.stages import register_stage


@register_stage("rl", RLConfig, help="RL post-training (rollout, reward and trainer actors on Ray)")
def rl(cfg: RLConfig, run_dir: Path, config_yaml: str):
    from rl.run import run_rl  # heavy imports only when the stage runs

    return run_rl(cfg, run_dir, config_yaml)
