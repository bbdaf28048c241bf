"""`flashtrain synth synth.checkpoint=SFT_RUN/checkpoints`: task synthesis, the policy's own
Python tasks filtered in the sandbox, written as the pool of `rl.task=synth`."""
from pathlib import Path

from conf.synth import SynthConfig
from launch.stages import register_stage


@register_stage("synth", SynthConfig, help="the policy proposes Python tasks with tests; the sandbox keeps "
                "the verifiable, solvable, non-trivial ones as an RL task pool")
def synth(cfg: SynthConfig, run_dir: Path, config_yaml: str):
    from rl.synthesis import run_synth

    (Path(run_dir)).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / "config.yaml").write_text(config_yaml)
    return run_synth(cfg, run_dir)
