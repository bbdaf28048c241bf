"""Expert-parallel training throughput per GPU against one GPU doing the same expert work, through
the real CLI and trainer. Three runs of `--model`, `--steps` steps each:

  one_gpu        one process with E / ep routed experts (one EP rank's share; top-k unchanged), so a
                 token costs the GPU what it costs an EP rank: the same rows per expert GEMM
  ep_overlap     `--ep` processes, trainer.expert_parallel=ep, the shared expert computed while the
                 rows travel (trainer.shared_expert_overlap=true)
  ep_no_overlap  the same with trainer.shared_expert_overlap=false

Prints one JSON object: each run's tokens/s per GPU, MFU and peak memory, the EP runs' ratio to
one GPU (issue 56's goal: >= 0.85 at EP=8 within one node) and their all-to-all share of step time
(CUDA events from each exchange's start to its wait: with the overlap an upper bound on the time
the exchange is exposed). Without a GPU the runs use the CPU over gloo: a smoke test.

    python -m bench.system.ep [--ep 8] [--model small] [--steps 20] [--seq-len 4096] [--micro-batch 2]
        [--kernels] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bench import provenance
from conf.model import SmallModelConfig, TinyModelConfig

REPO = Path(__file__).resolve().parents[2]
MODELS = {"small": SmallModelConfig, "tiny": TinyModelConfig}


def train(name: str, overrides: list[str], nproc: int, log_dir: Path) -> dict:
    """One `launch pretrain` run -> its steady windows' means (the first window holds the warm-up)."""
    run = log_dir / name
    cmd = [sys.executable, "-m", "launch", "pretrain", "logger=none", "trainer.progress=false",
           f"launcher.nproc={nproc}", "trainer.eval_every=0", "trainer.save_every=0",
           "trainer.save_at_end=false", "trainer.profile_comm=true", f"hydra.run.dir={run}", *overrides]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    log = log_dir / f"{name}.log"
    with open(log, "w") as f:  # streamed, so a timeout still leaves the log
        code = subprocess.call(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    if code != 0:
        sys.exit(f"{name}: training failed ({code}), see {log}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    windows = [r for r in rows if "tokens_per_s" in r]
    steady = windows[1:] or windows
    mean = lambda key: sum(r[key] for r in steady) / len(steady)  # noqa: E731
    out = {"gpus": nproc, "tokens_per_s_per_gpu": mean("tokens_per_s") / nproc, "mfu": mean("mfu"),
           "first_loss": rows[0]["loss"], "final_loss": steady[-1]["loss"], "windows": len(steady)}
    if "a2a_share" in steady[0]:
        out["all_to_all_share_of_step"] = mean("a2a_share")
    if "peak_mem_gib" in steady[0]:
        out["peak_mem_gib_rank0"] = max(r["peak_mem_gib"] for r in steady)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ep", type=int, default=max(torch.cuda.device_count(), 2))
    ap.add_argument("--model", choices=sorted(MODELS), default="small")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--kernels", action="store_true", help="model.kernels=true (the Triton kernels)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    cfg = MODELS[args.model]()
    experts, topk = cfg.n_routed_experts, cfg.n_activated_experts
    if experts % args.ep or experts // args.ep < topk:
        sys.exit(f"--ep {args.ep}: {args.model}'s {experts} experts must split into shares of at least "
                 f"top-k={topk}")
    common = [f"model={args.model}", f"data.seq_len={args.seq_len}",
              f"trainer.micro_batch_size={args.micro_batch}", f"trainer.max_steps={args.steps}",
              f"trainer.log_every={max(args.steps // 4, 1)}",
              "data.vocab_size=32000", f"model.kernels={str(args.kernels).lower()}"]
    logs = Path(tempfile.mkdtemp(prefix="bench-ep-"))
    result = {**provenance.header("expert_parallel"), "model": args.model, "kernels": args.kernels,
              "ep": args.ep, "routed_experts": experts, "experts_per_gpu": experts // args.ep, "top_k": topk,
              "seq_len": args.seq_len, "micro_batch_per_gpu": args.micro_batch, "steps": args.steps,
              "logs": str(logs)}
    if torch.cuda.is_available():
        result["device"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    result["one_gpu"] = train("one_gpu", common + [f"model.n_routed_experts={experts // args.ep}"], 1, logs)
    for name, overlap in (("ep_overlap", "true"), ("ep_no_overlap", "false")):
        run = train(name, common + [f"trainer.expert_parallel={args.ep}",
                                    f"trainer.shared_expert_overlap={overlap}"], args.ep, logs)
        run["per_gpu_vs_one_gpu"] = run["tokens_per_s_per_gpu"] / result["one_gpu"]["tokens_per_s_per_gpu"]
        result[name] = run
    provenance.emit(result, args.out)


if __name__ == "__main__":
    main()
