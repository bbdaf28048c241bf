"""Expert-parallel training throughput: the `small` model at EP=2 over two GPUs (NCCL),
through the real CLI and trainer. Prints one JSON object: tokens/s, the all-to-all share of
step time (CUDA events around every exchange, forward and backward) and peak memory per GPU.

    python -m bench.system.ep [--steps 30] [--seq-len 4096] [--micro-batch 2] [--ep 2] [--kernels]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--kernels", action="store_true", help="model.kernels=true (the Triton kernels)")
    args = ap.parse_args()
    run = Path(tempfile.mkdtemp(prefix="bench-ep-"))
    cmd = [sys.executable, "-m", "launch", "pretrain", "model=small", "logger=none", "trainer.progress=false",
           f"launcher.nproc={args.ep}", f"trainer.expert_parallel={args.ep}", f"data.seq_len={args.seq_len}",
           f"trainer.micro_batch_size={args.micro_batch}", f"trainer.max_steps={args.steps}",
           "trainer.log_every=5", "trainer.eval_every=0", "trainer.save_every=0", "trainer.save_at_end=false",
           "trainer.profile_comm=true", "data.vocab_size=32000", f"model.kernels={str(args.kernels).lower()}",
           f"hydra.run.dir={run}"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    log = Path(os.environ.get("BENCH_LOG", run / "train.log"))
    with open(log, "w") as f:  # streamed, so a timeout still leaves the log
        code = subprocess.call(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    if code != 0:
        sys.exit(f"training failed ({code}), see {log}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in rows if "tokens_per_s" in r][1:]  # the first window includes warm-up
    mean = lambda key: sum(r[key] for r in steady) / len(steady)
    print(json.dumps({
        "bench": "expert_parallel",
        "device": f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}",
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "commit": os.environ.get("FLASHTRAIN_COMMIT"),
        "model": "small", "kernels": args.kernels, "ep": args.ep, "dp": 1, "seq_len": args.seq_len,
        "micro_batch_per_gpu": args.micro_batch,
        "steps": args.steps, "tokens_per_s": mean("tokens_per_s"), "mfu": mean("mfu"),
        "all_to_all_share_of_step": mean("a2a_share"),
        "peak_mem_gib_rank0": max(r["peak_mem_gib"] for r in steady),
        "final_loss": steady[-1]["loss"], "first_loss": rows[0]["loss"],
    }, indent=1))


if __name__ == "__main__":
    main()
