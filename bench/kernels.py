"""Triton kernels against their baselines on one GPU, each measured side by side in one run;
prints one JSON object (and writes it to --out).

Sections (bench/kernels_<name>.py, each `bench(device) -> dict`):
  quant      KV quantise+pack / unpack+dequantise: GB/s as a fraction of device copy bandwidth
  attention  sparse attention fwd / fwd+bwd at 8K-128K context vs dense causal SDPA
  attention_floor  the same kernels at `small`'s step shape vs their traffic floor (measured
             gather and fp32 atomic-add rates on the kernels' own index tensor)
  attention_configs  every one-pass config of those kernels at that shape, side by side
  indexer    indexer scoring TFLOP/s; Reindex cost at 16K vs 128K (pool-bounded); top-k
  mhc        fused single-pass mHC vs the eager composition; bytes moved vs (2n+2)·d
  engram     hash + gather of random rows: GB/s vs copy bandwidth, GPU and pinned-host table
  e2e        the `small` training step, kernels off vs on: tokens/s ratio and MFU
  e2e_batch  the kernels-on `small` step at micro-batch 2, 4, 8: tokens/s ratio and MFU
  e2e_profile  that step's GPU time by kernel category at micro-batch 8, and the MFU bound it implies
  small_ops  rotary and the mHC stream mixes at the step's shape vs their PyTorch references

    python -m bench.kernels [--only attention,mhc] [--out bench/results/kernels-h200.json]

With --only and an existing --out, the sections run replace theirs in that file and the others
are kept; `measured` says which commit and date each section comes from.
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

SECTIONS = ("quant", "attention", "attention_floor", "attention_configs", "indexer", "mhc", "engram", "e2e",
            "e2e_batch", "e2e_profile", "small_ops")


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
    if args.out and Path(args.out).exists():  # keep the sections not run now, with where they came from
        old = json.loads(Path(args.out).read_text())
        measured = old.get("measured") or {k: {"commit": old.get("commit"), "date": old.get("date")}
                                           for k in SECTIONS if k in old}
        # every section and kept comparison row; the header (device, versions, commit) is this run's
        result.update({k: v for k, v in old.items() if k not in result and k != "measured"})
        result["measured"] = measured
    result.setdefault("measured", {})
    for name in args.only.split(","):
        if name not in SECTIONS:
            raise SystemExit(f"bench.kernels: unknown section {name!r}; expected some of "
                             f"{', '.join(SECTIONS)}")
        try:
            result[name] = importlib.import_module(f"bench.kernels_{name}").bench(device)
        except Exception as e:  # one failing section must not lose the others' numbers
            traceback.print_exc()
            result[name] = {"error": f"{type(e).__name__}: {e}"}
        result["measured"][name] = {"commit": commit, "date": today}
        torch.cuda.empty_cache()
        print(json.dumps({name: result[name]}), flush=True)
        if args.out:  # after every section: a run cut short keeps what it measured
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
