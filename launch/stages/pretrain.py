"""`flashtrain pretrain`: language-model pretraining."""
from pathlib import Path

from conf.pretrain import PretrainConfig
from launch.stages import register_stage


def check_layout(cfg: PretrainConfig, world_size: int) -> None:
    from trainer.fp8 import check_fp8
    from trainer.parallelize import check_training_layout  # torch, not the whole trainer

    tc = cfg.trainer
    check_training_layout(cfg.model, cfg.data.seq_len, world_size, tc.expert_parallel, tc.context_parallel)
    check_fp8(tc.fp8, tc.fp8_emulate, tc.precision, tc.zero_stage)


@register_stage("pretrain", PretrainConfig, help="pretrain a model on a text corpus", preflight=check_layout)
def pretrain(cfg: PretrainConfig, run_dir: Path, config_yaml: str):
    from trainer.pretrain import run_pretrain  # heavy imports only when the stage runs

    return run_pretrain(cfg, run_dir, config_yaml)
