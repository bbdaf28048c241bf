"""Asynchronous vs synchronous RL, the same config side by side in one run; prints one JSON object.

Each mode trains `--steps` versions from the same SFT policy (`model.init_from`), on a local Ray
cluster, and reports samples trained per second of wall time and the trainer's idle fraction
(1 - time inside train_step / wall time) at its last step.

    python -m bench.system.rl_async --policy RUN/sft/checkpoints [--steps 10] \
        [--out bench/results/system/rl-async-cpu.json]
    (extra `key=value` arguments are passed to both runs as overrides)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import tempfile
from pathlib import Path

from bench import provenance


def _run(overrides: list[str], run_dir: Path) -> dict:
    from omegaconf import OmegaConf

    from launch.cli import compose
    from launch.stages.rl import builtin_sft_config
    from rl.run import run_rl

    cfg, _ = compose("rl", overrides + [f"hydra.run.dir={run_dir}"])
    yaml = OmegaConf.to_yaml(cfg)
    typed = OmegaConf.to_object(cfg)
    run_rl(typed, run_dir, yaml, builtin_sft_config(typed))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "loss" in r]
    last = steps[-1]
    return {"samples_per_s": last["samples_per_s"], "trainer_idle_frac": last["trainer_idle_frac"],
            "version_lag_mean": sum(r["version_lag_mean"] for r in steps) / len(steps),
            "stale_samples": sum(r["stale_samples"] for r in steps),
            "task_reward_first": steps[0]["task_reward"], "task_reward_last": last["task_reward"]}


def main() -> None:
    import conf
    from launch.stages import all_stages

    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=None)
    args, extra = ap.parse_known_args()
    conf.register({n: s.config for n, s in all_stages().items()})
    common = [f"model.init_from={args.policy}", f"rl.steps={args.steps}", "rl.save_every=0",
              "rl.eval_every=0", "rl.eval_prompts=1", "logger=none", "trainer.resume=none", *extra]
    import ray
    import torch

    result = {"bench": "rl_async", "device": "cpu", "cpus": os.cpu_count(), "machine": platform.machine(),
              "python": platform.python_version(), "torch": torch.__version__, "ray": ray.__version__,
              "date": datetime.date.today().isoformat(),
              "commit": provenance.commit(),
              "overrides": common}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("async", "sync"):
            result[mode] = _run(common + [f"rl.async={'true' if mode == 'async' else 'false'}"],
                                Path(tmp) / mode)
            print(json.dumps({mode: result[mode]}), flush=True)
    result["samples_per_s_ratio"] = result["async"]["samples_per_s"] / result["sync"]["samples_per_s"]
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
