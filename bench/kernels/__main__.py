"""Triton kernels against their baselines on one GPU, each measured side by side in one run;
prints one JSON object (and writes it to --out: one run at one commit, never merged into an
older file).

Sections (each module's `bench(device) -> dict`):
  quant      KV quantise+pack / unpack+dequantise: GB/s as a fraction of device copy bandwidth
  attention  sparse attention fwd / fwd+bwd at 8K-128K context vs dense causal SDPA
  attention_floor  the same kernels at `small`'s step shape vs their traffic floor (measured
             gather and fp32 atomic-add rates on the kernels' own index tensor)
  attention_configs  every one-pass config of those kernels at that shape, side by side
  indexer    indexer scoring TFLOP/s; Reindex cost at 16K vs 128K (pool-bounded); top-k
  mhc        fused single-pass mHC vs the eager composition; bytes moved vs (2n+2)·d
  engram     hash + gather of random rows: GB/s vs copy bandwidth, GPU and pinned-host table
  small_ops  rotary and the mHC stream mixes at the step's shape vs their PyTorch references
  e2e        (bench/system/step.py) the `small` training step, kernels off vs on: tokens/s, MFU
  e2e_batch  (bench/system/step_batch.py) the kernels-on step at micro-batch 2, 4, 8
  e2e_profile  (bench/system/step_profile.py) that step's GPU time by kernel category at
             micro-batch 8, and the MFU bound it implies

    python -m bench.kernels [--only attention,mhc] [--out bench/results/kernels/kernels-h100.json]
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import traceback
from pathlib import Path

import torch

from bench import provenance

KERNELS = ("quant", "attention", "attention_floor", "attention_configs", "indexer", "mhc", "engram",
           "small_ops")
SECTIONS = {name: f"bench.kernels.{name}" for name in KERNELS}
SECTIONS.update(e2e="bench.system.step", e2e_batch="bench.system.step_batch",
                e2e_profile="bench.system.step_profile")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=",".join(SECTIONS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    commit = provenance.commit()
    import triton
    today = datetime.date.today().isoformat()
    result = {"bench": "kernels", "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "triton": triton.__version__, "date": today, "commit": commit}
    for name in args.only.split(","):
        if name not in SECTIONS:
            raise SystemExit(f"bench.kernels: unknown section {name!r}; expected some of "
                             f"{', '.join(SECTIONS)}")
        try:
            result[name] = importlib.import_module(SECTIONS[name]).bench(device)
        except Exception as e:  # one failing section must not lose the others' numbers
            traceback.print_exc()
            result[name] = {"error": f"{type(e).__name__}: {e}"}
        torch.cuda.empty_cache()
        print(json.dumps({name: result[name]}), flush=True)
        if args.out:  # after every section: a run cut short keeps what it measured
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
