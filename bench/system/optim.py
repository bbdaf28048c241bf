"""Optimiser benchmarks, measured side by side in one run; prints one JSON object.

1. One optimiser step for the `small` model: the Muon + Sinkhorn + AdamW composite (docs/ARCHITECTURE.md §7)
   vs AdamW on every parameter. Gradients are random; the model is never run.
2. The Sinkhorn optimiser on one Engram-sized table (16M x 256): a sparse-row step (the rows a
   batch touches) vs the dense step over the whole table.

    python -m bench.system.optim [--rows 16000000] [--touched 786432] [--reps 10]
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import time

import torch

from bench import provenance
from conf.model import SmallModelConfig
from conf.optim import AdamWConfig, MuonConfig
from model.transformer import Transformer
from optim import build_optimizer
from optim.sinkhorn import Sinkhorn


def timed(fn, reps: int, device: torch.device) -> float:
    """Median seconds per call after two warm-up calls."""
    fn()
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def bench_step(device: torch.device, reps: int) -> dict:
    torch.manual_seed(0)
    cfg = dataclasses.replace(SmallModelConfig(), vocab_size=129_280)
    with device:
        model = Transformer(cfg)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    out = {"model": "small", "params": sum(p.numel() for p in model.parameters())}
    for name, ocfg in (("composite", MuonConfig()), ("adamw", AdamWConfig())):
        opt = build_optimizer(model, ocfg, zero_stage=0)
        out[f"{name}_step_s"] = timed(opt.step, reps, device)
        del opt
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out["composite_over_adamw"] = out["composite_step_s"] / out["adamw_step_s"]
    return out


def bench_sinkhorn_table(device: torch.device, rows: int, touched: int, reps: int) -> dict:
    torch.manual_seed(0)
    dim = 256
    table = torch.nn.Parameter(torch.randn(rows, dim, device=device) * 0.02)
    idx = torch.randint(0, rows, (touched,), device=device).unique()
    values = torch.randn(idx.numel(), dim, device=device) * 1e-3
    sparse_grad = torch.sparse_coo_tensor(idx.unsqueeze(0), values, (rows, dim)).coalesce()
    dense_grad = torch.zeros(rows, dim, device=device)
    dense_grad[idx] = values
    opt = Sinkhorn([table], lr=1e-3)

    def step(grad):
        def run():
            table.grad = grad
            opt.step()
        return run

    sparse_s = timed(step(sparse_grad), reps, device)
    dense_s = timed(step(dense_grad), reps, device)
    return {"table_rows": rows, "table_dim": dim, "touched_rows": int(idx.numel()), "sparse_step_s": sparse_s,
            "dense_step_s": dense_s, "dense_over_sparse": dense_s / sparse_s}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=16_000_000)
    ap.add_argument("--touched", type=int, default=8 * 4096 * 24)  # 8 x 4K tokens x 24 lookups
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    commit = provenance.commit()
    result = {
        "bench": "optim",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "commit": commit or None,
        "optimizer_step": bench_step(device, args.reps),
        "sinkhorn_table": bench_sinkhorn_table(device, args.rows, args.touched, args.reps),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
