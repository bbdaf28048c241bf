"""Engram tables in host memory, sharded by rows over the ranks (`trainer.engram_tables=host`).

Applied to a built model from outside, like the parallelism of trainer/parallelize.py: the model
code is unchanged and a run with host tables computes what a run with GPU-resident tables
computes (tests/test_engram_host.py). Per Engram layer:

  shard     rank r keeps rows [r * R // W, (r + 1) * R // W) of the layer's [R, E] table and their
            Sinkhorn momentum, fp32, in host memory (docs/DESIGN.md, Engram host tables). The
            model's `EngramTable` is removed, so neither DeepSpeed nor the checkpoint's model
            states see the table.
  prefetch  a micro-batch's addresses depend only on its token ids (Engram.addresses), so one
            worker thread hashes all micro-batches of a step on the CPU and takes the step's unique
            rows, in the order the micro-batches first read them: chunk i holds the rows micro-batch
            i reads first. Chunk by chunk it gathers the rows into pinned staging (index_select:
            a rank's own rows from its shard, others' from their owners over a gloo all-to-all) and
            copies them into one [S, E] device buffer on a side stream, so micro-batch i's forward
            waits only for chunks 0..i. At one rank the step's momentum rows follow.
  forward   the Engram's `gather_rows` op is an embedding lookup of the micro-batch's slots in
            the step buffer, so the buffer's gradient sums every micro-batch's, one row per row.
  update    at one rank the Sinkhorn step runs on the device, on the step buffer, its momentum
            rows and its gradient, with the arithmetic of optim.Sinkhorn's sparse step; a side
            stream copies the new rows and momentum to pinned memory and a writer thread scatters
            them into the shard, while the next step proceeds. At W ranks the gradients go to the
            rows' owners (gloo), which sum them, divide by W, and run the step on their rows on
            the device, the column norms and mean row norm summed over the owners, so it equals
            the step on the whole table's touched rows.
  order     a fetch may run while the last update's write-back is still scattering: it waits for
            the write-back before that one and reads from the shard only the rows the last update
            did not change; those it did are copied over on the device from that update's buffers
            (`patches`), on a stream that waits for that update's event, before a forward or the
            next update reads them.
            At W ranks the update runs on the worker thread, so every later fetch, served by the
            owners from their shards, queues behind it.
  checkpoint every rank writes its shards (weights and momentum) as safetensors files named by
            their row range; a resume reads the rows it owns from whichever files hold them, so the
            world size may change between save and resume.

All host-table collectives run on the worker thread, in the order the trainer submits them, so
the ranks always agree on their order. Every wait has a deadline (trainer.collective_timeout_s)
and a message naming what it waited for.

The worker and the writer run their CPU ops (hashing, unique, index_select, index_copy_) with
their own intra-op thread count (trainer.engram_host_threads; `side_thread_count`), so their
OpenMP teams leave cores to the training and autograd threads that launch the GPU's kernels.
"""
from __future__ import annotations

import contextlib
import re
import threading
import time
from collections import defaultdict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
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
EVENT_POLL_S = 0.0005  # a host thread waiting for a CUDA event polls it, to keep a deadline


def check_engram_tables(value: str, context_parallel: int) -> None:
    """ConfigError for a `trainer.engram_tables` a run cannot use (the optimiser routing is checked
    when the tables are placed)."""
    if value not in ENGRAM_TABLES:
        raise ConfigError(f"trainer.engram_tables={value!r}: expected one of {', '.join(ENGRAM_TABLES)}")
    if value == "host" and context_parallel > 1:
        raise ConfigError("trainer.engram_tables=host with trainer.context_parallel>1 is not supported: a "
                          "context-parallel slice hashes the n-grams across its boundary from the previous "
                          "slice's ids; use engram_tables=gpu or context_parallel=1")


def check_engram_host_threads(value: int) -> None:
    """ConfigError for a `trainer.engram_host_threads` below 0 (0: `side_thread_count` picks)."""
    if value < 0:
        raise ConfigError(f"trainer.engram_host_threads={value}: expected 0 (auto) or a positive number of "
                          "intra-op threads for each of the two host-table threads")


def side_thread_count(configured: int) -> int:
    """Intra-op threads for each of the worker and the writer thread: `configured`, or with 0 what the
    calling thread's own count leaves after two, halved. Two for the training thread and the
    autograd engine's device thread: they launch the GPU's kernels, and a launcher descheduled by an
    OpenMP team as wide as the machine leaves the GPU idle. Halved because the worker's gather and
    the writer's scatter run at the same time. The calling thread's count is the process's intra-op
    budget (torch's default of one a core, OMP_NUM_THREADS, trainer.torch_threads; torchrun sets
    OMP_NUM_THREADS=1 for several processes a node), so the side threads never get more than they
    would inherit, and several ranks on a node do not each claim all of its cores."""
    check_engram_host_threads(configured)
    return configured or max(1, (torch.get_num_threads() - 2) // 2)


def _set_thread_intra_op_threads(count: int) -> None:
    """A side thread's initializer. torch.get_num_threads() first: a thread's first use of the
    intra-op pool (at::init_num_threads) sets its count to the one last set in the process, which
    would undo a count set here before it."""
    torch.get_num_threads()
    torch.set_num_threads(count)


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


class StepPlan:
    """One layer's unique rows of a fetch and where each lookup reads them (CPU tensors). Slots go
    to the rows in the order the micro-batches first read them, then by row: micro-batch i's new
    rows take slots bounds[i]:bounds[i + 1], so its forward reads only chunks 0..i and need not
    wait for later ones, and chunk 0 is planned from micro-batch 0 alone. The slots depend on the
    step's ids alone (not on what the last update held), so the update adds its rows in the same
    order after a resume as in an uninterrupted run."""

    def __init__(self):
        self.chunks: list[torch.Tensor] = []  # per micro-batch: the rows it reads first, sorted
        self.from_host: list[int] = []  # per micro-batch: how many of them are read from the host
        self.bounds: list[int] = [0]
        self.slots: list[torch.Tensor] = []  # per micro-batch: [B, T, L] int64 slot of each lookup
        self.sorted_rows = torch.zeros(0, dtype=torch.long)  # [S] every row so far, sorted
        self.sorted_slots = torch.zeros(0, dtype=torch.long)  # [S] their slots

    @property
    def size(self) -> int:
        return self.bounds[-1]

    @property
    def rows(self) -> torch.Tensor:
        """[S] the rows by slot."""
        return torch.cat(self.chunks) if self.chunks else torch.zeros(0, dtype=torch.long)

    def _positions(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rows [n] -> (insertion points into sorted_rows [n], whether each row is there [n])."""
        pos = torch.searchsorted(self.sorted_rows, rows)
        if self.sorted_rows.numel() == 0:
            return pos, torch.zeros(rows.numel(), dtype=torch.bool)
        return pos, self.sorted_rows[pos.clamp(max=self.sorted_rows.numel() - 1)] == rows

    def find(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices into `rows` of those this plan holds, their slots here)."""
        pos, held = self._positions(rows)
        hit = torch.nonzero(held).squeeze(1)
        return hit, self.sorted_slots[pos[hit]]

    def add(self, addresses: torch.Tensor,
            last: Optional[StepPlan] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The next micro-batch's rows [B, T, L]: its new rows (sorted) take the next slots. Returns
        indices into them (its chunk) of those the `last` update's plan lacks, to read from the
        host; of the others, to copy over from that update; and the others' slots in `last`."""
        unique, inverse = torch.unique(addresses.reshape(-1), sorted=True, return_inverse=True)  # [U], [N]
        pos, held = self._positions(unique)
        fresh = ~held
        new = unique[fresh]  # [m] sorted
        new_slots = torch.arange(self.size, self.size + new.numel())
        slot = torch.empty_like(unique)
        slot[held] = self.sorted_slots[pos[held]]
        slot[fresh] = new_slots
        self.slots.append(slot[inverse].view(addresses.shape))
        self.chunks.append(new)
        self.bounds.append(self.size + new.numel())
        # merge two sorted runs without a sort: the new rows land at their insertion points, shifted
        # by the new rows before them, the old rows fill the other places in order
        at = pos[fresh] + torch.arange(new.numel())  # [m]
        old = torch.ones(self.sorted_rows.numel() + new.numel(), dtype=torch.bool)
        old[at] = False
        rows, slots = torch.empty(old.numel(), dtype=torch.long), torch.empty(old.numel(), dtype=torch.long)
        rows[at], slots[at] = new, new_slots
        rows[old], slots[old] = self.sorted_rows, self.sorted_slots
        self.sorted_rows, self.sorted_slots = rows, slots
        hit, src = last.find(new) if last is not None else (new[:0], new[:0])
        from_host = torch.ones(new.numel(), dtype=torch.bool)
        from_host[hit] = False
        host = torch.nonzero(from_host).squeeze(1)
        self.from_host.append(host.numel())
        return host, hit, src


@dataclass
class LayerRows:
    """One layer's rows of one fetch, on the device."""
    # [N, E] fp32, N = the fetch's lookups (a bound on its unique rows, known before they are):
    # rows by slot in [:plan.size]; a training fetch's is a leaf whose .grad sums its micro-batches'
    weight: torch.Tensor
    plan: StepPlan = field(default_factory=StepPlan)
    slots: list[torch.Tensor] = field(default_factory=list)  # per micro-batch: [B, T, L] int64
    # per micro-batch: (slots here, slots in the last update's rows) of the rows to copy over from
    # that update (the host may not hold them yet; they are not read from it), or None
    patches: list[Optional[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)
    momentum: Optional[torch.Tensor] = None  # [S, E] fp32: a training fetch at one rank
    momentum_patch: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (slots here, slots there)


class Fetch:
    """The rows of one `prefetch` call, filled in by the worker thread. Chunk i's future resolves, to
    the copy stream's CUDA event (None on CPU), once every layer's rows of micro-batch i are queued
    for the device; `momentum`'s once the momentum rows are."""

    def __init__(self, n: int, train: bool, prev: Optional[Fetch]):
        self.n, self.train = n, train
        self.prev = prev  # the last updated fetch: its rows replace the host's where both hold a row
        # CUDA: recorded on the stream that ran this fetch's update, after it. Every stream that reads
        # its rows and momentum afterwards (a later fetch's copy-over, the write-back) waits for it,
        # so none of them relies on running on the same stream as step()
        self.updated: Optional[Any] = None
        self.layers: dict[int, LayerRows] = {}
        self.chunks: list[Future] = [Future() for _ in range(n)]
        self.momentum: Future = Future()
        self.taken: dict[int, int] = defaultdict(int)  # layer -> micro-batches its forwards read

    def fail(self, error: BaseException) -> None:
        for future in (*self.chunks, self.momentum):
            if not future.done():
                future.set_exception(error)


class HostGather:
    """The `Engram.gather_rows` op of a host-table layer: the prefetched rows at the lookups."""

    def __init__(self, tables: HostEngramTables, layer: int):
        self.tables, self.layer = tables, layer

    def __call__(self, engram, lookup_ids, doc_start=None, positions=None, history=None) -> torch.Tensor:
        slots, weight = self.tables.take(self.layer, tuple(lookup_ids.shape))
        return F.embedding(slots, weight)  # [B, T, L, E]


class HostEngramTables:
    """Every Engram layer's table of one model, held as host row shards (see the module docstring)."""

    def __init__(self, model: nn.Module, optim_cfg: OptimConfig, rank: int = 0, world_size: int = 1,
                 device: torch.device | str = "cpu", timeout_s: float = 1800.0, seed: int = 0,
                 threads: int = 0):
        # threads: trainer.engram_host_threads, each side thread's intra-op threads (0: auto)
        self.side_threads = side_thread_count(threads)
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
        own_threads = torch.get_num_threads()
        side_init = {"initializer": _set_thread_intra_op_threads, "initargs": (self.side_threads,)}
        # fetches (and, at W ranks, the exchanges and updates) in submission order
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engram-host", **side_init)
        # one rank: updated rows into the shards, in update order
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engram-host-write", **side_init)
        # torch.set_num_threads sets the calling thread's OpenMP team size and also the count every
        # thread started later takes (at::init_num_threads, run when a thread first uses the intra-op
        # pool, and by the autograd engine's device threads, started at the first backward). So both
        # side threads start here, and this thread then puts that count back to its own.
        for pool in (self.worker, self.writer):
            pool.submit(lambda: None).result()
        torch.set_num_threads(own_threads)
        cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if cuda else None  # host -> device
        self.d2h_stream = torch.cuda.Stream(self.device) if cuda else None  # updated rows -> host
        # (train, layer) -> (fetch, micro-batch): a forward with gradients reads the training queue,
        # one without (evaluation) the other, so an evaluation may run while a step is prefetched
        self.queued: dict[tuple[bool, int], deque[tuple[Fetch, int]]] = defaultdict(deque)
        self.training: Optional[Fetch] = None  # the step's fetch, until reduce_gradients
        self.reduced: Optional[Fetch] = None  # one rank: the fetch whose gradients step() applies
        self.grads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # W ranks: layer -> (local rows, grads)
        self.last: Optional[Fetch] = None  # one rank: the last updated fetch (maybe not written back yet)
        self.written: Optional[Future] = None  # the last update, in host memory
        self.written_before: Optional[Future] = None  # the one before
        self.stats: dict[str, float] = defaultdict(float)  # rows and bytes moved, seconds spent or waited
        self._stats_lock = threading.Lock()

    @property
    def layers(self) -> list[int]:
        return sorted(self.shards)

    @property
    def host_bytes(self) -> int:
        return sum(s.nbytes for s in self.shards.values())

    def side_thread_counts(self) -> dict[str, int]:
        """The intra-op threads the worker and the writer thread run with, as each reports it."""
        return {name: self._wait(pool.submit(torch.get_num_threads), f"the {name} thread")
                for name, pool in (("worker", self.worker), ("writer", self.writer))}

    def _count(self, **values: float) -> None:
        with self._stats_lock:  # three threads count
            for key, value in values.items():
                self.stats[key] += value

    # ------------------------------------------------------------------ waiting
    def _wait(self, future: Future, what: str):
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise RuntimeError(f"Engram host tables: waited {self.timeout_s:.0f} s for {what} (rank "
                               f"{self.rank}); another rank may have stopped") from None

    def _wait_event(self, event, what: str) -> None:
        """A CUDA event, from a host thread, with the deadline `event.synchronize()` lacks."""
        deadline = time.monotonic() + self.timeout_s
        while not event.query():
            if time.monotonic() > deadline:
                raise RuntimeError(f"Engram host tables: waited {self.timeout_s:.0f} s for {what} (rank "
                                   f"{self.rank}); the device did not get there")
            time.sleep(EVENT_POLL_S)

    def _on_copy_stream(self) -> contextlib.AbstractContextManager:
        if self.copy_stream is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(self.device))  # a worker thread starts on device 0
        stack.enter_context(torch.cuda.stream(self.copy_stream))
        return stack

    def _staging(self, n: int, dim: int) -> torch.Tensor:
        return torch.empty(n, dim, dtype=torch.float32, pin_memory=self.copy_stream is not None)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A small CPU tensor onto the device on the current (copy) stream."""
        if self.copy_stream is None:
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _copy_event(self):
        if self.copy_stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.copy_stream)
        return event

    # ------------------------------------------------------------------ prefetch
    def prefetch(self, micro_batches: list[tuple[torch.Tensor, Optional[torch.Tensor]]],
                 train: bool = True) -> None:
        """Queue the rows of micro-batches [(token ids [B, T], document ids [B, T] or None)] for their
        forwards, which take them in order. train: the micro-batches of one training step, whose
        gradients the next reduce_gradients / step apply; False: forwards without gradients
        (evaluation). The rows are those after every update made before this call."""
        if not micro_batches:
            raise ValueError("HostEngramTables.prefetch: no micro-batches")
        if train and self.training is not None:
            raise RuntimeError("HostEngramTables.prefetch(train=True) while the previous training step's "
                               "rows still wait for reduce_gradients and step (or drop_grads)")
        batches = [(ids.detach().cpu(), None if docs is None else docs.detach().cpu())
                   for ids, docs in micro_batches]
        fetch = Fetch(len(batches), train, self.last)
        # the shards hold every update but the last (patched from the device) once this is written
        self.worker.submit(self._fetch, fetch, batches, self.written_before if self.world == 1 else None)
        for layer in self.layers:
            self.queued[train, layer].extend((fetch, i) for i in range(fetch.n))
        if train:
            self.training = fetch

    def _fetch(self, fetch: Fetch, batches: list, wait_for: Optional[Future]) -> None:
        try:
            with torch.no_grad(), self._on_copy_stream():
                self._fill(fetch, batches, wait_for)
        except BaseException as e:  # the forwards waiting for this fetch raise it
            fetch.fail(e)

    def _fill(self, fetch: Fetch, batches: list, wait_for: Optional[Future]) -> None:
        start = time.perf_counter()
        lookups = [self.lookup_map[ids] for ids, _ in batches]  # [B, T] each
        starts = [None if docs is None else document_starts(docs) for _, docs in batches]
        addresses = {layer: [self.hashers[layer].addresses(ids, s) for ids, s in zip(lookups, starts)]
                     for layer in self.layers}  # [B, T, L] each
        plan_s = time.perf_counter() - start
        if wait_for is not None:
            waited = time.perf_counter()
            self._wait(wait_for, "the write-back of the update before the last one")
            self._count(writeback_wait_s=time.perf_counter() - waited)
        buffers = {}
        for layer, parts in addresses.items():
            dim = self.shards[layer].weight.shape[1]
            buffers[layer] = torch.empty(sum(a.numel() for a in parts), dim, dtype=torch.float32,
                                         device=self.device)
            fetch.layers[layer] = LayerRows(buffers[layer].detach().requires_grad_(fetch.train))
        last = fetch.prev
        # layer -> per chunk: (slots read from the host, slots copied over, their slots in `last`)
        parts = defaultdict(list)
        for i in range(fetch.n):
            for layer, rows in fetch.layers.items():
                planned = time.perf_counter()
                plan = rows.plan
                host, hit, src = plan.add(addresses[layer][i],
                                          None if last is None else last.layers[layer].plan)
                plan_s += time.perf_counter() - planned
                a, chunk = plan.bounds[i], plan.chunks[i]
                if host.numel():
                    self._place(buffers[layer], a, chunk.numel(), host, self._gather(layer, chunk[host]))
                rows.slots.append(self._to_device(plan.slots[i]))
                rows.patches.append((self._to_device(hit + a), self._to_device(src)) if hit.numel() else None)
                parts[layer].append((host + a, hit + a, src))
            fetch.chunks[i].set_result(self._copy_event())
        moved = sum(sum(r.plan.from_host) * self.shards[layer].weight.shape[1] * 4
                    + sum(s.numel() * 8 for s in r.plan.slots) for layer, r in fetch.layers.items())
        if fetch.train and self.world == 1:  # the update's momentum rows, after every weight row
            for layer, rows in fetch.layers.items():
                shard, plan = self.shards[layer], rows.plan
                host, hit, src = (torch.cat(t) for t in zip(*parts[layer]))  # slots, slots, slots in last
                rows.momentum = torch.empty(plan.size, shard.weight.shape[1], dtype=torch.float32,
                                            device=self.device)
                gathered = time.perf_counter()
                staged = self._staging(host.numel(), shard.weight.shape[1])
                torch.index_select(shard.momentum, 0, plan.rows[host] - shard.lo, out=staged)
                self._count(gather_s=time.perf_counter() - gathered)
                if host.numel():
                    self._place(rows.momentum, 0, plan.size, host, staged)
                moved += staged.numel() * 4
                if hit.numel():
                    rows.momentum_patch = (self._to_device(hit), self._to_device(src))
        fetch.momentum.set_result(self._copy_event())
        self._count(rows_fetched=sum(r.plan.size for r in fetch.layers.values()),
                    rows_from_host=sum(sum(r.plan.from_host) for r in fetch.layers.values()),
                    lookups=sum(b.shape[0] for b in buffers.values()), bytes_to_device=moved,
                    plan_s=plan_s, fetch_s=time.perf_counter() - start, fetches=1)

    def _place(self, buffer: torch.Tensor, first: int, n: int, slots: torch.Tensor,
               staged: torch.Tensor) -> None:
        """staged [k, E] (pinned) into buffer rows first + slots (slots ascending, < n), on the copy
        stream: one copy when they are all n."""
        if slots.numel() == n:
            buffer[first:first + n].copy_(staged, non_blocking=True)
        else:
            buffer.index_copy_(0, self._to_device(slots + first), staged.to(self.device, non_blocking=True))

    def _gather(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """Rows `rows` (sorted) of a layer, into pinned staging [n, E] in that order: this rank's
        own rows from its shard, the others' from their owners."""
        start = time.perf_counter()
        shard = self.shards[layer]
        out = self._staging(rows.numel(), shard.weight.shape[1])
        edges = self._owner_edges(layer, rows)
        a, b = edges[self.rank], edges[self.rank + 1]
        torch.index_select(shard.weight, 0, rows[a:b] - shard.lo, out=out[a:b])
        if self.world > 1:  # every rank joins the exchange, also with nothing to ask
            others = torch.cat((rows[:a], rows[b:]))  # sorted: owners before and after this rank
            asked, counts = self._to_owners(layer, others)  # the rows others ask of me, per asker
            mine = shard.weight.index_select(0, asked - shard.lo)  # [sum(counts), E]
            received = torch.empty(others.numel(), out.shape[1], dtype=out.dtype)
            send = [n if r != self.rank else 0 for r, n in enumerate(self._owner_counts(layer, others))]
            dist.all_to_all_single(received, mine, send, counts, group=self.group)  # back to the askers
            out[:a].copy_(received[:a])
            out[b:].copy_(received[a:])
        self._count(gather_s=time.perf_counter() - start)
        return out

    def _owner_edges(self, layer: int, sorted_rows: torch.Tensor) -> list[int]:
        """[W + 1]: rank r owns sorted_rows[edges[r]:edges[r + 1]]."""
        return torch.searchsorted(sorted_rows, self.bounds[layer]).tolist()

    def _owner_counts(self, layer: int, sorted_rows: torch.Tensor) -> list[int]:
        """How many of `sorted_rows` each rank owns."""
        edges = self._owner_edges(layer, sorted_rows)
        return [b - a for a, b in zip(edges[:-1], edges[1:])]

    def _to_owners(self, layer: int, sorted_rows: torch.Tensor,
                   values: Optional[torch.Tensor] = None) -> tuple[Any, list[int]]:
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

    def take(self, layer: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """The next prefetched micro-batch of a layer: (slots [B, T, L], rows [S, E]) ready for the
        current stream (which waits for their copy; rows the last update changed copied over)."""
        train = torch.is_grad_enabled()
        if not self.queued[train, layer]:
            raise RuntimeError(f"Engram layer {layer}: no rows prefetched with train={train} for this "
                               f"forward (gradients {'on' if train else 'off'}); with "
                               "trainer.engram_tables=host every forward's ids go through "
                               "HostEngramTables.prefetch first: a training step's with train=True, "
                               "others with train=False")
        fetch, i = self.queued[train, layer].popleft()
        start = time.perf_counter()
        ready = self._wait(fetch.chunks[i], f"layer {layer}'s prefetched rows of micro-batch {i}")
        self._count(fetch_wait_s=time.perf_counter() - start)  # the forward stood still this long
        rows = fetch.layers[layer]
        slots, patch = rows.slots[i], rows.patches[i]
        if tuple(slots.shape[:2]) != shape[:2]:
            raise RuntimeError(f"Engram layer {layer}: the prefetched rows are of a batch of shape "
                               f"{tuple(slots.shape[:2])}, the forward's ids {shape}: prefetch each "
                               "micro-batch, in order, before its forward")
        if ready is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(ready)
            for t in (rows.weight, slots, *(patch or ())):  # allocated on the copy stream, used on this one
                t.record_stream(stream)
        if patch is not None:  # after the last update: the host may not hold it yet
            source = fetch.prev.layers[layer].weight
            if ready is not None:
                self._after_update(fetch.prev, source, stream)
            with torch.no_grad():
                rows.weight.index_copy_(0, patch[0], source.index_select(0, patch[1]))
        fetch.taken[layer] += 1
        return slots, rows.weight

    # ------------------------------------------------------------------ gradients
    def reduce_gradients(self) -> None:
        """At the accumulation boundary. One rank: the step's row gradients are already summed in
        its rows' .grad on the device. W ranks: they go to their owners, summed and divided by the
        world size (the average a GPU table's sparse gradient gets)."""
        start = time.perf_counter()
        fetch, self.training = self.training, None
        if fetch is not None:
            for layer in self.layers:
                if fetch.taken[layer] != fetch.n:
                    raise RuntimeError(f"Engram layer {layer}: reduce_gradients after {fetch.taken[layer]} "
                                       f"of the step's {fetch.n} prefetched micro-batches ran their forward")
        if self.world == 1:
            self.reduced = fetch
        else:
            work = {}
            for layer in self.layers:
                dim = self.shards[layer].weight.shape[1]
                if fetch is None:  # a rank with no rows still joins the exchange
                    work[layer] = (torch.zeros(0, dtype=torch.long), torch.zeros(0, dim))
                    continue
                rows = fetch.layers[layer]
                size = rows.plan.size
                grad = rows.weight.grad[:size] if rows.weight.grad is not None else rows.weight.new_zeros(
                    size, rows.weight.shape[1])
                work[layer] = (rows.plan.rows, grad.float().cpu())  # D2H
                self._count(bytes_to_host=grad.numel() * 4)
            self._wait(self.worker.submit(self._reduce, work), "the Engram row gradients' exchange")
        self._count(grad_s=time.perf_counter() - start)

    def _reduce(self, work: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        for layer, (rows, grad) in work.items():
            order = torch.argsort(rows)
            (rows, grad), _ = self._to_owners(layer, rows[order], grad[order])
            unique, inverse = torch.unique(rows, sorted=True, return_inverse=True)
            summed = torch.zeros(unique.numel(), grad.shape[1], dtype=grad.dtype).index_add_(0, inverse, grad)
            self.grads[layer] = (unique - self.shards[layer].lo, summed / self.world)

    def _device_grads(self) -> list[torch.Tensor]:
        """One rank: each layer's row gradients [S, E] (the buffer's rows past S have none)."""
        return [] if self.reduced is None else [
            r.weight.grad[:r.plan.size] for r in self.reduced.layers.values() if r.weight.grad is not None]

    def grad_square_sum(self) -> torch.Tensor:
        """float64 squared L2 norm of every layer's reduced row gradients, over all ranks (CPU)."""
        start = time.perf_counter()
        if self.world == 1:
            total = torch.zeros((), dtype=torch.float64, device=self.device)
            for g in self._device_grads():
                total += g.double().square().sum()
            total = total.cpu()
        else:
            local = torch.zeros((), dtype=torch.float64)
            for _, g in self.grads.values():
                local += g.double().square().sum()
            total = self._wait(self.worker.submit(self._all_reduce, local), "the Engram gradient norm")
        self._count(grad_s=time.perf_counter() - start)
        return total

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self.group)
        return t

    def scale_grads(self, scale: float) -> None:
        """Gradient clipping's factor (trainer/parallelize.py clip_grad_norm)."""
        for g in [*self._device_grads(), *(g for _, g in self.grads.values())]:
            g.mul_(scale)

    def drop_grads(self) -> None:
        """A skipped step: its row gradients are discarded, like the model's."""
        self.training, self.reduced, self.grads = None, None, {}

    # ------------------------------------------------------------------ update
    def step(self, lr_multiplier: float) -> None:
        """The Sinkhorn step of the reduced row gradients. One rank: on the device, queued on the
        current stream behind the backward; the rows and momentum then go back to the shard
        behind the next step's work. W ranks: on the worker thread, at the owners; later fetches
        queue behind it."""
        start = time.perf_counter()
        group = {**self.group_options, "lr": self.base_lr * lr_multiplier}
        self.training = None
        waiting = {key: len(q) for key, q in self.queued.items() if q}
        if waiting:
            raise RuntimeError(f"Engram host tables: step() with prefetched rows no forward has read yet "
                               f"({waiting} micro-batches by (train, layer)): they hold the rows before "
                               "this update")
        if self.world == 1:
            fetch, self.reduced = self.reduced, None
            if fetch is not None:
                self._update_on_device(fetch, group)
        else:
            grads, self.grads = self.grads, {}
            self.written = self.worker.submit(self._update_owned, grads, group)
        self._count(update_s=time.perf_counter() - start)

    def _update_on_device(self, fetch: Fetch, group: dict[str, Any]) -> None:
        ready = self._wait(fetch.momentum, "the step's Engram momentum rows")
        stream = torch.cuda.current_stream(self.device) if ready is not None else None
        if stream is not None:
            stream.wait_event(ready)
        updated = {}
        with torch.no_grad():
            for layer, rows in fetch.layers.items():
                if stream is not None:
                    for t in (rows.momentum, *(rows.momentum_patch or ())):
                        t.record_stream(stream)
                if rows.momentum_patch is not None:  # a later fetch may copy these rows over in turn
                    dst, src = rows.momentum_patch
                    source = fetch.prev.layers[layer].momentum
                    if stream is not None:
                        self._after_update(fetch.prev, source, stream)
                    rows.momentum.index_copy_(0, dst, source.index_select(0, src))
                if rows.weight.grad is None:  # a table no loss reached: no step, like a GPU table's
                    continue
                size = rows.plan.size
                weight = rows.weight.detach()[:size]
                Sinkhorn._update(weight, rows.weight.grad[:size], rows.momentum, group)
                rows.weight.grad = None
                updated[layer] = (rows.plan.rows, weight, rows.momentum)
                self._count(rows_updated=size)
        fetch.prev = None  # every row it had to hand over is copied
        if stream is not None:
            fetch.updated = torch.cuda.Event()
            fetch.updated.record(stream)
        self.written_before, self.written = self.written, self._write_back(updated, fetch.updated)
        self.last = fetch

    @staticmethod
    def _after_update(fetch: Fetch, source: torch.Tensor, stream) -> None:
        """Before `stream` reads `source` (a buffer of `fetch`, allocated on the copy stream): it waits
        for fetch's update, and the allocator keeps the buffer until what `stream` queued is done."""
        if fetch.updated is None:
            raise RuntimeError("Engram host tables: a fetch copies rows over from a fetch whose update "
                               "was not recorded")
        stream.wait_event(fetch.updated)
        source.record_stream(stream)

    def _write_back(self, updated: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                    after_update) -> Future:
        """Rows and momentum of an update to the shards: copied to pinned memory on a side stream
        after the update (the CUDA event `after_update`), then scattered by the writer thread."""
        done = None
        if self.d2h_stream is not None:
            staged = {}
            with torch.cuda.stream(self.d2h_stream):
                self.d2h_stream.wait_event(after_update)
                for layer, (rows, weight, momentum) in updated.items():
                    pair = []
                    for t in (weight, momentum):
                        host = self._staging(*t.shape)
                        host.copy_(t, non_blocking=True)
                        t.record_stream(self.d2h_stream)
                        pair.append(host)
                    staged[layer] = (rows, *pair)
                done = torch.cuda.Event()
                done.record(self.d2h_stream)
            updated = staged
        self._count(bytes_to_host=sum(2 * w.numel() * 4 for _, w, _ in updated.values()))
        return self.writer.submit(self._scatter, updated, done)

    def _scatter(self, updated: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]], done) -> None:
        start = time.perf_counter()
        if done is not None:
            self._wait_event(done, "the copy of the updated Engram rows to host memory")
        scatter = time.perf_counter()
        for layer, (rows, weight, momentum) in updated.items():
            shard = self.shards[layer]
            shard.weight.index_copy_(0, rows - shard.lo, weight)
            shard.momentum.index_copy_(0, rows - shard.lo, momentum)
        end = time.perf_counter()
        self._count(scatter_s=end - scatter, writeback_s=end - start, writebacks=1)

    def _row_sum(self, t: torch.Tensor) -> torch.Tensor:
        on_host = t.cpu()
        dist.all_reduce(on_host, group=self.group)
        return on_host.to(t.device)

    def _update_owned(self, grads: dict[int, tuple[torch.Tensor, torch.Tensor]],
                      group: dict[str, Any]) -> None:
        """W ranks, on the worker thread: the owner's step on its rows, on the device."""
        start = time.perf_counter()
        with torch.no_grad(), self._on_copy_stream():
            for layer in self.layers:
                shard = self.shards[layer]
                none = (torch.zeros(0, dtype=torch.long), torch.zeros(0, shard.weight.shape[1]))
                local, g = grads.get(layer, none)  # a rank with no touched rows still joins the sums
                weight = shard.weight.index_select(0, local).to(self.device)
                momentum = shard.momentum.index_select(0, local).to(self.device)
                Sinkhorn._update(weight, g.to(self.device), momentum, group, row_sum=self._row_sum)
                shard.momentum.index_copy_(0, local, momentum.cpu())
                shard.weight.index_copy_(0, local, weight.cpu())
                self._count(rows_updated=local.numel())
        self._count(writeback_s=time.perf_counter() - start, writebacks=1)

    def synchronize(self) -> None:
        """Wait until the shards hold every update (before reading them: a checkpoint, a test)."""
        if self.written is not None:
            self._wait(self.written, "the Engram tables' update to reach host memory")

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
        self.last = None  # rows on the device from before the load must not be copied over the loaded ones
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
        self.writer.shutdown(wait=True)


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
