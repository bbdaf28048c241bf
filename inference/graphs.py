"""The decode step of a SlotCache as one call, run eagerly or replayed from a CUDA graph.

A step of the engine (inference/generate.py) is: the next id of every busy slot in, one forward
over them, a token sampled per row out. Its device part has fixed shapes once the batch is padded
to a bucket (BATCH_BUCKETS; the padding rows run on free slots and their writes go nowhere that a
busy slot reads) and the global entries are read at a bucketed width (inference/slots.py
`capacity`). So `DecodeStep` captures it once per (batch bucket, read width) in a CUDA graph and
replays it: one launch for the whole step, where eager PyTorch pays the launch of every op of
every layer on the host.

The graphs are applied from outside the model: they record whatever ops the model and its kernel
policy run. A step runs eagerly the first time its shapes come up (Triton compiles and autotunes
there: nothing that synchronises may run inside a capture), is captured the second time, and
replayed from then on. A capture that fails says why once, on stderr, and that shape stays eager;
`graphs=False` (or a CPU model) runs every step eagerly, the reference the graphs are tested against.

A graph removes the host's launches, not the kernels: a step is thousands of short kernels, and
their count bounds it (the profile in bench/reports/2026-12-07-decode-engram-profiles-h100.md).
`compile` (a torch.compile backend, e.g. "inductor") runs the step's forward through torch.compile
first, as vLLM and SGLang do before they capture: inductor fuses the PyTorch ops between the Triton
kernels (the cache's index arithmetic, gathers, norms, routing) into fewer kernels, and the graph
then records those. Shapes stay static (torch.compile's dynamic=False): each (batch bucket, read
width) compiles its own code the first time it comes up, as it is captured once anyway. Symbolic
shapes would let later shapes reuse the code, but the layers' cache lengths differ, so dynamo
would make them symbolic within the first step and inductor would reason about symbolic shapes in
every graph, where compiling `small`'s step has stalled for minutes. The price is a compile (tens
of seconds) per new shape, bounded by dynamo's recompile limits, past which a frame runs eagerly,
uncompiled but still captured.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import contextmanager
from typing import Optional

import torch

from inference.slots import SlotCache, to_device
from model.moe import RoutedExperts
from model.ops import compile_with_limits

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def batch_bucket(n: int, limit: int) -> int:
    """The padded batch of a step with n busy rows among `limit` slots."""
    return min(next((b for b in BATCH_BUCKETS if b >= n), n), limit)


@contextmanager
def decode_experts(model):
    """Routed experts compute gate and up by a grouped GEMM each rather than one GEMM by their
    weights stacked, which copies every expert's gate and up weights per layer and call: for a
    decode step's few rows that copy moves more bytes than the GEMMs read. Restored after."""
    experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    before = [m.__dict__.get("stack_gate_up") for m in experts]
    for m in experts:
        m.stack_gate_up = False
    try:
        yield
    finally:
        for m, was in zip(experts, before):
            if was is None:
                del m.stack_gate_up
            else:
                m.stack_gate_up = was


class DecodeStep:
    """step(busy) -> post's outputs for the busy rows, in `busy` order.

    feed(rows) -> ids [B, 1]: the token each of rows [B] feeds (read from device state);
    post(logits [B, V], rows) -> tuple of [B, ...] tensors (e.g. the sampled tokens), which may
    also write device state (the next ids). Both run inside the step, and so inside its graph."""

    def __init__(self, model, slots: SlotCache, feed: Callable, post: Callable,
                 graphs: Optional[bool] = None, compile: Optional[str | Callable] = None):
        device = next(model.parameters()).device
        if graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model, this one is on {device}")
        self.model, self.slots, self.feed, self.post = model, slots, feed, post
        self.device = device
        self.graphs_on = device.type == "cuda" if graphs is None else graphs
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self.seen: set[tuple] = set()
        self.failed: dict[tuple, str] = {}
        self.pool = None  # one memory pool for every graph: they never run at the same time
        self.rows: dict[int, tuple[tuple[int, ...], torch.Tensor]] = {}  # bucket -> (slots, static rows)
        self.counts = {"eager": 0, "captured": 0, "replayed": 0}
        # a layer's guards (its spec, the entries it reads) and the kernels cutting it into several
        # frames make ~8 compiled versions of the shared layer code per layer; static shapes: see
        # the module's docstring
        self.forward = (self._forward if compile is None else
                        compile_with_limits(self._forward, compile, 8 * len(model.layers),
                                            64 * len(model.layers), dynamic=False))

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, 1] -> next-token logits [B, V], over the rows `begin_rows` set."""
        return self.model(ids, shard=self.slots).logits[:, -1]

    def _rows(self, busy: list[int], bucket: int) -> torch.Tensor:
        """The static [bucket] rows tensor holding busy, then free slots as padding."""
        taken = set(busy)
        order = tuple(busy) + tuple(s for s in range(self.slots.slots) if s not in taken)[:bucket - len(busy)]
        held = self.rows.get(bucket)
        if held is None:
            held = (None, torch.zeros(bucket, dtype=torch.long, device=self.device))
        if held[0] != order:  # only when the batch changes: no copy on most steps
            held[1].copy_(to_device(list(order), self.device), non_blocking=True)
            held = (order, held[1])
        self.rows[bucket] = held
        return held[1]

    def _run(self, rows: torch.Tensor, cap: int) -> tuple[torch.Tensor, ...]:
        ids = self.feed(rows)  # [B, 1]
        self.slots.begin_rows(rows, cap)
        with decode_experts(self.model):
            logits = self.forward(ids)
        self.slots.end_rows(ids)
        return self.post(logits, rows)

    def _capture(self, key: tuple, rows: torch.Tensor, cap: int) -> Optional[tuple]:
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                out = self._run(rows, cap)
        except Exception as e:  # noqa: BLE001 - any failure leaves this shape eager, said once
            self.failed[key] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            if len(self.failed) == 1:
                print(f"flashtrain: decode CUDA graph capture failed, the step runs eagerly "
                      f"({self.failed[key]})", file=sys.stderr, flush=True)
            torch.cuda.synchronize()
            return None
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[key] = (graph, out)
        self.counts["captured"] += 1
        graph.replay()
        return out

    def __call__(self, busy: list[int]) -> tuple[torch.Tensor, ...]:
        n = len(busy)
        cap = self.slots.prepare(busy)
        bucket = batch_bucket(n, self.slots.slots)
        rows = self._rows(busy, bucket)
        out = None
        if self.graphs_on and self.slots.ready():
            version = self.slots.version()
            key = (bucket, cap, version)
            if any(k[2] != version for k in self.graphs):  # they hold buffers that have since moved
                self.graphs = {k: g for k, g in self.graphs.items() if k[2] == version}
            if key in self.graphs:
                graph, out = self.graphs[key]
                graph.replay()
                self.counts["replayed"] += 1
            elif key in self.seen and key not in self.failed:
                out = self._capture(key, rows, cap)
            else:
                self.seen.add(key)
        if out is None:
            out = self._run(rows, cap)
            self.counts["eager"] += 1
        self.slots.advance(busy)
        return tuple(t[:n] for t in out)
