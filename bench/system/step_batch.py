"""The `small` training step with kernels on at larger micro-batches, side by side in one run:
tokens/s relative to micro-batch 2 (the e2e section's setting) and MFU.

The kernels-on step is partly launch-bound at `small`'s width (dim 1024: many short kernels
between the matmuls), so more tokens per launch is the cheapest lever on MFU; this section
measures how much it buys and where memory stops it. Rows: kernels on at micro-batch 2, 4 and 8
(seq 4096 each; a size that does not fit records the out-of-memory error), and the best fitting
micro-batch compiled with 4 micro-batches per optimizer step (bench/system/step.py's
`compiled_accum`).
"""
from __future__ import annotations

import torch

from bench.system.step import _tokens_per_s


def _row(micro_batch: int, seq_len: int, steps: int, vocab: int, **kw) -> dict:
    try:
        return _tokens_per_s(True, seq_len, micro_batch, steps, vocab, **kw)
    except torch.cuda.OutOfMemoryError as e:
        torch.cuda.empty_cache()
        return {"error": f"OutOfMemoryError: {str(e).splitlines()[0]}"}


def bench(device, seq_len: int = 4096, micro_batches: tuple[int, ...] = (2, 4, 8), steps: int = 3,
          vocab: int = 129_280, accum: int = 4) -> dict:
    torch.cuda.set_device(device)
    rows = {f"on_mb{mb}": _row(mb, seq_len, steps, vocab) for mb in micro_batches}
    base = rows[f"on_mb{micro_batches[0]}"]["tokens_per_s"]
    fitting = [mb for mb in micro_batches if "error" not in rows[f"on_mb{mb}"]]
    for mb in fitting:
        rows[f"on_mb{mb}"][f"vs_mb{micro_batches[0]}"] = rows[f"on_mb{mb}"]["tokens_per_s"] / base
    best = max(fitting, key=lambda mb: rows[f"on_mb{mb}"]["tokens_per_s"])
    rows[f"compiled_accum_mb{best}"] = _row(best, seq_len, steps, vocab, compiled=True, accum=accum)
    torch._dynamo.reset()
    return {"model": "small", "seq_len": seq_len, "accum": accum, **rows}
