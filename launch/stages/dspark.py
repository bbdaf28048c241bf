"""`flashtrain dspark dspark.target=RUN/checkpoints`: train the DSpark drafter against a frozen target."""
from pathlib import Path

from hydra.core.config_store import ConfigStore

from conf.dspark import DSPARK_TUNING, DSparkConfig
from launch.stages import register_stage

ConfigStore.instance().store(name="dspark_tuning", node=DSPARK_TUNING)


@register_stage("dspark", DSparkConfig, help="train the DSpark speculative drafter against a frozen target")
def dspark(cfg: DSparkConfig, run_dir: Path, config_yaml: str):
    from trainer.dspark import run_dspark

    return run_dspark(cfg, run_dir, config_yaml)
