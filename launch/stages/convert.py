"""`flashtrain convert import=DIR` / `flashtrain convert export=DIR checkpoint=CKPT`: the public
DeepSeek-V4.1-Flash checkpoint layout in and out (trainer/interop)."""
import os
from pathlib import Path

from conf.convert import ConvertConfig
from launch.stages import register_stage


@register_stage("convert", ConvertConfig,
                help="import / export the public DeepSeek-V4.1-Flash checkpoint layout")
def convert(cfg: ConvertConfig, run_dir: Path, config_yaml: str):
    from trainer.interop.run import run_convert

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # launched with launcher.nproc > 1: share the parts
        from trainer.distributed import init_distributed
        init_distributed()
    return run_convert(cfg, run_dir)
