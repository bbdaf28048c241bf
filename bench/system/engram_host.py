"""The step time of a training step with Engram tables in host memory (trainer/engram_host.py)
against the same step with the same rows resident on the device, in one run; prints one JSON object.

Each mode builds the model afresh and runs the trainer's optimiser path on a bare loop (as
bench/system/step_memory.py does): kernels on, bf16 autocast on a GPU, Muon + Sinkhorn + AdamW,
the global gradient norm clipped. `gpu`: the tables are parameters with sparse row gradients and
Sinkhorn's sparse step on the device. `host`: the tables are fp32 row shards in host memory
(with fp32 momentum), built on the meta device and drawn on the host, so a host-only row count
may exceed what the device holds (`--host-only-rows`). As in the trainer, a step's rows are
prefetched right after the previous step's update is queued, behind the GPU's optimizer step.
The timed figure is the wall clock of the timed steps together, divided by their number, so the
host work that runs behind a step is counted where the next step waits for it. The JSON rows
and one line a mode on stderr break the host tables' time down: the training thread's waits
(fetch_wait: forwards waiting for rows; grad: the row gradients' reduction and norm; update:
queueing the device step and its write-back), the worker's fetch (plan, gather) and the
writer's write-back (scatter), each per step.

`--table-threads auto,16` runs the host mode once per value (the device-table mode once): the
intra-op threads of each of the worker and writer threads (trainer.engram_host_threads; auto: what
the process's intra-op threads leave after two, halved), to compare them side by side. Each host
row records the value given (`table_threads`) and the counts the two threads ran with
(`side_threads`); `overhead` is the first value's, and each host row has its own.

Token ids: `uniform` draws every id alike (almost every n-gram new: the most rows a step can
fetch); `zipf` draws id k with weight 1 / (k + 1), closer to text, where frequent n-grams repeat.

    python -m bench.system.engram_host --model flash-L2 --seq-len 4096 --micro-batch 2 --accum 4 \\
        --min-rows 125000 --engram-layers 0,1 --steps 3 [--table-threads auto,16] \\
        [--host-only-rows 900000] [--out FILE]
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from bench import provenance
from bench.system.step_memory import model_config
from conf.model import TinyModelConfig
from conf.optim import MuonConfig
from model.engram import engram_table_params
from optim import build_optimizer
from trainer.engram_host import HostEngramTables, tables_on_meta
from trainer.parallelize import build_layout, clip_grad_norm
from trainer.pretrain import assemble_model

GIB = 2**30


def bench_config(name: str, vocab: int, min_rows: int, layers: list[int]):
    base = (dataclasses.replace(TinyModelConfig(), vocab_size=vocab) if name == "tiny"
            else model_config(name, vocab))
    return dataclasses.replace(base, engram_min_rows=min_rows, engram_layers=layers)


def draw_ids(kind: str, shape: tuple[int, int], vocab: int, g: torch.Generator) -> torch.Tensor:
    if kind == "uniform":
        return torch.randint(0, vocab, shape, generator=g)
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    return torch.multinomial(weights, shape[0] * shape[1], replacement=True, generator=g).view(shape)


def parse_table_threads(text: str) -> list[int]:
    """`--table-threads`: comma-separated `auto` (0) or positive counts."""
    values = []
    for item in text.split(","):
        item = item.strip()
        if item == "auto":
            values.append(0)
        elif item.isdigit() and int(item) > 0:
            values.append(int(item))
        else:
            raise argparse.ArgumentTypeError(f"{item!r}: expected auto or a positive thread count")
    return values


def threads_label(value: int) -> str:
    return str(value) if value else "auto"


def measure(cfg, tables: str, seq_len: int, micro_batch: int, accum: int, steps: int, ids: str,
            device: torch.device, profile: Optional[Path] = None, table_threads: int = 0) -> dict:
    """table_threads: host tables only, trainer.engram_host_threads (0: auto)."""
    torch.manual_seed(0)
    with torch.device(device), (tables_on_meta() if tables == "host" else contextlib.nullcontext()):
        model, _ = assemble_model(cfg)
    optim_cfg = MuonConfig()
    host = (HostEngramTables(model, optim_cfg, device=device, threads=table_threads) if tables == "host"
            else None)
    opt = build_optimizer(model, optim_cfg, zero_stage=0)
    opt.enable_sparse_table_grads(model)
    layout = build_layout(0, 1, 1, cfg.n_routed_experts)
    g = torch.Generator().manual_seed(0)
    cuda = device.type == "cuda"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()

    def draw() -> list[torch.Tensor]:
        batches = [draw_ids(ids, (micro_batch, seq_len + 1), cfg.vocab_size, g) for _ in range(accum)]
        if host is not None:  # as the trainer does: the step's rows are fetched behind the last step
            host.prefetch([(b[:, :-1], None) for b in batches])
        return batches

    def sync():
        if cuda:
            torch.cuda.synchronize()
        if host is not None:
            host.synchronize()

    def train_step(model, opt, batches: list[torch.Tensor], last: bool):
        for b in batches:
            b = b.to(device, non_blocking=True)
            with autocast:
                out = model(b[:, :-1], labels=b[:, 1:])
            (out.loss / accum).backward()
        if host is not None:
            host.reduce_gradients()
        clip_grad_norm(model, layout, set(), 1.0, external=host)
        opt.step()
        if host is not None:
            host.step(1.0)
        following = None if last else draw()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        return out, following

    times, start_all, before = [], None, {}
    batches = draw()
    total = steps + 2  # two warm-up steps: autotuning, allocator growth, optimizer state
    for step in range(total):
        if step == 2:
            sync()
            before = dict(host.stats) if host is not None else {}
            start_all = time.perf_counter()
        start = time.perf_counter()
        out, batches = train_step(model, opt, batches, last=step + 1 == total and profile is None)
        if step >= 2:
            times.append(time.perf_counter() - start)
    sync()
    wall = time.perf_counter() - start_all
    if profile is not None:  # one more step, after the timed ones, so the profiler costs them nothing
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                    + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])) as prof:
            out, _ = train_step(model, opt, batches, last=True)
            sync()
        name = "gpu-tables" if host is None else f"host-tables-threads-{threads_label(table_threads)}"
        write_profile(prof, profile / f"{name}.txt", cuda)
    row = {"tables": tables, "step_s": wall / steps, "step_s_median_main_thread": statistics.median(times),
           "table_rows_per_layer": engram_table_params(cfg) // cfg.engram_dim // len(cfg.engram_layers),
           "lm_loss_last": out.lm_loss.item()}
    if host is not None:
        st = {k: v - before.get(k, 0.0) for k, v in host.stats.items()}  # the timed steps'
        fetches, writes = max(st.get("fetches", 0), 1), max(st.get("writebacks", 0), 1)
        row.update(
            table_threads=threads_label(table_threads), side_threads=host.side_thread_counts(),
            host_table_gib=host.host_bytes / GIB,
            lookups_per_step=st["lookups"] / fetches, rows_fetched_per_step=st["rows_fetched"] / fetches,
            # the others are copied over on the device from the last update's rows
            rows_from_host_per_step=st["rows_from_host"] / fetches,
            rows_updated_per_step=st["rows_updated"] / steps,
            mib_to_device_per_step=st["bytes_to_device"] / fetches / 2**20,
            mib_to_host_per_step=st["bytes_to_host"] / steps / 2**20,
            # the training thread's waits and work, per step
            fetch_wait_s_per_step=st["fetch_wait_s"] / steps,  # forwards waiting for their rows
            grad_s_per_step=st["grad_s"] / steps,  # reduce_gradients + the rows' gradient norm
            update_s_per_step=st["update_s"] / steps,  # step(): queueing the update and write-back
            # the worker thread's, per fetch (behind the GPU unless a forward waits)
            fetch_s_per_step=st["fetch_s"] / fetches, plan_s_per_step=st["plan_s"] / fetches,
            gather_s_per_step=st["gather_s"] / fetches,
            writeback_wait_s_per_step=st["writeback_wait_s"] / fetches,
            # the writer thread's, per update: waiting for the device copy, then the scatter
            writeback_s_per_step=st["writeback_s"] / writes, scatter_s_per_step=st["scatter_s"] / writes)
        host.close()
    else:
        row["table_gib_on_device"] = 2 * 4 * engram_table_params(cfg) / GIB  # fp32 weights + momentum
    if cuda:
        row["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
    del model, opt, out
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return row


def write_profile(prof, path: Path, cuda: bool) -> None:
    """The profiled step's ops by device time (on CUDA) and by CPU time, and the step's total device
    time: a host-table step whose device total matches the device-table step's spent its extra time
    with the GPU idle (the training thread), one whose total is higher spent it in kernels or copies."""
    events = prof.key_averages()
    lines = []
    if cuda:
        # what the table's "Self CUDA time total" sums: device events (kernels, copies), not the CPU
        # ops that launched them nor user annotations (optimizer steps), which span kernels counted
        device_s = sum(e.self_device_time_total for e in events
                       if e.device_type == torch.autograd.DeviceType.CUDA
                       and not getattr(e, "is_user_annotation", False)) / 1e6
        lines += [f"device time, kernels and copies: {device_s:.3f} s", "",
                  events.table(sort_by="self_device_time_total", row_limit=40), ""]
    lines.append(events.table(sort_by="self_cpu_time_total", row_limit=40))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def breakdown(row: dict) -> str:
    """One line of a row's step time and, for host tables, where the host-side time went."""
    mode = row["tables"]
    if mode == "host":
        mode += f" (table threads {row['table_threads']}: {row['side_threads']['worker']} a thread)"
    line = f"{mode}: {row['step_s']:.3f} s/step"
    if row["tables"] == "host":
        keys = ("fetch_wait", "grad", "update", "writeback", "fetch", "gather", "scatter", "writeback_wait")
        line += " | " + " ".join(f"{k} {row[f'{k}_s_per_step']:.3f}" for k in keys)
    return line


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="flash-L2",
                    help="tiny, small or flash-L<layers> (step_memory's slice)")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--accum", type=int, default=4, help="micro-batches a step")
    ap.add_argument("--min-rows", type=int, default=250_000,
                    help="model.engram_min_rows of the compared run: each head's rows (24 heads a layer)")
    ap.add_argument("--engram-layers", default="0,1", help="comma-separated Engram layers")
    ap.add_argument("--host-only-rows", type=int, default=0,
                    help="also a host-table run at this engram_min_rows (16000000: full size), with no "
                    "device twin")
    ap.add_argument("--ids", choices=("uniform", "zipf"), default="uniform")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=129_280)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--table-threads", type=parse_table_threads, default=[0],
                    help="comma-separated intra-op threads of each host-table side thread, one host run "
                    "each: auto (trainer.engram_host_threads=0) or a count, e.g. auto,16")
    ap.add_argument("--out", type=Path, help="also write the JSON to this file")
    ap.add_argument("--profile", type=Path,
                    help="a folder: one more step per mode under torch.profiler, its op tables there")
    args = ap.parse_args()
    if args.threads:  # a shared CPU: one thread avoids OpenMP barriers waiting on descheduled threads
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    layers = [int(x) for x in args.engram_layers.split(",")]
    cfg = bench_config(args.model, args.vocab, args.min_rows, layers)
    shape = dict(seq_len=args.seq_len, micro_batch=args.micro_batch, accum=args.accum, steps=args.steps,
                 ids=args.ids, device=device, profile=args.profile)
    result = {**provenance.header("engram_host"), "model": args.model, "engram_layers": layers,
              "min_rows": args.min_rows, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
              "accumulation": args.accum, "ids": args.ids, "threads": torch.get_num_threads(), "rows": []}
    gpu = measure(cfg, "gpu", **shape)
    result["rows"].append(gpu)
    for count in args.table_threads:
        row = measure(cfg, "host", **shape, table_threads=count)
        row["overhead"] = row["step_s"] / gpu["step_s"] - 1
        result["rows"].append(row)
    result["overhead"] = result["rows"][1]["overhead"]
    if args.host_only_rows:
        big = bench_config(args.model, args.vocab, args.host_only_rows, layers)
        # its own tables: not profiled
        row = measure(big, "host", **{**shape, "profile": None}, table_threads=args.table_threads[0])
        row["overhead_vs_device_tables_of_min_rows"] = row["step_s"] / gpu["step_s"] - 1
        result["rows"].append(row)
    provenance.emit(result, args.out)
    for row in result["rows"]:
        print(breakdown(row), file=sys.stderr)
    for row in result["rows"][1:1 + len(args.table_threads)]:
        print(f"overhead, table threads {row['table_threads']}: {row['overhead']:+.1%} (goal <= +10%)",
              file=sys.stderr)


if __name__ == "__main__":
    main()
