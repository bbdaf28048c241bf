"""Engram hash + gather kernel (model/kernels/engram.py) vs its reference
(`EngramTable.lookup(Engram.addresses(...))`, model/engram.py).

`flash`'s hashing shape: orders 2, 3, 4 x 8 heads = 24 lookups of 256-d fp32 rows per token,
65,536 tokens (16 x 4096, with document boundaries) per call. flash's tables (16M rows per
head, ~400 GB per layer) do not fit a GPU, so the GPU table has 2M rows per head (~49 GB). The
pinned host table has 1M rows per head (~25 GB): PyTorch's pinned-memory allocator rounds
allocations up to a power of two, and 64 GB of pinned memory would not leave a 128 GB host
enough room. Both tables are far larger than any cache, so rows are effectively random reads.

Reported (ms; GB/s counts the row bytes read + written, like copy_bandwidth_gbs counts a copy;
host paths also against the measured pinned host-to-device copy bandwidth, the bus they use):
* addresses only: kernel vs `Engram.addresses`;
* GPU table: the fused hash + gather vs the reference, forward; forward + backward with a
  dense (scatter-add) and a sparse table gradient;
* pinned host table: `host_path="staged"` (GPU addresses, CPU index_select into pinned
  staging, async upload) vs the reference (addresses to the CPU, embedding there, upload),
  and `host_path="uva"` (the kernel reads the mapped host table; measured last, since a
  failure there could leave the CUDA context unusable; an error is reported as host_uva_triton_failed).

Every entry catches CUDA OOM on its own (value NaN and a `<key>_oom: 1` marker).

    python -m bench.kernels.engram
"""
from __future__ import annotations

import dataclasses
import json

import torch

from bench.timing import copy_bandwidth_gbs, timed_into, timed_ms
from conf.model import FlashModelConfig
from model.engram import Engram
from model.kernels.engram import engram_addresses_triton, engram_lookup_triton
from model.runtime import document_starts

LAYER = 1


def _engram(rows_per_head: int, device: torch.device, pinned_table: bool) -> Engram:
    """flash's Engram with smaller tables; the table on `device` or in pinned host memory, the
    hashing state on `device`. Nothing is initialised that the benchmark does not read."""
    cfg = dataclasses.replace(FlashModelConfig(), engram_min_rows=rows_per_head)
    with torch.device("meta"):
        eng = Engram(cfg, LAYER)
    eng.to_empty(device="cpu" if pinned_table else device)  # a CPU table is never touched (no pages)
    eng._init_buffers()
    if pinned_table:
        for name in ("multipliers", "primes", "offsets"):
            setattr(eng, name, getattr(eng, name).to(device))
        weight = torch.empty(eng.table.weight.shape, pin_memory=True)
        step = 1 << 20  # rows per upload chunk (1 GB at 256 fp32)
        for lo in range(0, weight.shape[0], step):  # values drawn on the GPU: a CPU RNG would take minutes
            chunk = weight[lo:lo + step]
            chunk.copy_(torch.randn(chunk.shape, device=device) * cfg.init_std)
        eng.table.weight = torch.nn.Parameter(weight)
    else:
        eng.table.weight.data.normal_(std=cfg.init_std)
    return eng


def _batch(batch: int, seq: int, vocab: int, device: torch.device):
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    doc_ids = torch.cumsum(torch.rand(batch, seq, device=device) < 1 / 1024, dim=1)  # ~1K-token documents
    return ids, document_starts(doc_ids)


def _h2d_gbs(device: torch.device, n_bytes: int = 1 << 30) -> float:
    src = torch.empty(n_bytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    return n_bytes / timed_ms(lambda: dst.copy_(src, non_blocking=True)) / 1e6


def _bench_gpu_table(out: dict, ids, doc, rows_per_head: int, copy_gbs: float, device) -> None:
    try:
        eng = _engram(rows_per_head, device, pinned_table=False)
    except torch.OutOfMemoryError:
        out["gpu_table_oom"] = 1
        return
    W = eng.table.weight
    (batch, seq), lookups, E = ids.shape, eng.primes.numel(), W.shape[1]
    row_bytes = batch * seq * lookups * E * W.element_size()
    out.update(lookups=lookups, engram_dim=E, gpu_table_gb=W.numel() * W.element_size() / 1e9,
               row_bytes=row_bytes)
    with torch.no_grad():
        timed_into(out, "addresses_triton_ms", lambda: engram_addresses_triton(
            ids, eng.multipliers, eng.orders, eng.primes, eng.offsets, doc_start=doc))
        timed_into(out, "addresses_ref_ms", lambda: eng.addresses(ids, doc))
        ms = timed_into(out, "gpu_gather_triton_ms", lambda: engram_lookup_triton(eng, ids, doc))
        out["gpu_gather_triton_gbs"] = 2 * row_bytes / ms / 1e6
        out["gpu_gather_triton_frac_copy"] = out["gpu_gather_triton_gbs"] / copy_gbs
        ms = timed_into(out, "gpu_gather_ref_ms", lambda: eng.table.lookup(eng.addresses(ids, doc)))
        out["gpu_gather_ref_gbs"] = 2 * row_bytes / ms / 1e6
        out["gpu_gather_ref_frac_copy"] = out["gpu_gather_ref_gbs"] / copy_gbs
        out["gpu_gather_speedup"] = out["gpu_gather_ref_ms"] / out["gpu_gather_triton_ms"]
    try:
        up = torch.randn(batch, seq, lookups, E, device=device, dtype=W.dtype)
    except torch.OutOfMemoryError:
        out["gpu_fwd_bwd_oom"] = 1
        return
    for sparse in (False, True):  # forward + backward: the table gradient, nothing accumulated
        eng.table.sparse_grad = sparse
        kind = "sparse" if sparse else "dense"
        timed_into(out, f"gpu_fwd_bwd_{kind}_triton_ms",
                 lambda: torch.autograd.grad(engram_lookup_triton(eng, ids, doc), W, up), reps=5)
        timed_into(out, f"gpu_fwd_bwd_{kind}_ref_ms",
                 lambda: torch.autograd.grad(eng.table.lookup(eng.addresses(ids, doc)), W, up), reps=5)


def _bench_host_table(out: dict, ids, doc, rows_per_head: int, copy_gbs: float, h2d_gbs: float, reps: int,
                      device) -> None:
    eng = _engram(rows_per_head, device, pinned_table=True)
    W = eng.table.weight
    (batch, seq), lookups, E = ids.shape, eng.primes.numel(), W.shape[1]
    row_bytes = batch * seq * lookups * E * W.element_size()
    out["host_table_gb"] = W.numel() * W.element_size() / 1e9
    paths = [("host_staged_triton", lambda: engram_lookup_triton(eng, ids, doc, host_path="staged")),
             ("host_ref", lambda: eng.table.lookup(eng.addresses(ids, doc))),
             ("host_uva_triton", lambda: engram_lookup_triton(eng, ids, doc, host_path="uva"))]
    with torch.no_grad():
        for key, fn in paths:
            try:
                ms = timed_into(out, f"{key}_ms", fn, reps=reps, warmup=1)
            except Exception:  # the unverified UVA path reports its failure instead of raising
                out[f"{key}_failed"] = 1
                continue
            out[f"{key}_gbs"] = row_bytes / ms / 1e6  # each row crosses the bus once
            out[f"{key}_frac_h2d"] = out[f"{key}_gbs"] / h2d_gbs
            out[f"{key}_frac_copy"] = 2 * row_bytes / ms / 1e6 / copy_gbs
    for key in ("host_staged_triton", "host_uva_triton"):
        if f"{key}_ms" in out and "host_ref_ms" in out:
            out[f"{key}_speedup"] = out["host_ref_ms"] / out[f"{key}_ms"]


def bench(device, batch: int = 16, seq: int = 4096, rows_per_head: int = 2_000_000,
          host_rows_per_head: int = 1_000_000, vocab: int = 129_280, host_reps: int = 5) -> dict:
    """A flat dict of numbers: times in ms, GB/s, fractions of copy / host-to-device bandwidth."""
    device = torch.device(device)
    if device.type != "cuda":
        raise RuntimeError("bench.kernels.engram needs a CUDA device")
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    copy_gbs, h2d_gbs = copy_bandwidth_gbs(), _h2d_gbs(device)
    out = {"tokens": batch * seq, "copy_bandwidth_gbs": copy_gbs, "h2d_bandwidth_gbs": h2d_gbs,
           "rows_per_head": rows_per_head, "host_rows_per_head": host_rows_per_head}
    ids, doc = _batch(batch, seq, vocab, device)
    _bench_gpu_table(out, ids, doc, rows_per_head, copy_gbs, device)
    torch.cuda.empty_cache()
    _bench_host_table(out, ids, doc, host_rows_per_head, copy_gbs, h2d_gbs, host_reps, device)
    return out


if __name__ == "__main__":
    print(json.dumps(bench(torch.device("cuda")), indent=1))
