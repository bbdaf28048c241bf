"""Where the kernels-on `small` forward+backward makes the host wait for the GPU: one pass under
`torch.cuda.set_sync_debug_mode("warn")` after a warm-up pass, each synchronising call counted by
its innermost frames in this repository. A wait drains the launch queue, so the GPU idles while
the host refills it: `e2e_profile`'s gap between wall time and kernel time is where these show.
Waits inside the backward are collected by the autograd engine and replayed once the backward
ends, so they show neither model frames nor the node that waited ("no repository frame").

    python -m bench.experiments.host_waits [--micro-batch 8]   (prints JSON; CUDA only)
"""
from __future__ import annotations

import argparse
import datetime
import json
import traceback
import warnings
from pathlib import Path

import torch

from bench import provenance
from bench.system.step import small_model

ROOT = str(Path(__file__).resolve().parent.parent) + "/"


def _site(depth: int = 3) -> str:
    """The innermost `depth` frames of the caller's stack that lie in this repository (this file's
    own excluded), innermost first."""
    here = str(Path(__file__).resolve())
    frames = [f for f in traceback.extract_stack() if f.filename.startswith(ROOT) and f.filename != here]
    inner = frames[-depth:]
    return (" <- ".join(f"{f.filename[len(ROOT):]}:{f.lineno} {f.name}" for f in reversed(inner))
            or "(no repository frame)")


def host_waits(micro_batch: int = 8, seq_len: int = 4096, vocab: int = 129_280) -> dict:
    torch.cuda.set_device(0)
    model, opt = small_model(kernels=True, vocab=vocab)
    ids = torch.randint(0, vocab, (micro_batch, seq_len + 1), device="cuda")

    def fwd_bwd():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(ids[:, :-1], labels=ids[:, 1:])
        out.loss.backward()
        opt.zero_grad(set_to_none=True)

    fwd_bwd()  # autotuning and first-call work are not steady-state waits
    torch.cuda.synchronize()
    sites: dict[str, int] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        key = _site() if "synchroniz" in str(message) else f"other warning: {str(message)[:80]}"
        sites[key] = sites.get(key, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fwd_bwd()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    waits = sorted(sites.items(), key=lambda kv: -kv[1])
    import triton

    commit = provenance.commit()
    return {"bench": "host_waits", "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "triton": triton.__version__, "date": datetime.date.today().isoformat(), "commit": commit,
            "micro_batch": micro_batch, "seq_len": seq_len,
            "waits": sum(n for k, n in waits if not k.startswith("other warning")),
            "sites": [{"count": n, "where": k} for k, n in waits]}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--micro-batch", type=int, default=8)
    print(json.dumps(host_waits(ap.parse_args().micro_batch), indent=1))
