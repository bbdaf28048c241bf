"""Asynchronous vs synchronous RL, the same config side by side in one run; prints one JSON object.

Each mode trains `--steps` versions from the same SFT policy on a local Ray cluster and reports
samples trained per second of wall time and the trainer's idle fraction (1 - time inside
train_step / wall time) at its last version, and per version the curves of both: reward,
staleness (version lag, stale samples and tokens), throughput.

    python -m bench.system.rl_async [--policy RUN/sft/checkpoints] [--steps 10] [--device cpu|cuda] \
        [--trainer-share 0.5] [--out bench/results/system/rl-async-cpu.json] [key=value ...]

--policy: the SFT checkpoint both modes start from (`model.init_from`); without it the built-in
SFT (`flashtrain rl`'s, rl.sft_overrides) runs first, once, and both start from its checkpoint.
--device cuda: every actor on the one visible GPU, as Ray GPU fractions: the trainer gets
--trainer-share of it, the rollout workers split the rest (explicit rl.trainer_gpus /
rl.rollout_gpus overrides win). Extra `key=value` arguments are passed to both runs as overrides
(the built-in SFT takes their model.*, data.* and rl.sft_overrides, as `flashtrain rl` does).
--out is rewritten after each mode, so a run cut short still leaves the finished mode's numbers.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from bench import provenance

CURVE_KEYS = ("step", "elapsed_s", "samples_per_s", "trainer_idle_frac", "rollout_tokens_per_s",
              "version_lag_mean", "stale_samples", "stale_tokens", "task_reward", "reward", "loss",
              "behaviour_kl")


def _typed(overrides: list[str]):
    from omegaconf import OmegaConf

    from launch.cli import compose

    return OmegaConf.to_object(compose("rl", overrides)[0])


def _run(overrides: list[str], run_dir: Path) -> dict:
    from omegaconf import OmegaConf

    from launch.cli import compose
    from launch.stages.rl import builtin_sft_config
    from rl.run import run_rl

    cfg, _ = compose("rl", overrides + [f"hydra.run.dir={run_dir}"])
    yaml = OmegaConf.to_yaml(cfg)
    typed = OmegaConf.to_object(cfg)
    start = time.perf_counter()
    run_rl(typed, run_dir, yaml, builtin_sft_config(typed))
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "loss" in r]
    last = steps[-1]
    return {"samples_per_s": last["samples_per_s"], "trainer_idle_frac": last["trainer_idle_frac"],
            "rollout_tokens_per_s": last["rollout_tokens_per_s"],
            "version_lag_mean": sum(r["version_lag_mean"] for r in steps) / len(steps),
            "stale_samples": sum(r["stale_samples"] for r in steps),
            "task_reward_first": steps[0]["task_reward"], "task_reward_last": last["task_reward"],
            "wall_s": wall,  # the whole run: Ray and actor start-up, first and last evaluation
            "curve": [{k: r[k] for k in CURVE_KEYS if k in r} for r in steps],
            "evals": [r for r in rows if "loss" not in r]}


def _builtin_policy(overrides: list[str], run_dir: Path) -> str:
    """The built-in SFT's newest checkpoint, made as `flashtrain rl` makes it with no model.init_from."""
    from launch.stages.rl import builtin_sft_config
    from rl.run import builtin_sft_policy

    typed = _typed(overrides)
    return str(builtin_sft_policy(typed, run_dir, builtin_sft_config(typed)))


def _gpu_overrides(overrides: list[str], trainer_share: float) -> list[str]:
    """Ray GPU fractions that put the trainer and every rollout worker on one GPU."""
    if any(o.startswith(("rl.trainer_gpus=", "rl.rollout_gpus=")) for o in overrides):
        return []  # the caller placed them
    rl = _typed(overrides).rl
    if rl.trainer_workers != 1:
        raise SystemExit(f"rl_async: --device cuda shares one GPU, which holds one trainer rank; got "
                         f"rl.trainer_workers={rl.trainer_workers}")
    if not 0 < trainer_share < 1:
        raise SystemExit(f"rl_async: --trainer-share={trainer_share}: expected a share in (0, 1)")
    # Ray takes GPU fractions to 4 decimals; round down so the shares never add up past the GPU
    rollout = math.floor((1 - trainer_share) / rl.rollout_workers * 1e4 + 1e-6) / 1e4
    return [f"rl.trainer_gpus={trainer_share}", f"rl.rollout_gpus={rollout}"]


def main() -> None:
    import conf
    from launch.stages import all_stages

    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", default=None, help="SFT checkpoint(s) to start from (default: run the "
                    "built-in SFT first)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--trainer-share", type=float, default=0.5,
                    help="--device cuda: the trainer's share of the GPU (rollout workers split the rest)")
    ap.add_argument("--out", default=None)
    args, extra = ap.parse_known_args()
    bad = [a for a in extra if "=" not in a or a.startswith("-")]
    if bad:
        raise SystemExit(f"rl_async: unknown arguments {' '.join(bad)} (overrides are key=value)")
    import ray
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("rl_async: --device cuda but torch sees no GPU")
    conf.register({n: s.config for n, s in all_stages().items()})
    common = [f"rl.steps={args.steps}", "rl.save_every=0", "rl.eval_every=0", "rl.eval_prompts=1",
              "logger=none", "trainer.resume=none", *extra]
    if args.device == "cuda":
        common += _gpu_overrides(common, args.trainer_share)
    result = {"bench": "rl_async",
              "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "cpus": os.cpu_count(), "machine": platform.machine(),
              "python": platform.python_version(), "torch": torch.__version__, "ray": ray.__version__,
              "date": datetime.date.today().isoformat(),
              "commit": provenance.commit(),
              "argv": sys.argv[1:]}

    def write() -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        policy = args.policy
        if policy is None:
            start = time.perf_counter()
            policy = _builtin_policy(common, Path(tmp) / "builtin")
            result["sft_s"] = time.perf_counter() - start
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # the SFT ran in this process; the actors need the GPU
        common.insert(0, f"model.init_from={policy}")
        result["overrides"] = common
        for mode in ("async", "sync"):
            result[mode] = _run(common + [f"rl.async={'true' if mode == 'async' else 'false'}"],
                                Path(tmp) / mode)
            print(json.dumps({mode: {k: v for k, v in result[mode].items() if k not in ("curve", "evals")}}),
                  flush=True)
            write()
    result["samples_per_s_ratio"] = result["async"]["samples_per_s"] / result["sync"]["samples_per_s"]
    print(json.dumps(result, indent=1))
    write()


if __name__ == "__main__":
    main()
