"""Residual stream precision under bf16 autocast, on the CPU: does holding the mHC streams in bf16
(`model.fp32_residual=false`, the default) train like fp32 streams? Three runs of `tiny` from the
same initial weights on the same batches: fp32 throughout (the target), bf16 autocast with fp32
streams, and bf16 autocast with bf16 streams. Prints JSON: each run's LM loss every `every` steps,
the mean over the last `tail` steps, and each autocast run's largest distance from the fp32 run's
loss curve (a moving mean over `tail` steps, so single-batch noise does not dominate).

    python -m bench.experiments.residual_precision [--steps 200] \
        [--out bench/results/experiments/residual-precision-cpu.json]

Data: the bytes of the committed Markdown (byte-level vocabulary of 256), in fixed order, so
the runs see the same text; the Muon + Sinkhorn + AdamW composite (`optim=muon`) as `tiny` trains.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import time
from pathlib import Path

import torch

from bench import provenance
from conf.model import TinyModelConfig
from conf.optim import MuonConfig
from model.transformer import Transformer
from optim import build_optimizer

ROOT = Path(__file__).resolve().parents[2]


def _corpus(seq_len: int) -> torch.Tensor:
    """[n, seq_len + 1] byte ids of the committed Markdown (README, docs/, model/), cut into rows; not
    a glob of the whole tree, which would pick up the .md reports runs write under outputs/."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "model").glob("*.md"))]
    text = b"\n".join(p.read_bytes() for p in files)
    ids = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    n = ids.numel() // (seq_len + 1)
    return ids[: n * (seq_len + 1)].view(n, seq_len + 1)


def _run(rows: torch.Tensor, steps: int, batch: int, autocast: bool, fp32_residual: bool) -> list[float]:
    cfg = dataclasses.replace(TinyModelConfig(vocab_size=256), fp32_residual=fp32_residual)
    torch.manual_seed(0)
    model = Transformer(cfg)
    opt = build_optimizer(model, MuonConfig(), zero_stage=0)
    losses = []
    for step in range(steps):
        at = (step * batch + torch.arange(batch)) % rows.shape[0]
        ids = rows[at]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(ids[:, :-1], labels=ids[:, 1:])
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.lm_loss.item())
    return losses


def _smooth(xs: list[float], k: int) -> list[float]:
    return [sum(xs[i - k + 1:i + 1]) / k for i in range(k - 1, len(xs))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--tail", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = _corpus(args.seq_len)
    runs = {"fp32": (False, True), "bf16_autocast_fp32_streams": (True, True),
            "bf16_autocast_bf16_streams": (True, False)}
    result = {"bench": "residual_precision", "device": "cpu", "torch": torch.__version__,
              "date": datetime.date.today().isoformat(), "commit": provenance.commit(), "model": "tiny",
              "steps": args.steps, "batch": args.batch, "seq_len": args.seq_len, "rows": rows.shape[0]}
    curves = {}
    for name, (autocast, fp32_residual) in runs.items():
        start = time.perf_counter()
        curves[name] = _run(rows, args.steps, args.batch, autocast, fp32_residual)
        result[name] = {"loss_every": curves[name][::args.every] + [curves[name][-1]],
                        "loss_tail_mean": sum(curves[name][-args.tail:]) / args.tail,
                        "seconds": time.perf_counter() - start}
        print(json.dumps({name: result[name]}), flush=True)
    target = _smooth(curves["fp32"], args.tail)
    for name in runs:
        if name != "fp32":
            mine = _smooth(curves[name], args.tail)
            result[name]["max_smoothed_loss_gap_to_fp32"] = max(abs(a - b) for a, b in zip(mine, target))
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
