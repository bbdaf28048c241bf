"""Loss curves of the same pretraining run with and without FP8 matmuls (trainer.fp8, trainer/fp8.py).

Each recipe trains the same model from the same seed on the same data through the real trainer
(`python -m launch pretrain`, one process), and the script reads the runs' metrics: the training
loss at every step, the validation loss at every `--eval-every` steps, tokens/s. Prints JSON: both
curves, and per recipe the mean training loss over the last `--tail` steps and the last validation
loss next to the baseline's. `--plot` draws the curves and their difference (needs matplotlib:
`pip install -e ".[plots]"`).

CPU (`tiny`, float8 emulated: the numerics of the fp8 GEMMs, not their speed):

    python -m bench.experiments.fp8_loss_curve --model tiny --emulate --steps 300 \
        --out bench/results/experiments/fp8-loss-curve-tiny-cpu.json \
        --plot bench/results/experiments/fp8-loss-curve-tiny-cpu.png

One GPU (`small`, real float8 GEMMs; compute capability 9.0+):

    python -m bench.experiments.fp8_loss_curve --model small --recipes none,rowwise,tensorwise,blockwise \
        --steps 300 --seq-len 2048 --micro-batch 8 \
        --out bench/results/experiments/fp8-loss-curve-small-h100.json \
        --plot bench/results/experiments/fp8-loss-curve-small-h100.png
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import provenance

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(recipe: str, args, run_dir: Path, port: int) -> subprocess.Popen:
    """Start one pretraining run (`finish` collects it)."""
    overrides = [f"model={args.model}", f"data.seq_len={args.seq_len}",
                 f"trainer.micro_batch_size={args.micro_batch}", f"trainer.max_steps={args.steps}",
                 f"trainer.fp8={recipe}",
                 f"trainer.fp8_emulate={str(args.emulate and recipe != 'none').lower()}",
                 "trainer.log_every=1", f"trainer.eval_every={args.eval_every}",
                 f"trainer.eval_batches={args.eval_batches}", "trainer.save_every=0",
                 "trainer.save_at_end=false",
                 "trainer.progress=false", "trainer.resume=none", f"trainer.seed={args.seed}", "logger=none",
                 f"hydra.run.dir={run_dir}", *args.override]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}")
    run_dir.mkdir(parents=True)
    logs = run_dir.parent
    with open(logs / f"{recipe}.out", "w") as out, open(logs / f"{recipe}.err", "w") as err:
        return subprocess.Popen([sys.executable, "-m", "launch", "pretrain", *overrides], cwd=REPO, env=env,
                                stdout=out, stderr=err)


def finish(recipe: str, proc: subprocess.Popen, run_dir: Path, timeout: float) -> dict:
    """Wait for a run (at most `timeout` seconds); its per-step training loss, validation losses and
    tokens/s."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise SystemExit(f"fp8_loss_curve: the {recipe} run took more than --timeout={timeout:g} s") from None
    stdout = (run_dir.parent / f"{recipe}.out").read_text()
    if proc.returncode != 0:
        stderr = (run_dir.parent / f"{recipe}.err").read_text()
        raise SystemExit(f"fp8_loss_curve: the {recipe} run failed (exit {proc.returncode}):\n"
                         f"{stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train_rows = [r for r in rows if "loss" in r]
    announced = [line for line in stdout.splitlines() if line.startswith("flashtrain: trainer.fp8")]
    return {"recipe": recipe, "conversion": announced[0] if announced else "trainer.fp8: none",
            "step": [r["step"] for r in train_rows], "loss": [r["loss"] for r in train_rows],
            "val_step": [r["step"] for r in rows if "val_loss" in r],
            "val_loss": [r["val_loss"] for r in rows if "val_loss" in r],
            # the first steps include start-up (compilation, autotuning): the median over the rest
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in train_rows[len(train_rows) // 4:])}


def summarise(runs: dict[str, dict], tail: int) -> dict:
    base = runs["none"]
    base_tail = statistics.fmean(base["loss"][-tail:])
    out = {}
    for recipe, run in runs.items():
        mean_tail = statistics.fmean(run["loss"][-tail:])
        out[recipe] = {"train_loss_last_steps": mean_tail, "val_loss_last": run["val_loss"][-1],
                       "train_loss_vs_baseline": mean_tail - base_tail,
                       "val_loss_vs_baseline": run["val_loss"][-1] - base["val_loss"][-1],
                       "max_abs_step_loss_gap": max(abs(a - b) for a, b in zip(run["loss"], base["loss"])),
                       "tokens_per_s": run["tokens_per_s"],
                       "tokens_per_s_vs_baseline": run["tokens_per_s"] / base["tokens_per_s"]}
    return out


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over `window` steps."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot(result: dict, path: Path, window: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, gap) = plt.subplots(1, 2, figsize=(12, 4.5))
    base = result["runs"]["none"]
    for i, (recipe, run) in enumerate(result["runs"].items()):
        color = f"C{i}"
        label = "bf16" if recipe == "none" and not result["emulate"] else recipe
        curves.plot(run["step"], run["loss"], color=color, alpha=0.25, linewidth=0.7)
        curves.plot(run["step"], smooth(run["loss"], window), color=color,
                    label=f"{label} (train, mean of {window})")
        curves.plot(run["val_step"], run["val_loss"], color=color, marker="o", linestyle="--",
                    label=f"{label} (val)")
        if recipe != "none":
            gap.plot(run["step"], smooth([a - b for a, b in zip(run["loss"], base["loss"])], window),
                     color=color, label=f"{recipe} - {'bf16' if not result['emulate'] else 'none'}")
    curves.set(xlabel="step", ylabel="loss", title=f"{result['model']}: training loss with and without fp8")
    curves.legend(fontsize=8)
    gap.axhline(0, color="black", linewidth=0.8)
    gap.set(xlabel="step", ylabel=f"loss difference (mean of {window} steps)",
            title="fp8 minus baseline, same data and seed")
    gap.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--recipes", default="none,rowwise", help="trainer.fp8 values; none first")
    ap.add_argument("--emulate", action="store_true", help="trainer.fp8_emulate=true (CPU)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--tail", type=int, default=50, help="steps the final training loss is averaged over")
    ap.add_argument("--smooth", type=int, default=20, help="steps each plotted point averages")
    ap.add_argument("--timeout", type=float, default=6 * 3600, help="seconds one run may take")
    ap.add_argument("--parallel", action="store_true",
                    help="start every run at once (CPU: a core each; their tokens/s then share the machine)")
    ap.add_argument("--override", action="append", default=[], help="one more trainer override (repeatable)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args()
    recipes = args.recipes.split(",")
    if recipes[0] != "none":
        raise SystemExit(f"--recipes={args.recipes}: the first must be none (the baseline)")
    runs = {}
    with tempfile.TemporaryDirectory(prefix="fp8-loss-curve-") as tmp:
        started = {}
        for recipe in recipes:
            started[recipe] = start(recipe, args, Path(tmp) / recipe, free_port())
            if not args.parallel:
                runs[recipe] = finish(recipe, started[recipe], Path(tmp) / recipe, args.timeout)
        for recipe in recipes:
            if recipe not in runs:
                runs[recipe] = finish(recipe, started[recipe], Path(tmp) / recipe, args.timeout)
            print(f"fp8_loss_curve: {recipe}: final loss {runs[recipe]['loss'][-1]:.4f}", file=sys.stderr,
                  flush=True)
    result = {**provenance.header("fp8_loss_curve"), "model": args.model, "emulate": args.emulate,
              "settings": {"steps": args.steps, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
                           "seed": args.seed, "overrides": args.override, "parallel": args.parallel},
              "summary": summarise(runs, args.tail), "runs": runs}
    provenance.emit(result, args.out)
    if args.plot:
        plot(result, args.plot, args.smooth)


if __name__ == "__main__":
    main()
