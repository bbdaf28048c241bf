"""`flashtrain pretrain`: language-model pretraining."""
from pathlib import Path

from conf.pretrain import PretrainConfig
from launch.stages import register_stage


@register_stage("pretrain", PretrainConfig, help="pretrain a model on a text corpus")
def pretrain(cfg: PretrainConfig, run_dir: Path, config_yaml: str):
    from trainer.pretrain import run_pretrain  # heavy imports only when the stage runs

    return run_pretrain(cfg, run_dir, config_yaml)
