"""`flashtrain distill`: on-policy full-vocabulary distillation from many domain teachers on Ray."""
from pathlib import Path

from conf.distill import DistillConfig
from launch.stages import register_stage


@register_stage("distill", DistillConfig,
                help="on-policy distillation from per-domain teachers (full-vocabulary reverse KL, Ray)")
def distill(cfg: DistillConfig, run_dir: Path, config_yaml: str):
    from launch.stages.rl import builtin_sft_config
    from rl.distill.run import run_distill  # heavy imports only when the stage runs

    return run_distill(cfg, run_dir, config_yaml, builtin_sft_config(cfg))
