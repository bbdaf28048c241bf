"""`flashtrain eval_long`: needle / key-value retrieval accuracy and top-k / pool hit rates by length."""
from pathlib import Path

from conf.eval_long import EvalLongConfig
from launch.stages import register_stage


@register_stage("eval_long", EvalLongConfig, help="long-context retrieval eval (needle, key-value)")
def eval_long(cfg: EvalLongConfig, run_dir: Path, config_yaml: str):
    from trainer.eval_long import run_eval_long

    return run_eval_long(cfg, run_dir)
