"""Engram tables in host memory, sharded by rows over the ranks (`trainer.engram_tables=host`).

Applied to a built model from outside, like the parallelism of trainer/parallelize.py: the model
code is unchanged and a run with host tables computes what a run with GPU-resident tables
computes (tests/test_engram_host.py). Per Engram layer:

  shard     rank r keeps rows [r * R // W, (r + 1) * R // W) of the layer's [R, E] table and their
            Sinkhorn momentum, fp32, in host memory (docs/DESIGN.md, Engram host tables). The
            model's `EngramTable` is removed, so neither DeepSpeed nor the checkpoint's model
            states see the table.
  prefetch  a micro-batch's addresses depend only on its token ids (Engram.addresses), so one
            worker thread hashes them on the CPU, takes the unique rows, asks each row's owner for
            it (all-to-all over a gloo group; nothing to ask at one rank), gathers the rows into
            pinned staging and copies them to the GPU on a side stream, while the GPU computes.
  forward   the Engram's `gather_rows` op reads its layer's prefetched unique rows [U, E] at the
            micro-batch's positions into them (an embedding lookup), so its backward leaves one
            gradient row per unique row.
  backward  at the accumulation boundary the row gradients go back to their owners, which sum
            them and divide by the world size (as trainer/parallelize.py reduce_gradients averages
            a GPU table's sparse gradient); their squared norm joins the global gradient norm.
  update    the owner runs the Sinkhorn optimiser's sparse step on its rows in host memory, with
            the column norms and the mean row norm summed over all owners, so the step equals the
            one optimiser.Sinkhorn takes on the whole table's touched rows.
  checkpoint every rank writes its shards (weights and momentum) as safetensors files named by
            their row range; a resume reads the rows it owns from whichever files hold them, so the
            world size may change between save and resume.

All host-table collectives run on the worker thread, in the order the trainer submits them, so
the ranks always agree on their order. Every wait has a deadline (trainer.collective_timeout_s).
"""
from __future__ import annotations

import contextlib
import re
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from conf.errors import ConfigError
from conf.optim import OptimConfig
from model.engram import Engram, EngramTable
from model.runtime import document_starts
from optim.routing import route_parameters
from optim.sinkhorn import Sinkhorn

ENGRAM_TABLES = ("gpu", "host")
SHARD_DIR = "engram_host"  # inside a checkpoint directory
SHARD_FILE = re.compile(r"layer(\d+)_rows(\d+)-(\d+)\.safetensors$")
INIT_BLOCK_ROWS = 1 << 20  # rows drawn per generator seed for a table built on the meta device


def check_engram_tables(value: str, context_parallel: int) -> None:
    """ConfigError for a `trainer.engram_tables` a run cannot use (the optimiser routing is checked
    when the tables are placed)."""
    if value not in ENGRAM_TABLES:
        raise ConfigError(f"trainer.engram_tables={value!r}: expected one of {', '.join(ENGRAM_TABLES)}")
    if value == "host" and context_parallel > 1:
        raise ConfigError("trainer.engram_tables=host with trainer.context_parallel>1 is not supported: a "
                          "context-parallel slice hashes the n-grams across its boundary from the previous "
                          "slice's ids; use engram_tables=gpu or context_parallel=1")


class RowShard:
    """Rows [lo, hi) of one layer's table and their Sinkhorn momentum, fp32, in host memory."""

    def __init__(self, layer: int, lo: int, hi: int, dim: int):
        self.layer, self.lo, self.hi = layer, lo, hi
        self.weight = torch.zeros(hi - lo, dim, dtype=torch.float32)  # [n, E]
        self.momentum = torch.zeros(hi - lo, dim, dtype=torch.float32)  # [n, E] lazy: touched rows only

    @property
    def nbytes(self) -> int:
        return 2 * self.weight.numel() * self.weight.element_size()

    def file_name(self) -> str:
        return f"layer{self.layer:02d}_rows{self.lo:012d}-{self.hi:012d}.safetensors"


class _Hasher:
    """An Engram layer's hashing on CPU copies of its buffers: the same code as Engram.addresses."""

    addresses = Engram.addresses
    _context = Engram._context

    def __init__(self, engram: Engram):
        self.orders, self.pad_id, self.heads = engram.orders, engram.pad_id, engram.heads
        self.multipliers = engram.multipliers.detach().cpu()
        self.primes, self.offsets = engram.primes.detach().cpu(), engram.offsets.detach().cpu()


@dataclass
class Fetched:
    """One micro-batch's rows of one layer, on the device."""
    addresses: torch.Tensor  # [U] int64 unique table rows, sorted (CPU)
    inverse: torch.Tensor  # [B, T, L] int64: index into `rows` of each lookup
    rows: torch.Tensor  # [U, E] fp32
    ready: Optional[Any] = None  # CUDA event recorded after the copy (None on CPU)


class HostGather:
    """The `Engram.gather_rows` op of a host-table layer: the prefetched rows at the lookups."""

    def __init__(self, tables: HostEngramTables, layer: int):
        self.tables, self.layer = tables, layer

    def __call__(self, engram, lookup_ids, doc_start=None, positions=None, history=None) -> torch.Tensor:
        entry = self.tables.take(self.layer)
        if entry.inverse.shape[:2] != lookup_ids.shape:
            raise RuntimeError(f"Engram layer {self.layer}: the prefetched rows are of a batch of shape "
                               f"{tuple(entry.inverse.shape[:2])}, the forward's ids "
                               f"{tuple(lookup_ids.shape)}: "
                               "prefetch each micro-batch, in order, before its forward")
        rows = entry.rows
        if torch.is_grad_enabled():
            rows.requires_grad_(True)
            self.tables.pending[self.layer].append(entry)
        return F.embedding(entry.inverse, rows)  # [B, T, L, E]


class HostEngramTables:
    """Every Engram layer's table of one model, held as host row shards (see the module docstring)."""

    def __init__(self, model: nn.Module, optim_cfg: OptimConfig, rank: int = 0, world_size: int = 1,
                 device: torch.device | str = "cpu", timeout_s: float = 1800.0, seed: int = 0):
        engrams = {e.layer_id: e for e in model.modules() if isinstance(e, Engram)}
        if not engrams:
            raise ConfigError("trainer.engram_tables=host: the model has no Engram layers")
        routes = {r.name: r for r in route_parameters(model, optim_cfg)}
        names = {id(e.table.weight): f"{n}.table.weight" for n, e in model.named_modules()
                 if isinstance(e, Engram)}
        self.rank, self.world, self.device = rank, world_size, torch.device(device)
        self.timeout_s = timeout_s
        # rows and gradients travel between host memories: a CPU (gloo) group beside the GPU's NCCL one
        self.group = (dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
                      if world_size > 1 else None)
        self.lookup_map = model.lookup_map.detach().cpu()
        self.hashers, self.shards, self.bounds, self.route = {}, {}, {}, None
        for layer, engram in sorted(engrams.items()):
            route = routes.get(names[id(engram.table.weight)])
            if route is None or route.optimizer != "sinkhorn":
                raise ConfigError("trainer.engram_tables=host needs the Engram tables routed to the "
                                  f"Sinkhorn optimiser (optim=muon); layer {layer}'s table goes to "
                                  f"{route.optimizer if route else 'no optimiser'}")
            self.route = route  # every layer's table matches the same rule
            weight = engram.table.weight
            rows, dim = weight.shape
            self.bounds[layer] = torch.tensor([r * rows // world_size for r in range(world_size + 1)])
            lo, hi = int(self.bounds[layer][rank]), int(self.bounds[layer][rank + 1])
            shard = RowShard(layer, lo, hi, dim)
            with torch.no_grad():
                if weight.is_meta:  # a full-size build: draw this shard's rows here
                    _draw_rows(shard, seed, model.cfg.init_std)
                else:
                    shard.weight.copy_(weight[lo:hi])
            self.shards[layer] = shard
            self.hashers[layer] = _Hasher(engram)
            engram.table = None  # the rows live in the shards now
            engram.gather_rows = HostGather(self, layer)
        # the options optim.composite gives its Sinkhorn (Nesterov, the optimiser's default)
        self.group_options = {"momentum": optim_cfg.sinkhorn_momentum, "nesterov": True,
                              "gamma": optim_cfg.sinkhorn_gamma, "iters": optim_cfg.sinkhorn_iters,
                              "tau": optim_cfg.sinkhorn_tau, "weight_decay": self.route.weight_decay}
        self.base_lr = optim_cfg.lr * self.route.lr_mult
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engram-host")
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.queued: dict[int, list[Future]] = defaultdict(list)  # layer -> fetches not yet taken
        self.pending: dict[int, list[Fetched]] = defaultdict(list)  # layer -> rows awaiting gradients
        self.grads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (local rows, summed grads)
        self.last_update: Optional[Future] = None
        self.stats = defaultdict(float)  # rows and bytes moved, seconds waited

    @property
    def layers(self) -> list[int]:
        return sorted(self.shards)

    @property
    def host_bytes(self) -> int:
        return sum(s.nbytes for s in self.shards.values())

    # ------------------------------------------------------------------ waiting
    def _wait(self, future: Future, what: str):
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise RuntimeError(f"Engram host tables: waited {self.timeout_s:.0f} s for {what} (rank "
                               f"{self.rank}); another rank may have stopped") from None

    # ------------------------------------------------------------------ prefetch
    def prefetch(self, input_ids: torch.Tensor, doc_ids: Optional[torch.Tensor] = None) -> None:
        """Queue the rows of a micro-batch (token ids [B, T], document ids [B, T] or None) for its
        forward; micro-batches are consumed in the order they were queued."""
        ids = input_ids.detach().cpu()
        docs = None if doc_ids is None else doc_ids.detach().cpu()
        future = self.worker.submit(self._fetch_all, ids, docs)
        for layer in self.layers:
            self.queued[layer].append(future)

    def _fetch_all(self, ids: torch.Tensor, docs: Optional[torch.Tensor]) -> dict[int, Fetched]:
        lookup = self.lookup_map[ids]  # [B, T]
        doc_start = None if docs is None else document_starts(docs)
        return {layer: self._fetch(layer, self.hashers[layer].addresses(lookup, doc_start))
                for layer in self.layers}

    def _fetch(self, layer: int, addresses: torch.Tensor) -> Fetched:
        unique, inverse = torch.unique(addresses, sorted=True, return_inverse=True)  # [U], [B, T, L]
        rows = self._exchange_rows(layer, unique)  # [U, E], pinned when copied to a GPU
        self.stats["rows_fetched"] += unique.numel()
        self.stats["lookups"] += addresses.numel()
        self.stats["bytes_to_device"] += rows.numel() * rows.element_size() + inverse.numel() * 8
        if self.copy_stream is None:
            return Fetched(unique, inverse, rows)
        with torch.cuda.stream(self.copy_stream):
            rows_dev = rows.to(self.device, non_blocking=True)
            inverse_dev = inverse.pin_memory().to(self.device, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.copy_stream)
        return Fetched(unique, inverse_dev, rows_dev, ready)

    def _staging(self, n: int, dim: int) -> torch.Tensor:
        return torch.empty(n, dim, dtype=torch.float32, pin_memory=self.copy_stream is not None)

    def _exchange_rows(self, layer: int, unique: torch.Tensor) -> torch.Tensor:
        """Rows `unique` (sorted) of a layer from their owners, in that order."""
        shard = self.shards[layer]
        dim = shard.weight.shape[1]
        if self.world == 1:
            out = self._staging(unique.numel(), dim)
            return torch.index_select(shard.weight, 0, unique - shard.lo, out=out)
        asked, counts = self._to_owners(layer, unique)  # the rows others ask of me, per asker
        mine = shard.weight.index_select(0, asked - shard.lo)  # [sum(counts), E]
        out = self._staging(unique.numel(), dim)
        send = self._owner_counts(layer, unique)
        dist.all_to_all_single(out, mine, send, counts, group=self.group)  # back to the askers
        return out

    def _owner_counts(self, layer: int, sorted_rows: torch.Tensor) -> list[int]:
        """How many of `sorted_rows` each rank owns."""
        edges = torch.searchsorted(sorted_rows, self.bounds[layer])  # [W + 1]
        return (edges[1:] - edges[:-1]).tolist()

    def _to_owners(self, layer: int, sorted_rows: torch.Tensor,
                   values: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, list[int]]:
        """Send sorted_rows (and values [n, E], if given) to their owners; returns what this rank
        received: the rows (and values, concatenated) and how many came from each rank."""
        send = self._owner_counts(layer, sorted_rows)
        recv = torch.empty(self.world, dtype=torch.long)
        dist.all_to_all_single(recv, torch.tensor(send, dtype=torch.long), group=self.group)
        recv_counts = recv.tolist()
        rows = torch.empty(sum(recv_counts), dtype=torch.long)
        dist.all_to_all_single(rows, sorted_rows.contiguous(), recv_counts, send, group=self.group)
        if values is None:
            return rows, recv_counts
        vals = torch.empty(sum(recv_counts), values.shape[1], dtype=values.dtype)
        dist.all_to_all_single(vals, values.contiguous(), recv_counts, send, group=self.group)
        return (rows, vals), recv_counts

    def take(self, layer: int) -> Fetched:
        """The next prefetched rows of a layer, ready for the current stream (waits for the copy)."""
        if not self.queued[layer]:
            raise RuntimeError(f"Engram layer {layer}: no prefetched rows for this forward; with "
                               "trainer.engram_tables=host every forward's ids go through "
                               "HostEngramTables.prefetch first")
        future = self.queued[layer].pop(0)
        start = time.perf_counter()
        entry = self._wait(future, f"layer {layer}'s prefetched rows")[layer]
        self.stats["fetch_wait_s"] += time.perf_counter() - start  # the forward stood still this long
        if entry.ready is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(entry.ready)
            entry.rows.record_stream(stream)  # allocated on the copy stream, used on this one
            entry.inverse.record_stream(stream)
        return entry

    # ------------------------------------------------------------------ gradients
    def reduce_gradients(self) -> None:
        """At the accumulation boundary: every micro-batch's row gradients to their owners, summed
        and divided by the world size (the average a GPU table's sparse gradient gets)."""
        start = time.perf_counter()
        work = {}
        for layer in self.layers:
            entries = self.pending.pop(layer, [])
            rows = torch.cat([e.addresses for e in entries]) if entries else torch.zeros(0, dtype=torch.long)
            grads = [e.rows.grad if e.rows.grad is not None else torch.zeros_like(e.rows) for e in entries]
            dim = self.shards[layer].weight.shape[1]
            grad = torch.cat(grads).float().cpu() if grads else torch.zeros(0, dim)  # D2H
            work[layer] = (rows, grad)
            self.stats["bytes_to_host"] += grad.numel() * grad.element_size()
        self._wait(self.worker.submit(self._reduce, work), "the Engram row gradients' exchange")
        self.stats["reduce_s"] += time.perf_counter() - start

    def _reduce(self, work: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        for layer, (rows, grad) in work.items():
            if self.world > 1:
                order = torch.argsort(rows, stable=True)
                (rows, grad), _ = self._to_owners(layer, rows[order], grad[order])
            unique, inverse = torch.unique(rows, sorted=True, return_inverse=True)
            summed = torch.zeros(unique.numel(), grad.shape[1], dtype=grad.dtype).index_add_(0, inverse, grad)
            if self.world > 1:
                summed /= self.world
            self.grads[layer] = (unique - self.shards[layer].lo, summed)
            self.stats["rows_updated"] += unique.numel()

    def grad_square_sum(self) -> torch.Tensor:
        """float64 squared L2 norm of every layer's reduced row gradients, over all ranks."""
        local = torch.zeros((), dtype=torch.float64)
        for _, g in self.grads.values():
            local += g.double().square().sum()
        if self.world == 1:
            return local
        return self._wait(self.worker.submit(self._all_reduce, local), "the Engram gradient norm")

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self.group)
        return t

    def scale_grads(self, scale: float) -> None:
        """Gradient clipping's factor (trainer/parallelize.py clip_grad_norm)."""
        for _, g in self.grads.values():
            g.mul_(scale)

    def drop_grads(self) -> None:
        """A skipped step: its row gradients are discarded, like the model's."""
        self.grads = {}

    # ------------------------------------------------------------------ update
    def step(self, lr_multiplier: float) -> None:
        """The Sinkhorn step of the reduced row gradients on the owners' shards, queued on the worker
        (so it overlaps the GPU's dense optimizer step); later fetches queue behind it and so read
        the updated rows."""
        group = {**self.group_options, "lr": self.base_lr * lr_multiplier}
        grads, self.grads = self.grads, {}
        self.last_update = self.worker.submit(self._update, grads, group)

    def _row_sum(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self.group)
        return t

    def _update(self, grads: dict[int, tuple[torch.Tensor, torch.Tensor]], group: dict[str, Any]) -> None:
        start = time.perf_counter()
        row_sum: Optional[Callable] = self._row_sum if self.world > 1 else None
        for layer in self.layers:
            shard = self.shards[layer]
            none = (torch.zeros(0, dtype=torch.long), torch.zeros(0, shard.weight.shape[1]))
            local, g = grads.get(layer, none)  # a rank with no touched rows still joins the sums
            w_rows, buf_rows = shard.weight.index_select(0, local), shard.momentum.index_select(0, local)
            Sinkhorn._update(w_rows, g, buf_rows, group, row_sum=row_sum)
            shard.momentum.index_copy_(0, local, buf_rows)
            shard.weight.index_copy_(0, local, w_rows)
        self.stats["update_s"] += time.perf_counter() - start  # on the worker thread

    def synchronize(self) -> None:
        """Wait for the queued update (before reading the shards: a checkpoint, a test)."""
        if self.last_update is not None:
            self._wait(self.last_update, "the Engram tables' Sinkhorn update")
            self.last_update = None

    # ------------------------------------------------------------------ checkpoint
    def save(self, ckpt_dir: Path) -> None:
        """This rank's shards into <ckpt_dir>/engram_host/ (weights and momentum, one file a layer)."""
        from safetensors.torch import save_file

        self.synchronize()
        out = Path(ckpt_dir) / SHARD_DIR
        out.mkdir(parents=True, exist_ok=True)
        for shard in self.shards.values():
            save_file({"weight": shard.weight, "momentum": shard.momentum}, str(out / shard.file_name()),
                      metadata={"layer": str(shard.layer), "lo": str(shard.lo), "hi": str(shard.hi)})

    def load(self, ckpt_dir: Path) -> None:
        """This rank's rows from the shard files of a checkpoint, whatever world size wrote them."""
        from safetensors import safe_open

        self.synchronize()
        files = shard_files(Path(ckpt_dir))
        for layer, shard in self.shards.items():
            filled = 0
            for (lo, hi), path in files.get(layer, []):
                a, b = max(lo, shard.lo), min(hi, shard.hi)
                if a >= b:
                    continue
                with safe_open(str(path), framework="pt") as f:
                    for name, dst in (("weight", shard.weight), ("momentum", shard.momentum)):
                        dst[a - shard.lo:b - shard.lo].copy_(f.get_slice(name)[a - lo:b - lo])
                filled += b - a
            if filled != shard.hi - shard.lo:
                raise RuntimeError(f"{ckpt_dir}: the Engram host shards of layer {layer} hold {filled} of "
                                   f"rows [{shard.lo}, {shard.hi}) this rank owns (a checkpoint of "
                                   "another model config, or written with trainer.engram_tables=gpu)")

    def close(self) -> None:
        self.worker.shutdown(wait=True)


@contextlib.contextmanager
def tables_on_meta():
    """Inside: Engram tables are built on the meta device (no memory), for a model whose tables
    HostEngramTables then draws shard by shard in host memory: the way to build a model whose
    full-size tables fit no single device."""
    init = EngramTable.__init__

    def meta_init(self, *args, **kwargs):
        with torch.device("meta"):
            init(self, *args, **kwargs)

    EngramTable.__init__ = meta_init
    try:
        yield
    finally:
        EngramTable.__init__ = init


def shard_files(ckpt_dir: Path) -> dict[int, list[tuple[tuple[int, int], Path]]]:
    """layer -> [((lo, hi), file)] of a checkpoint's host-table shards, by first row."""
    out: dict[int, list] = defaultdict(list)
    for path in sorted((Path(ckpt_dir) / SHARD_DIR).glob("*.safetensors")):
        m = SHARD_FILE.search(path.name)
        if m:
            out[int(m.group(1))].append(((int(m.group(2)), int(m.group(3))), path))
    return {k: sorted(v) for k, v in out.items()}


def full_tables(ckpt_dir: Path) -> dict[int, torch.Tensor]:
    """layer -> the whole table [R, E] assembled from a checkpoint's host shards (for a GPU-table
    model: evaluation, export, a resume with trainer.engram_tables=gpu)."""
    from safetensors.torch import load_file

    return {layer: torch.cat([load_file(str(p))["weight"] for _, p in parts])
            for layer, parts in shard_files(ckpt_dir).items()}


def _draw_rows(shard: RowShard, seed: int, std: float) -> None:
    """Normal(0, std) rows of a table built on the meta device, drawn in blocks of INIT_BLOCK_ROWS
    rows with one generator seed per (seed, layer, block), so a row's value does not depend on the
    world size that draws it."""
    first, last = shard.lo // INIT_BLOCK_ROWS, (shard.hi - 1) // INIT_BLOCK_ROWS
    gen = torch.Generator()
    for block in range(first, last + 1):
        lo, hi = block * INIT_BLOCK_ROWS, (block + 1) * INIT_BLOCK_ROWS
        gen.manual_seed(((seed * 1_000_003 + shard.layer) * 1_000_003 + block) % 2**63)
        rows = torch.randn(INIT_BLOCK_ROWS, shard.weight.shape[1], generator=gen) * std
        a, b = max(lo, shard.lo), min(hi, shard.hi)
        shard.weight[a - shard.lo:b - shard.lo].copy_(rows[a - lo:b - lo])
