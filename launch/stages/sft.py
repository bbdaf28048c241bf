"""`flashtrain sft [model.init_from=RUN/checkpoints] [sft.source=...]`: supervised fine-tuning on chat
data."""
from pathlib import Path

from hydra.core.config_store import ConfigStore

from conf.sft import SFT_TUNING, SFTConfig
from launch.stages import register_stage

# The fine-tuning values SFTConfig's defaults list applies over the group presets.
ConfigStore.instance().store(name="sft_tuning", node=SFT_TUNING)


@register_stage("sft", SFTConfig, help="supervised fine-tuning on chat data")
def sft(cfg: SFTConfig, run_dir: Path, config_yaml: str):
    from trainer.sft import run_sft

    return run_sft(cfg, run_dir, config_yaml)
