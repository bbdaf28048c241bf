"""The RL reward over reasoning effort and response length (rl/algorithm.py shaped_reward), against
the linear penalty it replaced (task reward x (1 - c x length / max length)). Prints JSON: for
each, the smallest margin of a right answer over a wrong one on the whole surface (efforts 1-100,
lengths 0 to the maximum) and the efforts at which a right full-length answer scores at or below
a wrong one; rewards at the served efforts. `--plot` draws the surface (needs matplotlib:
`pip install -e ".[plots]"`).

    python -m bench.experiments.length_penalty [--base 8 --scale 0.2] \
        [--out bench/results/experiments/length-penalty-cpu.json] \
        [--plot bench/results/experiments/length-penalty.png]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench import provenance
from conf.rl import RLLoopConfig
from data.chat import EFFORT_MAX, EFFORT_MIN
from rl.algorithm import length_penalty_coef, shaped_reward

MAX_LEN = 100  # lengths are fractions of the maximum, so its value only sets the grid's resolution
SHOWN_EFFORTS = (1, 10, 25, 50, 75, 100)


def linear_reward(task_reward, length, effort, max_len, base, scale):
    """The penalty before: task reward x (1 - c(effort) x length / max_len)."""
    return task_reward.double() * (1 - length_penalty_coef(effort, base, scale) * length.double() / max_len)


def surface(reward, base: float, scale: float) -> dict:
    efforts = torch.arange(EFFORT_MIN, EFFORT_MAX + 1)
    effort, length = torch.meshgrid(efforts, torch.arange(0, MAX_LEN + 1), indexing="ij")
    args = (length.flatten(), effort.flatten(), MAX_LEN, base, scale)
    right = reward(torch.ones(effort.numel()), *args).view(effort.shape)
    wrong = reward(torch.zeros(effort.numel()), *args).view(effort.shape)
    margin = right - wrong
    at = {frac: round(frac * MAX_LEN) for frac in (0.25, 0.5, 1.0)}
    return {"right": right, "min_margin": float(margin.min()),
            "efforts_where_right_full_length_loses": [int(e) for e in efforts[margin[:, -1] <= 0]],
            "right_reward": {f"effort_{e}": {f"length_{frac}": round(float(right[e - EFFORT_MIN, i]), 4)
                                              for frac, i in at.items()} for e in SHOWN_EFFORTS}}


def plot(results: dict, base: float, scale: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, heat) = plt.subplots(1, 2, figsize=(12, 4.5))
    frac = torch.arange(0, MAX_LEN + 1) / MAX_LEN
    for i, e in enumerate(SHOWN_EFFORTS):
        color = f"C{i}"
        curves.plot(frac, results["shaped"]["right"][e - EFFORT_MIN], color=color, label=f"effort {e}")
        curves.plot(frac, results["linear"]["right"][e - EFFORT_MIN], color=color, linestyle="--")
    curves.axhline(0, color="black", linewidth=0.8)
    curves.set(xlabel="response length / max length", ylabel="reward of a right answer (a wrong one: 0)",
               title="exp(-c x length) (solid) against 1 - c x length (dashed)")
    curves.legend(fontsize=8)
    image = heat.imshow(results["shaped"]["right"].numpy(), origin="lower", aspect="auto", cmap="viridis",
                        extent=(0, 1, EFFORT_MIN, EFFORT_MAX), vmin=0, vmax=1)
    heat.set(xlabel="response length / max length", ylabel="reasoning effort",
             title=f"reward of a right answer, c = {scale:g} x {base:g}^((100 - effort) / 99)")
    fig.colorbar(image, ax=heat)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    defaults = RLLoopConfig()
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", type=float, default=defaults.length_penalty_base)
    ap.add_argument("--scale", type=float, default=defaults.length_penalty_scale)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args()
    results = {"shaped": surface(shaped_reward, args.base, args.scale),
               "linear": surface(linear_reward, args.base, args.scale)}
    if args.plot:
        plot(results, args.base, args.scale, args.plot)
    result = {**provenance.header("length_penalty"), "base": args.base, "scale": args.scale,
              **{name: {k: v for k, v in r.items() if k != "right"} for name, r in results.items()}}
    provenance.emit(result, args.out)


if __name__ == "__main__":
    main()
