"""`flashtrain generate generate.prompt=... [generate.checkpoint=RUN/checkpoints]`: prefill the
prompt, decode from the cache, print the continuation (and write generation.json)."""
from pathlib import Path

from conf.generate import GenerateConfig
from launch.stages import register_stage


@register_stage("generate", GenerateConfig, help="sample a continuation of a prompt from a checkpoint")
def generate(cfg: GenerateConfig, run_dir: Path, config_yaml: str):
    from trainer.generate import run_generate

    return run_generate(cfg, run_dir)
