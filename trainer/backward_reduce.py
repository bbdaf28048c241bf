"""ZeRO-2 for the composite optimiser: gradients reduced to their owners during the backward.

At trainer.zero_stage=1 every rank holds every gradient of what it holds until the backward ends
(fp32, as large as the weights), and only then reduces each to the rank that steps it. At
zero_stage=2 a parameter's gradient leaves as soon as autograd has accumulated it: parameters are
cut into buckets in the order the backward produces their gradients, and a bucket is reduced to
each owner (one `reduce` per owner in it) the moment all its gradients exist. The owner adds the
result to an accumulator in `grad_dtype` that lives across the micro-batches of a step; the other
ranks drop theirs. So a rank holds its own share of the gradients plus about one bucket in flight,
not a whole copy: what lets the flash model's dense weights (replicated on every rank) fit at
EP=64 (trainer/plan.py).

Buckets are reduced strictly in order, so every rank issues the same collectives in the same order
whatever order its hooks fire in; a bucket that waits on a gradient this micro-batch never
produces (a tower that saw no image, an unused branch) waits until `finish_micro_batch`, which
reduces what is left, zeros standing in for the missing gradients. Each reduce also counts, per
parameter, the ranks whose gradient was real: a parameter no rank had a gradient for in any
micro-batch of the step gets none (None), as at zero_stage=1 and 0, so the optimiser leaves it
alone (no momentum, no weight decay) rather than stepping a zero gradient. Engram tables with sparse row
gradients are left to trainer/parallelize.py reduce_gradients, as at zero_stage=1.

grad_dtype=bfloat16 halves both the held gradients and the bytes reduced (DeepSpeed's
`grad_accum_dtype`, Megatron's `--grad-reduce-in-bf16`); the owner's optimiser still receives
fp32 gradients (`finish_step`).
"""
from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors

from conf.errors import ConfigError
from trainer.parallelize import ParallelLayout

BUCKET_BYTES = 64 * 2**20  # of fp32 gradients: large enough to amortise a collective's latency


class BackwardReducer:
    def __init__(self, model: nn.Module, layout: ParallelLayout, expert_params: set[int],
                 owners: dict[int, int], grad_dtype: torch.dtype = torch.float32,
                 bucket_bytes: int = BUCKET_BYTES, masters: dict[int, torch.Tensor] | None = None):
        """owners: id(param) -> the rank that steps it (`CompositeOptimizer.owner_ranks`; empty at
        one rank, where this rank owns everything); masters: id(param) -> the fp32 master this rank
        keeps of a bf16 parameter (`CompositeOptimizer.master_of`), which receives its gradient."""
        self.layout, self.expert_params, self.grad_dtype = layout, expert_params, grad_dtype
        self.masters = masters or {}
        sparse = {id(m.weight) for m in model.modules()
                  if type(m).__name__ == "EngramTable" and getattr(m, "sparse_grad", False)}
        params = [p for p in model.parameters() if p.requires_grad and id(p) not in sparse]
        self.owner = {id(p): owners.get(id(p), layout.rank) for p in params}
        self.names = {id(p): n for n, p in model.named_parameters()}
        # backward order is close to the reverse of registration order: later layers first
        self.buckets: list[list[nn.Parameter]] = []
        size = bucket_bytes
        for p in reversed(params):
            if size >= bucket_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * 4
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self.accumulated: dict[int, torch.Tensor] = {}  # id(param) -> the owner's running sum
        # the owner's reduced counts of real gradients: (parameters, [len] counts) per reduce of the step,
        # read at its end (reading them during the backward would wait for the device there)
        self.real: list[tuple[list[nn.Parameter], torch.Tensor]] = []
        self._arrived: list[set[int]] = [set() for _ in self.buckets]
        self._next = 0  # the first bucket not yet reduced this micro-batch
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    # ------------------------------------------------------------------ backward
    def _on_grad(self, p: nn.Parameter) -> None:
        i = self.bucket_of[id(p)]
        if i < self._next:
            raise RuntimeError(f"trainer.zero_stage=2: {self.names[id(p)]} received a second gradient "
                               "after its bucket was reduced (a parameter used again later in the "
                               "backward); use trainer.zero_stage=1")
        self._arrived[i].add(id(p))
        while self._next < len(self.buckets) and self._complete(self._next):
            self._reduce(self._next)

    def _complete(self, i: int) -> bool:
        return len(self._arrived[i]) == len(self.buckets[i])

    @torch.no_grad()
    def _reduce(self, i: int) -> None:
        """Every gradient of bucket i to its owner (sum over its replicas), added to the owner's
        accumulator; dropped everywhere."""
        self._next = i + 1
        by_key: dict[tuple[bool, int], list[nn.Parameter]] = defaultdict(list)
        for p in self.buckets[i]:
            by_key[(id(p) in self.expert_params, self.owner[id(p)])].append(p)
        for (expert, owner), params in sorted(by_key.items()):
            # each in grad_dtype first: bf16 parameters' gradients sit beside fp32 ones
            grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).to(self.grad_dtype)
                     for p in params]
            # one more element a parameter: 1 where this rank's gradient was real, summed with them
            grads.append(torch.tensor([p.grad is not None for p in params], dtype=self.grad_dtype,
                                      device=params[0].device))
            flat = _flatten_dense_tensors(grads)
            sizes = [g.numel() for g in grads]
            for p in params:
                p.grad = None
            del grads
            replicas = len(self.layout.expert_dp_ranks) if expert else self.layout.world_size
            if replicas > 1:
                dist.reduce(flat, dst=owner, group=self.layout.expert_dp_group if expert else None)
            if owner != self.layout.rank:
                continue
            *reduced, real = flat.split(sizes)
            self.real.append((params, real.clone()))
            for p, part in zip(params, reduced):
                g = part.view_as(p)
                acc = self.accumulated.get(id(p))
                if acc is None:
                    self.accumulated[id(p)] = g.clone()
                else:
                    acc.add_(g)

    def finish_micro_batch(self) -> None:
        """After a micro-batch's backward: reduce the buckets still waiting (in order), so the next
        backward starts from the first bucket."""
        while self._next < len(self.buckets):
            self._reduce(self._next)
        self._arrived = [set() for _ in self.buckets]
        self._next = 0

    def finish_step(self) -> None:
        """At the accumulation boundary: each owned parameter's gradient is its reduced sum over the
        step, averaged over the world (as trainer/parallelize.py reduce_gradients does), in fp32: on
        the parameter, or on its master where it is stored in bf16; none where no rank produced one."""
        counts = torch.cat([c for _, c in self.real]).tolist() if self.real else []
        produced = {id(p) for p, n in zip((p for params, _ in self.real for p in params), counts) if n > 0}
        self.real = []
        for bucket in self.buckets:
            for p in bucket:
                acc = self.accumulated.pop(id(p), None)
                if acc is None or id(p) not in produced:
                    continue
                if id(p) in self.masters:
                    self.masters[id(p)].grad = acc.float().div_(self.layout.world_size)
                else:
                    p.grad = acc.to(p.dtype).div_(self.layout.world_size)

    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.accumulated.values())

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


GRAD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def grad_dtype_of(name: str) -> torch.dtype:
    return GRAD_DTYPES[name]


def check_grad_accum_dtype(name: str, zero_stage: int) -> None:
    """ConfigError for trainer.grad_accum_dtype: an unknown dtype, or bf16 without the buffers of
    zero_stage=2 to hold it."""
    if name not in GRAD_DTYPES:
        raise ConfigError(f"trainer.grad_accum_dtype={name!r}: expected fp32 or bf16")
    if name != "fp32" and zero_stage != 2:
        raise ConfigError(f"trainer.grad_accum_dtype={name} needs trainer.zero_stage=2 (got {zero_stage}): "
                          "only the composite optimiser's ZeRO-2 holds its own gradient buffers")
