"""Data x expert parallelism, applied to a single-device model from outside (torchtitan-style).

Layout: world = DP x EP. Ranks [g*EP, (g+1)*EP) form expert-parallel group g, which together
holds every routed expert once (rank r keeps experts [(r % EP) * E/EP, ...)). Ranks with the
same r % EP hold the same experts: an expert-data-parallel group.

`parallelize` slices each MoE layer's expert stacks to the local experts and installs an
all-to-all dispatcher (dropless, variable split sizes); the shared expert and everything
else stay replicated. `reduce_gradients` then averages dense gradients over all ranks and
expert gradients over their expert-data-parallel group (to each parameter's optimiser owner
under the sharded optimiser); `clip_grad_norm` clips by the
norm of the whole (unsharded) gradient.
"""
from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from conf.errors import ConfigError
from model.moe import MoE, RoutedExperts, routing_order
from model.ops import compile_with_limits
from optim import Replicas
from trainer.distributed import all_reduce_sum_


@dataclass
class ParallelLayout:
    rank: int
    world_size: int
    ep: int
    ep_group: Optional[dist.ProcessGroup]  # ranks sharing one copy of all experts
    ep_ranks: list[int]
    expert_dp_group: Optional[dist.ProcessGroup]  # ranks holding the same experts
    expert_dp_ranks: list[int]
    cp: int = 1
    cp_group: Optional[dist.ProcessGroup] = None  # ranks sharing one sequence, a slice each

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different samples a step trains on side by side."""
        return self.world_size // self.cp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.cp

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep

    @property
    def cp_rank(self) -> int:
        return self.rank % self.cp

    def describe(self) -> str:
        return f"DP {self.dp} x CP {self.cp}, EP {self.ep}" if self.cp > 1 else f"DP {self.dp} x EP {self.ep}"


def _groups(rank: int, world_size: int, blocks: list[list[int]]):
    """Create every group (new_group is collective: all ranks, same order); return this rank's."""
    mine = (None, [rank])
    for ranks in blocks:
        pg = dist.new_group(ranks)
        if rank in ranks:
            mine = (pg, ranks)
    return mine


def check_degrees(world_size: int, ep: int, n_experts: int, cp: int = 1) -> None:
    """ConfigError unless EP and CP are >= 1 and divide the world size (and EP the experts)."""
    for name, degree in (("expert_parallel", ep), ("context_parallel", cp)):
        if degree < 1:
            raise ConfigError(f"trainer.{name}={degree}: must be >= 1")
        if world_size % degree:
            raise ConfigError(f"trainer.{name}={degree} does not divide the world size {world_size}")
    if n_experts % ep:
        raise ConfigError(f"trainer.expert_parallel={ep} does not divide model.n_routed_experts={n_experts}")


def check_training_layout(model_cfg, seq_len: int, world_size: int, ep: int, cp: int) -> None:
    """Every config error of a training run's parallel layout, from the config alone: the CLI runs
    it before a launcher starts any worker (a typo costs no process start-up), and each worker
    again before it builds its groups."""
    from model.plan import build_layer_plan
    from trainer.context_parallel import check_slices

    check_degrees(world_size, ep, model_cfg.n_routed_experts, cp)
    plan = build_layer_plan(model_cfg)
    check_slices(seq_len, cp, model_cfg.window, max([s.compress_ratio for s in plan.layers] + [1]),
                 max(model_cfg.engram_orders) if any(s.engram for s in plan.layers) else 1)


def build_layout(rank: int, world_size: int, ep: int, n_experts: int, cp: int = 1) -> ParallelLayout:
    """Validate the layout and create its process groups (collective: every rank calls it).
    Ranks [g*EP, (g+1)*EP) form an expert-parallel group; ranks [c*CP, (c+1)*CP) share a
    sequence (context parallelism), so data parallelism runs over world / CP samples."""
    check_degrees(world_size, ep, n_experts, cp)
    if world_size == 1:
        return ParallelLayout(rank, 1, ep, None, [rank], None, [rank], cp, None)
    ep_pg, ep_ranks = _groups(rank, world_size,
                              [list(range(g * ep, (g + 1) * ep)) for g in range(world_size // ep)])
    edp_pg, edp_ranks = _groups(rank, world_size, [list(range(i, world_size, ep)) for i in range(ep)])
    cp_pg, _ = _groups(rank, world_size, [list(range(c * cp, (c + 1) * cp)) for c in range(world_size // cp)])
    return ParallelLayout(rank, world_size, ep, ep_pg, ep_ranks, edp_pg, edp_ranks, cp, cp_pg)


class CommTimer:
    """Optional accounting of all-to-all time (CUDA events, read at log time)."""

    enabled = False
    events: list = []

    @classmethod
    def exchange(cls, out: torch.Tensor, x: torch.Tensor, out_splits, in_splits, group,
                 async_op: bool = False) -> Callable[[], None]:
        """all_to_all_single into out; -> wait(), which makes the current stream wait for it (a
        no-op once done). With async_op the exchange runs while the caller queues other work, and
        the timing (when enabled) spans the exchange's start to that wait."""
        timed = cls.enabled and x.is_cuda
        if timed:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        work = dist.all_to_all_single(out, x, out_splits, in_splits, group=group, async_op=async_op)

        def wait() -> None:
            if work is not None:
                work.wait()
            if timed:
                end.record()
                cls.events.append((start, end))
        if not async_op:
            wait()
        return wait

    @classmethod
    def take_seconds(cls) -> float:
        """All-to-all seconds since the last call (synchronises the device)."""
        if not cls.events:
            return 0.0
        torch.cuda.synchronize()
        total = sum(s.elapsed_time(e) for s, e in cls.events) / 1e3
        cls.events = []
        return total


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with variable splits; its gradient is the reverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        CommTimer.exchange(out, x.contiguous(), out_splits, in_splits, group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(in_splits), *grad.shape[1:])
        CommTimer.exchange(back, grad.contiguous(), in_splits, out_splits, ctx.group)
        return back, None, None, None


class _AllToAllStart(torch.autograd.Function):
    """The first half of an all-to-all that overlaps other work: the exchange starts and the
    output buffer returns at once (not to be read before _AllToAllWait). Its gradient waits for
    the reverse exchange that _AllToAllWait's gradient started, so the backward overlaps too:
    autograd runs what was computed between the two halves while the gradients travel."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, pending: dict):
        """pending: the exchange's "splits" (out, in) and "group"; its wait goes in as "forward"."""
        ctx.pending = pending
        (out_splits, in_splits), group = pending["splits"], pending["group"]
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        pending["forward"] = CommTimer.exchange(out, x.contiguous(), out_splits, in_splits, group,
                                                async_op=True)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        wait, back = ctx.pending.pop("backward")  # the reverse exchange _AllToAllWait's gradient began
        wait()
        return back, None


class _AllToAllWait(torch.autograd.Function):
    """The second half: waits for the exchange _AllToAllStart began -> its output."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, pending: dict):
        ctx.pending = pending
        pending.pop("forward")()
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (out_splits, in_splits), group = ctx.pending["splits"], ctx.pending["group"]
        back = grad.new_empty(sum(in_splits), *grad.shape[1:])
        ctx.pending["backward"] = (CommTimer.exchange(back, grad.contiguous(), in_splits, out_splits, group,
                                                      async_op=True), back)
        return grad, None  # _AllToAllStart's gradient takes `back` instead, once it has arrived


def all_to_all_around(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group,
                      alongside: Optional[Callable[[], torch.Tensor]]):
    """-> (x exchanged, alongside() computed while the exchange, and in the backward its reverse,
    are in flight; None without alongside)."""
    if alongside is None:
        return _AllToAll.apply(x, out_splits, in_splits, group), None
    pending = {"splits": (out_splits, in_splits), "group": group}
    started = _AllToAllStart.apply(x, pending)
    side = alongside()
    return _AllToAllWait.apply(started, pending), side


class ExpertParallelDispatch:
    """Replaces `MoE.dispatch`: tokens travel to the rank that owns their expert and back."""

    def __init__(self, moe: MoE, layout: ParallelLayout, shared_expert_overlap: bool = True):
        self.moe, self.layout, self.overlap = moe, layout, shared_expert_overlap
        self.n_local = moe.n_routed // layout.ep

    def __call__(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
                 alongside: Optional[Callable[[], torch.Tensor]] = None) -> torch.Tensor:
        """x [N, D], chosen / weights [N, k] (global expert ids) -> [N, D] (+ alongside(), computed
        while the rows travel to their experts)."""
        ep, n_local, group = self.layout.ep, self.n_local, self.layout.ep_group
        flat = chosen.flatten()
        order, inv = routing_order(flat)  # assignments grouped by global expert = by owner rank
        send_counts = torch.bincount(flat, minlength=self.moe.n_routed).view(ep, n_local)  # [ep, E/ep]
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)  # [source rank, local expert]
        send_splits, recv_splits = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        # under autocast the rows travel in its dtype (half an fp32 row's bytes), as the experts read them
        received, side = all_to_all_around(self.moe.gather_routed(x, order, inv), recv_splits, send_splits,
                                           group, alongside if self.overlap else None)  # [R, D] by source
        # regroup the received rows by local expert for the grouped expert compute
        local_expert = torch.repeat_interleave(torch.arange(n_local, device=x.device).repeat(ep),
                                               recv_counts.flatten())  # [R]
        perm = local_expert.argsort(stable=True)
        out = self.moe.experts(received[perm], recv_counts.sum(0).tolist())  # [R, D]
        out = out[perm.argsort()]  # back to (source, expert) order
        returned = _AllToAll.apply(out, send_splits, recv_splits, group)  # [N*k, D] in `order`
        y = self.moe.combine_routed(returned, order, inv, weights, x.dtype)
        if alongside is not None and side is None:
            side = alongside()
        return y if side is None else y + side


def checkpoint_blocks(model: nn.Module, layers: Optional[int] = None) -> int:
    """Activation checkpointing per block: the first `layers` blocks (None: all) keep only their
    inputs and recompute their activations in the backward; the rest keep theirs. Checkpointing
    only as many blocks as the memory needs is Megatron's `--recompute-num-layers` (method block):
    each block left out saves a third of its forward FLOPs again. Every block's activations are
    alive together at the end of the forward, so which blocks are chosen does not change the peak.
    Non-reentrant, so tensors a block hands to later layers through the attention runtime
    (global KV, top-k) stay in the autograd graph. A recomputed MoE forward counts its tokens
    again; the balancing update uses the sign of load minus mean, which a uniform double count does
    not change."""
    blocks = list(getattr(model, "layers", []))
    chosen = blocks[:checkpointed_count(len(blocks), layers)]
    for block in chosen:
        block.forward = functools.partial(torch.utils.checkpoint.checkpoint, block.forward,
                                          use_reentrant=False)
    return len(chosen)


def checkpointed_count(n_blocks: int, layers: Optional[int]) -> int:
    """How many of n_blocks trainer.checkpointed_layers checkpoints (None: all of them)."""
    if layers is None:
        return n_blocks
    if not 0 <= layers <= n_blocks:
        raise ConfigError(f"trainer.checkpointed_layers={layers}: expected 0 to the model's {n_blocks} "
                          "layers")
    return layers


# Selective recomputation (Megatron's --recompute-modules), by module name.
RECOMPUTE_MODULES = ("moe_act",)
# What a selective recompute keeps: the matmuls' outputs (the float8 ones of trainer/fp8.py included).
# Everything else in the region (activation functions, weight casts and stacked copies) runs again.
_KEPT_OPS = frozenset(getattr(torch.ops.aten, name).default
                      for name in ("mm", "addmm", "bmm", "_grouped_mm", "_scaled_mm", "_scaled_grouped_mm"))


def _keep_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def check_recompute_modules(modules) -> list[str]:
    """trainer.recompute_modules, validated: a list of names from RECOMPUTE_MODULES."""
    names = [modules] if isinstance(modules, str) else list(modules or [])
    if unknown := [m for m in names if m not in RECOMPUTE_MODULES]:
        raise ConfigError(f"trainer.recompute_modules: unknown {unknown}; expected some of "
                          f"{list(RECOMPUTE_MODULES)}")
    return names


def recompute_modules(model: nn.Module, modules, start: int = 0) -> int:
    """Selective recomputation in the blocks from `start` on (the ones before are checkpointed whole).
    `moe_act`: each routed-expert stack keeps its input rows and its grouped GEMMs' outputs; the SwiGLU
    and the weights' compute-dtype copies (cast, and gate and up stacked) are made again in the backward
    instead of kept. Those are most of what the routed experts save at a training micro-batch (the
    copies are [E, D, 3I] whatever the token count), for an elementwise pass and a weight copy more per
    layer; no matmul runs twice. Non-reentrant checkpoint with a policy, applied by patching the
    stack's forward, so the expert-parallel dispatch (which calls the stack) gets it too.
    -> the number of expert stacks patched."""
    names = check_recompute_modules(modules)
    if "moe_act" not in names:
        return 0
    patched = 0
    for block in list(getattr(model, "layers", []))[start:]:
        for module in block.modules():
            if isinstance(module, RoutedExperts):
                module.forward = functools.partial(
                    torch.utils.checkpoint.checkpoint, module.forward, use_reentrant=False,
                    context_fn=functools.partial(create_selective_checkpoint_contexts, _keep_matmuls))
                patched += 1
    return patched


def compile_blocks(model: nn.Module, backend: str = "inductor", start: int = 0) -> int:
    """torch.compile the forward of each block from `start` on, as torchtitan does: the many small
    elementwise ops around the matmuls and Triton kernels (norms, mHC coefficients, routing weights,
    rotary) fuse into a few generated kernels. Data-dependent steps (MoE token counts, padding
    checks) are graph breaks and run eagerly. Blocks differ in their layer spec (encoder/decoder,
    compression), so each distinct spec is its own graph: the recompile limit is raised to cover them all.
    A frame dynamo fails to compile (torch 2.11 trips a guard assertion on the MoE call) runs
    eagerly with a logged warning (suppress_errors) rather than stopping the run: compiling
    is an optimisation, never a change in what is computed. Those settings hold only while a
    block runs (`model.ops.compile_with_limits`): the rest of the process keeps dynamo's own. Not
    combined with checkpoint_blocks on one block (the trainer compiles only the blocks after the
    checkpointed ones): dynamo compiles nothing under a forward that checkpoint already wraps, and
    checkpointing a compiled forward saves a different set of tensors in the recomputation than in
    the forward (torch 2.13: CheckpointError)."""
    blocks = list(getattr(model, "layers", []))
    for block in blocks[start:]:  # patch the forward, as checkpoint_blocks does, not the module call
        block.forward = compile_with_limits(block.forward, backend, 2 * len(blocks), 8 * len(blocks))
    return len(blocks[start:])


def _expert_stacks(model: nn.Module):
    for module in model.modules():
        if isinstance(module, RoutedExperts):
            yield module


def parallelize(model: nn.Module, layout: ParallelLayout, shared_expert_overlap: bool = True) -> set[int]:
    """Shard experts and install the dispatcher (`shared_expert_overlap`: the shared expert runs while
    the rows travel; False: after the dispatch, as on one GPU). Returns the ids of the expert
    parameters."""
    expert_params: set[int] = set()
    if layout.ep == 1:
        return expert_params
    for module in model.modules():
        if isinstance(module, MoE):
            module.dispatch = ExpertParallelDispatch(module, layout, shared_expert_overlap)
    for stack in _expert_stacks(model):
        n_local = stack.n_experts // layout.ep
        start = layout.ep_rank * n_local
        for name in ("w1", "w2", "w3"):
            local = nn.Parameter(getattr(stack, name).data[start:start + n_local].clone())
            setattr(stack, name, local)
            expert_params.add(id(local))
        stack.expert_offset = start
    return expert_params


def optimizer_placement(model: nn.Module, layout: ParallelLayout,
                        expert_params: set[int]) -> tuple[dict, dict[int, int]]:
    """What the composite optimiser needs to know of the layout (`optim.build_optimizer`'s
    `replicas` and `row_offsets`): each expert shard is replicated on its expert-data-parallel
    group only, and sits at its stack's `expert_offset` rows of the full stack."""
    expert_replicas = Replicas(tuple(layout.expert_dp_ranks), layout.expert_dp_group)
    replicas = dict.fromkeys(expert_params, expert_replicas)
    offsets = {id(p): stack.expert_offset for stack in _expert_stacks(model)
               if hasattr(stack, "expert_offset") for p in (stack.w1, stack.w2, stack.w3)}
    return replicas, offsets


@contextlib.contextmanager
def full_experts(model: nn.Module, layout: ParallelLayout):
    """Inside: every expert stack holds all experts (gathered over the EP group), so a
    checkpoint is written, and read, in the EP-independent layout. On exit the local slices
    are back, holding whatever the full tensors hold then (e.g. a loaded checkpoint)."""
    if layout.ep == 1:
        yield
        return
    saved = []
    for stack in _expert_stacks(model):
        for name in ("w1", "w2", "w3"):
            local = getattr(stack, name)
            parts = [torch.empty_like(local) for _ in range(layout.ep)]
            dist.all_gather(parts, local.data.contiguous(), group=layout.ep_group)
            setattr(stack, name, nn.Parameter(torch.cat(parts), requires_grad=local.requires_grad))
            saved.append((stack, name, local))
    try:
        yield
    finally:
        for stack, name, local in saved:
            n = local.shape[0]
            local.data.copy_(getattr(stack, name).data[stack.expert_offset:stack.expert_offset + n])
            setattr(stack, name, local)


def _all_reduce_sparse(grad: torch.Tensor, group, group_size: int) -> torch.Tensor:
    """Sum a row-sparse COO gradient over `group`: gather everyone's rows and values."""
    grad = grad.coalesce()
    idx, val = grad.indices()[0], grad.values()
    sizes = [torch.zeros(1, dtype=torch.long, device=idx.device) for _ in range(group_size)]
    dist.all_gather(sizes, torch.tensor([idx.numel()], device=idx.device), group=group)
    n_max = max(int(s) for s in sizes)
    pad_idx = torch.cat((idx, idx.new_zeros(n_max - idx.numel())))
    pad_val = torch.cat((val, val.new_zeros(n_max - idx.numel(), *val.shape[1:])))
    all_idx = [torch.empty_like(pad_idx) for _ in range(group_size)]
    all_val = [torch.empty_like(pad_val) for _ in range(group_size)]
    dist.all_gather(all_idx, pad_idx, group=group)
    dist.all_gather(all_val, pad_val, group=group)
    rows = torch.cat([i[: int(n)] for i, n in zip(all_idx, sizes)])
    vals = torch.cat([v[: int(n)] for v, n in zip(all_val, sizes)])
    return torch.sparse_coo_tensor(rows.unsqueeze(0), vals, grad.shape, check_invariants=False).coalesce()


@torch.no_grad()
def reduce_gradients(model: nn.Module, layout: ParallelLayout, expert_params: set[int],
                     owners: Optional[dict[int, int]] = None,
                     fp32_grads: Optional[dict[int, torch.Tensor]] = None,
                     masters: Optional[dict[int, torch.Tensor]] = None) -> None:
    """Average gradients as one process with the global batch would see them: dense over all
    ranks; expert gradients (already summed over the EP group by the all-to-all backward)
    over their expert-data-parallel group; both divided by the world size.

    owners (id(param) -> rank, the sharded optimiser's `owner_ranks`): each dense or expert
    gradient is reduced to its owner only (one reduce per owner's bucket, the bytes of a
    reduce-scatter where an all-reduce moves twice as many) and dropped (None) on the other
    ranks, which do not step it. Without owners every rank gets every gradient.

    fp32_grads (id(param) -> fp32 gradient, trainer/master_weights.py Fp32Grads) stand in for the
    bf16 `.grad` of parameters stored in bf16; masters (id(param) -> fp32 master, the optimiser's
    `master_of`) receive such a reduced gradient on their `.grad`, on the owner.

    Ranks may differ in which parameters got a gradient (the vision tower in a step where only some
    ranks' batches held images): a parameter any rank of its group has a gradient for is reduced on
    every rank of the group, zeros standing in where a rank has none, so the ranks' buckets match;
    one no rank has a gradient for keeps none (the optimiser does not step it)."""
    fp32_grads, masters = fp32_grads or {}, masters or {}
    if layout.world_size == 1:
        for key, grad in fp32_grads.items():
            masters[key].grad = grad
        return
    owners = owners or {}
    params = list(model.parameters())
    held, sparse = _gradients_held(params, fp32_grads, expert_params, layout)
    buckets: dict[tuple[bool, Optional[int]], list[nn.Parameter]] = defaultdict(list)
    for p, any_rank, is_sparse in zip(params, held, sparse):
        if not any_rank:
            continue
        owner = owners.get(id(p))
        if is_sparse:
            grad = p.grad if p.grad is not None else _no_rows(p)
            p.grad = _all_reduce_sparse(grad, None, layout.world_size) / layout.world_size
            if owner is not None and owner != layout.rank:
                p.grad = None
        else:
            buckets[(id(p) in expert_params, owner)].append(p)
    # every rank walks the same buckets in the same order: the world's (dense) first, then its
    # expert-data-parallel group's, whose members share one owner assignment
    order = sorted(buckets, key=lambda key: (key[0], -1 if key[1] is None else key[1]))
    for expert, owner in order:
        params = buckets[(expert, owner)]
        group = layout.expert_dp_group if expert else None
        from_buffers = {id(p) for p in params if id(p) in fp32_grads}
        # no gradient here, one on another rank: this rank's share is zero (fp32 for a bf16
        # parameter with a master, as the other ranks' come from their fp32 buffers)
        absent = {id(p) for p in params if id(p) not in from_buffers and p.grad is None}
        grads = [fp32_grads.pop(id(p)) if id(p) in from_buffers
                 else torch.zeros_like(p, dtype=torch.float32 if id(p) in masters else p.dtype)
                 if id(p) in absent else p.grad for p in params]
        flat = _flatten_dense_tensors(grads)
        if owner is None:
            dist.all_reduce(flat, group=group)
        else:
            dist.reduce(flat, dst=owner, group=group)
            if owner != layout.rank:
                for p in params:
                    p.grad = None
                continue
        flat /= layout.world_size
        for p, g, new in zip(params, grads, _unflatten_dense_tensors(flat, grads)):
            if id(p) in from_buffers or (id(p) in absent and id(p) in masters):
                masters[id(p)].grad = g.copy_(new)
            elif id(p) in absent:
                p.grad = g.copy_(new)
            else:
                g.copy_(new)


def _gradients_held(params: list[nn.Parameter], fp32_grads: dict, expert_params: set[int],
                    layout: ParallelLayout) -> tuple[list[bool], list[bool]]:
    """Per parameter: whether any rank of the group that reduces it holds a gradient for it (the
    world for dense parameters, the expert-data-parallel group for expert stacks), and whether that
    gradient is row-sparse (an Engram table's). Small all-reduces: the same answer on every rank."""
    has = torch.tensor([float(id(p) in fp32_grads or p.grad is not None) for p in params])
    world = torch.stack((has, torch.tensor([float(p.grad is not None and p.grad.is_sparse) for p in params])))
    all_reduce_sum_(world)
    expert = torch.tensor([id(p) in expert_params for p in params])
    held = world[0] > 0
    if expert.any():
        in_group = has * expert
        all_reduce_sum_(in_group, layout.expert_dp_group)
        held = torch.where(expert, in_group > 0, held)
    return held.tolist(), (world[1] > 0).tolist()


def _no_rows(p: nn.Parameter) -> torch.Tensor:
    """An empty row-sparse gradient for p: a rank whose batch touched none of a table's rows."""
    return torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.long, device=p.device),
                                   p.new_zeros(0, *p.shape[1:]), p.shape)


@torch.no_grad()
def clip_grad_norm(model: nn.Module, layout: ParallelLayout, expert_params: set[int],
                   max_norm: float, sharded: bool = False, external=None,
                   masters: Optional[dict[int, torch.Tensor]] = None) -> float:
    """Global L2 norm of the (reduced) gradient, every expert counted once; clip to max_norm.
    sharded: each rank holds only the gradients it owns (`reduce_gradients` with owners), every
    parameter on exactly one rank, so the squares are summed over the world.
    external: gradients held outside the model (trainer/engram_host.py HostEngramTables), with
    `grad_square_sum()` (over all ranks) and `scale_grads(scale)`.
    masters: id(param) -> fp32 master (trainer.param_dtype=bf16), whose `.grad` is that parameter's."""
    masters = masters or {}
    dense_sq = torch.zeros((), dtype=torch.float64)
    expert_sq = torch.zeros((), dtype=torch.float64)

    def grad_of(p: torch.Tensor) -> Optional[torch.Tensor]:
        return p.grad if p.grad is not None or id(p) not in masters else masters[id(p)].grad

    held = [(p, g) for p in model.parameters() if (g := grad_of(p)) is not None]
    grads = [g for _, g in held]
    for p, grad in held:
        sq = (grad.coalesce().values() if grad.is_sparse else grad).double().square().sum().cpu()
        if id(p) in expert_params:
            expert_sq += sq
        else:
            dense_sq += sq
    if sharded:
        dense_sq = all_reduce_sum_(dense_sq + expert_sq)
        expert_sq = torch.zeros((), dtype=torch.float64)
    elif layout.ep > 1:
        all_reduce_sum_(expert_sq, layout.ep_group)
    if external is not None:
        dense_sq += external.grad_square_sum()
    norm = float((dense_sq + expert_sq).sqrt())
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for g in grads:
            g.mul_(scale)
        if external is not None:
            external.scale_grads(scale)
    return norm
