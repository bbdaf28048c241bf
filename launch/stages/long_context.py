"""`flashtrain long_context`: the indexer warm-up and sparse stages at growing lengths."""
from pathlib import Path

from conf.long_context import LongContextConfig
from launch.stages import register_stage


def check_schedule(cfg: LongContextConfig, world_size: int) -> None:
    from trainer.long_context import check_schedule as check  # conf and torch, not the whole trainer

    check(cfg, world_size)


@register_stage("long_context", LongContextConfig,
                help="indexer warm-up, then sparse training at growing sequence lengths",
                preflight=check_schedule)
def long_context(cfg: LongContextConfig, run_dir: Path, config_yaml: str):
    from trainer.long_context import run_long_context

    return run_long_context(cfg, run_dir, config_yaml)
