"""What one rank of a training layout holds in GPU memory, predicted from the model built on the
meta device and the trainer's own rules, before anything is launched.

The trainer has two ways of holding a model (trainer/engine.py, optim/__init__.py):

  whole-parameter  optim=muon (any Muon or Sinkhorn route) or expert parallelism: fp32 weights and
                   gradients under bf16 autocast; the composite optimizer's state is fp32 (Muon and
                   Sinkhorn one buffer a parameter, AdamW two) and, at trainer.zero_stage=1, each
                   parameter's state lives only on its owner (optim/composite.py assign_owners).
                   Routed experts are sharded over the EP group and replicated over the ranks that
                   hold the same experts. trainer.param_dtype=bf16 (Layout.param_dtype) stores each
                   parameter that more than one rank holds in bf16 (but those the model needs in
                   fp32: trainer/master_weights.py) and its fp32 master on its owner alone.
                   Engram tables take sparse row gradients. A text-only run (data.image_text_ratio
                   = 0) gives the vision tower no gradient, so it holds no optimizer state for
                   it, nor gradients but at ZeRO-2, whose backward reducer accumulates zeros for
                   them (and then leaves the parameters without one). With
                   trainer.engram_tables=host (Layout.engram_host) the tables and their momentum
                   are fp32 row shards in host memory (8 bytes a parameter over the world, off
                   the GPU); the GPU holds a step's fetched rows, their gradients and momentum.
  DeepSpeed ZeRO   every route to AdamW and no EP: bf16 weights and gradients with fp32 master weights and
                   Adam moments that ZeRO stage 1, 2 and 3 partition over the ranks (2 + 2 + 12
                   bytes a parameter; stage 0 keeps fp32 gradients too).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from torch import nn

from conf.errors import ConfigError
from conf.optim import OptimConfig
from conf.plan import ActivationRates, GPUSpec, StepRates
from model.accounting import active_matmul_params, train_flops
from model.engram import Engram, EngramTable
from model.moe import RoutedExperts
from optim.composite import assign_owners
from optim.routing import route_parameters
from trainer.backward_reduce import BUCKET_BYTES
from trainer.master_weights import fp32_parameters

GIB = 2**30
FP32 = 4
BF16 = 2
STATE_BYTES = {"muon": FP32, "sinkhorn": FP32, "adamw": 2 * FP32}  # fp32 buffers per parameter


@dataclass(frozen=True)
class Layout:
    """One way to spread a run over `world` ranks: world = DP x CP ranks, experts sharded over
    groups of `ep` consecutive ranks."""
    world: int
    ep: int = 1
    cp: int = 1
    zero_stage: int = 1
    micro_batch: int = 1
    seq_len: int = 4096
    engram_host: bool = False  # trainer.engram_tables=host: the tables are row shards in host memory
    grad_accum_dtype: str = "fp32"  # trainer.grad_accum_dtype: bf16 halves the gradients at zero_stage=2
    param_dtype: str = "fp32"  # trainer.param_dtype: bf16 weights and owner-sharded fp32 masters
    # trainer.recompute_modules=[moe_act]: the blocks not checkpointed whole re-make their routed
    # experts' weight copies and SwiGLU in the backward instead of keeping them
    moe_act: bool = False
    images: bool = False  # data.image_text_ratio > 0: the vision tower trains (gradients, optimizer state)

    @property
    def grad_bytes(self) -> int:
        return 2 if self.grad_accum_dtype == "bf16" else FP32

    @property
    def tokens_per_rank(self) -> int:
        """Tokens one rank runs through the model in a micro-step (its CP slice of each sequence)."""
        return self.micro_batch * self.seq_len // self.cp


def _kinds(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> routed | engram (everything else is dense)."""
    kinds = {}
    for module in model.modules():
        if isinstance(module, (RoutedExperts, EngramTable)):
            kind = "routed" if isinstance(module, RoutedExperts) else "engram"
            kinds.update({id(p): kind for p in module.parameters(recurse=False)})
    return kinds


def engram_rows_per_token(model: nn.Module) -> int:
    """Table rows one token reads across every Engram layer (its n-gram heads)."""
    return sum(m.heads * len(m.orders) for m in model.modules() if isinstance(m, Engram))


@dataclass(frozen=True)
class ModelFacts:
    """What the planner reads off a model once: each trainable tensor's size, optimizer and kind
    (dense, routed or engram), the Engram rows a token reads, and what a token's FLOPs depend on."""
    routes: list
    kinds: dict[str, str]  # route name -> dense | routed | engram
    engram_rows_per_token: int
    table_dim: int
    dim: int
    n_layers: int
    n_activated_experts: int
    active_params: float  # weights one token multiplies through (experts at top-k / experts)
    cfg: object  # the model config
    layer_plan: object  # the model's per-layer attention plan
    fp32_names: frozenset = frozenset()  # routes kept fp32 under trainer.param_dtype=bf16
    vision: frozenset = frozenset()  # routes of the vision tower: no gradient from a text-only step
    # per block, in order: the routed experts' (gate and up, down) parameters; (0, 0) for a dense block
    expert_weights: tuple = ()
    head: str = ""  # the LM head's route (its [vocab, dim] weight)

    @classmethod
    def of(cls, model: nn.Module, optim: OptimConfig) -> ModelFacts:
        routes = route_parameters(model, optim)
        kinds = _kinds(model)
        tables = [m.weight.shape[1] for m in model.modules() if isinstance(m, EngramTable)]
        cfg = model.cfg
        names = {r.name: kinds.get(id(r.param), "dense") for r in routes}
        keep = fp32_parameters(model)
        tower = getattr(model, "visual", None)
        tower = {id(p) for p in tower.parameters()} if tower is not None else set()
        experts = [[m for m in block.modules() if isinstance(m, RoutedExperts)] for block in model.layers]
        return cls(routes, names, engram_rows_per_token(model), max(tables, default=0), cfg.dim, cfg.n_layers,
                   cfg.n_activated_experts, active_matmul_params(model), cfg, model.plan,
                   frozenset(r.name for r in routes if id(r.param) in keep),
                   frozenset(r.name for r in routes if id(r.param) in tower),
                   tuple((sum(e.w1.numel() + e.w3.numel() for e in block), sum(e.w2.numel() for e in block))
                         for block in experts),
                   next(r.name for r in routes if r.param is model.head.weight))

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs of a trained token (model/accounting.py train_flops_per_token)."""
        return train_flops(self.cfg, self.layer_plan, self.active_params, seq_len)

    def holds_whole_parameters(self, ep: int) -> bool:
        """The composite optimizer's path (ZeRO-0/1 by hand) rather than DeepSpeed's ZeRO: what
        optim.build_optimizer picks, any route not to AdamW or expert shards."""
        return ep > 1 or any(r.optimizer != "adamw" for r in self.routes)

    def local(self, name: str, numel: int, ep: int) -> int:
        return numel // (ep if self.kinds[name] == "routed" else 1)

    def low_precision(self, name: str, layout: Layout) -> bool:
        """Stored in bf16 with an fp32 master on its owner (optim/composite.py): under
        trainer.param_dtype=bf16, a parameter the model does not need in fp32 that more than one rank
        holds (dense: every rank; an expert shard: world / EP ranks)."""
        if layout.param_dtype != "bf16" or name in self.fp32_names or self.kinds[name] == "engram":
            return False
        replicas = layout.world // layout.ep if self.kinds[name] == "routed" else layout.world
        return replicas > 1

    def of_kind(self, kind: str) -> int:
        return sum(r.param.numel() for r in self.routes if self.kinds[r.name] == kind)

    def trained(self, name: str, layout: Layout) -> bool:
        """Whether the parameter gets a gradient and so optimizer state: all but the vision tower's in a
        text-only run."""
        return name not in self.vision or layout.images

    def gradient_held(self, name: str, layout: Layout) -> bool:
        """Whether a rank holds a gradient buffer for it: the trained ones, and at ZeRO-2 every one,
        since the backward reducer accumulates zeros for a missing gradient before the step knows
        that no rank had one (trainer/backward_reduce.py)."""
        return self.trained(name, layout) or layout.zero_stage == 2

    def head_numel(self) -> int:
        return next(r.param.numel() for r in self.routes if r.name == self.head)

    def routed_low_precision(self, layout: Layout) -> bool:
        """The expert shards are stored in bf16 (`low_precision`: more than one rank holds each)."""
        name = next((r.name for r in self.routes if self.kinds[r.name] == "routed"), None)
        return name is not None and self.low_precision(name, layout)


def state_bytes(facts: ModelFacts, layout: Layout, accumulation: int = 1) -> dict[str, int]:
    """Bytes of weights, gradients and optimizer state on the rank that holds the most:
    {"parameters", "gradients", "optimizer"}. The layout's degrees are checked before
    (trainer/parallelize.py check_training_layout)."""
    if not facts.holds_whole_parameters(layout.ep):
        return _deepspeed_bytes(sum(r.param.numel() for r in facts.routes), layout)
    if layout.zero_stage not in (0, 1, 2):
        raise ConfigError(f"trainer.zero_stage={layout.zero_stage} with Muon/Sinkhorn routes or expert "
                          "parallelism: the composite optimizer shards whole parameters (0, 1 or 2)")
    local = {r.name: facts.local(r.name, r.param.numel(), layout.ep) for r in facts.routes
             if not (layout.engram_host and facts.kinds[r.name] == "engram")}
    held = {name: n for name, n in local.items()  # dense gradients
            if facts.kinds[name] != "engram" and facts.gradient_held(name, layout)}
    if layout.zero_stage == 2:
        # each gradient on its owner alone, plus one bucket in flight: autograd's fp32 gradients and
        # their flat copy in the reduced dtype (trainer/backward_reduce.py)
        bucket = BUCKET_BYTES // FP32
        dense_grad_bytes = (layout.grad_bytes * _largest_owned(facts, held, layout)
                            + (FP32 + layout.grad_bytes) * bucket)
    else:
        dense_grad_bytes = FP32 * sum(held.values())
    lookups = facts.engram_rows_per_token * layout.tokens_per_rank
    # bf16 weights where param_dtype=bf16 applies, fp32 elsewhere
    weights = sum((BF16 if facts.low_precision(name, layout) else FP32) * n for name, n in local.items())
    if layout.engram_host:
        # a step's rows (all `accumulation` micro-batches; at most one a lookup) sit in one device
        # buffer with their gradient and momentum, beside the last update's rows and momentum (the
        # next fetch copies those over on the device), and each lookup's int64 slot
        step_lookups = lookups * accumulation
        return {"parameters": weights, "gradients": dense_grad_bytes,
                "optimizer": _composite_state_bytes(facts, local, layout),
                "engram rows in flight": step_lookups * (5 * facts.table_dim * FP32 + 8)}
    # sparse row gradients of the Engram tables: each read row's values (fp32) and its int64 index, for
    # every micro-step of the step (autograd appends each backward's rows; the optimizer coalesces them)
    sparse = lookups * accumulation * (facts.table_dim * FP32 + 8)
    return {"parameters": weights, "gradients": dense_grad_bytes + sparse,
            "optimizer": _composite_state_bytes(facts, local, layout)}


def host_table_bytes(facts: ModelFacts, layout: Layout) -> int:
    """Host memory of one rank's Engram row shards: fp32 weights and Sinkhorn momentum (0 when the
    tables live on the GPU)."""
    return 2 * FP32 * facts.of_kind("engram") // layout.world if layout.engram_host else 0


def _composite_state_bytes(facts: ModelFacts, local: dict[str, int], layout: Layout) -> int:
    """The largest rank's optimizer state, fp32 masters included (trainer.param_dtype=bf16: a master
    lives with its parameter's momentum, on the owner). ZeRO-0: every rank keeps state for all it holds.
    ZeRO-1 and 2: dense parameters are owned across all ranks, an expert shard (EP > 1) across the ranks
    that hold the same experts (world / EP of them; rank r is member r // EP of its group)."""
    routes = [r for r in facts.routes if r.name in local]  # host tables keep their state off the GPU
    # a parameter without gradients gets no momentum (optimizers create it at the first step), but
    # its master exists from the start
    state = {r.name: ((STATE_BYTES[r.optimizer] if facts.trained(r.name, layout) else 0)
                      + (FP32 if facts.low_precision(r.name, layout) else 0)) * local[r.name] for r in routes}
    if layout.zero_stage == 0:
        return sum(state.values())
    return _largest_owned(facts, state, layout)


def _largest_owned(facts: ModelFacts, amounts: dict[str, int], layout: Layout) -> int:
    """The most of `amounts` (route name -> a quantity) any one rank owns under the composite
    optimizer's assignment."""
    routes = [r for r in facts.routes if r.name in amounts]
    # the composite optimizer balances each set of identically replicated parameters on its own;
    # without EP every parameter is replicated on every rank, so that is one set
    shards = [r for r in routes if layout.ep > 1 and facts.kinds[r.name] == "routed"]
    sharded = {r.name for r in shards}
    replicated = [r for r in routes if r.name not in sharded]
    per_rank: dict[int, int] = defaultdict(int)
    for name, rank in assign_owners(replicated, tuple(range(layout.world))).items():
        per_rank[rank] += amounts[name]
    per_member: dict[int, int] = defaultdict(int)
    for name, member in assign_owners(shards, tuple(range(layout.world // layout.ep))).items():
        per_member[member] += amounts[name]
    return max(per_rank[r] + per_member[r // layout.ep] for r in range(layout.world))


def _deepspeed_bytes(n: int, layout: Layout) -> dict[str, int]:
    """DeepSpeed's bf16 ZeRO: bf16 weights and gradients (2 bytes each), fp32 master weights and
    Adam moments (12), partitioned by stage (what an engine holds after a backward on one rank:
    tests/test_plan.py)."""
    w = layout.world
    stage = layout.zero_stage
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"trainer.zero_stage={stage}: expected 0-3")
    params = 2 * n // (w if stage == 3 else 1)
    grads = 2 * n // (w if stage >= 2 else 1)
    optimizer = 12 * n // (w if stage >= 1 else 1)
    return {"parameters": params, "gradients": grads, "optimizer": optimizer}


def optimizer_workspace_elements(facts: ModelFacts, ep: int) -> int:
    """Elements of the biggest tensor one rank's optimizer step works on whole: Engram tables take
    sparse row steps, so they do not count."""
    return max((facts.local(r.name, r.param.numel(), ep) for r in facts.routes
                if facts.kinds[r.name] != "engram"), default=0)


def activation_bytes(facts: ModelFacts, layout: Layout, checkpointed: int, rates: ActivationRates) -> int:
    """What a micro-step holds at the end of its forward, its peak, with `checkpointed` of the blocks
    (the first ones) checkpointed whole: the tensors each block saves for its backward, per token, layer
    and unit of width at the measured rate of a checkpointed block for those and of a whole one for the
    rest; the routed experts' weight copies of the whole blocks (`expert_weight_copies`, a constant per
    block); and the LM head's loss (`head_loss_bytes`). trainer.recompute_modules=[moe_act] keeps
    neither the copies nor the SwiGLU output in the whole blocks (trainer/parallelize.py)."""
    tokens = layout.tokens_per_rank
    per = rates.checkpointed * checkpointed + rates.full * (facts.n_layers - checkpointed)
    kept = int(per * facts.dim * tokens)
    if layout.moe_act:  # the SwiGLU outputs are part of a whole block's rate
        kept -= swiglu_bytes(facts, layout, checkpointed)
    else:
        kept += expert_weight_copies(facts, layout, checkpointed)
    return kept + head_loss_bytes(facts, layout)


def expert_weight_copies(facts: ModelFacts, layout: Layout, checkpointed: int) -> int:
    """The bf16 copies of the routed experts' weights that the blocks after the first `checkpointed`
    keep for their backward, whatever the tokens (model/moe.py RoutedExperts.forward_grouped): gate and
    up cast and stacked for one grouped GEMM, and down cast; bf16 weights (trainer.param_dtype=bf16)
    are used as they are but for the stacked gate and up. The rank's expert shards (1 / EP of them)."""
    low = facts.routed_low_precision(layout)
    return sum(BF16 * (gate_up + (0 if low else down))
               for gate_up, down in facts.expert_weights[checkpointed:]) // layout.ep


def swiglu_bytes(facts: ModelFacts, layout: Layout, checkpointed: int) -> int:
    """The SwiGLU outputs the MoE blocks after the first `checkpointed` keep for the down GEMM: one bf16
    row of the expert width per routed copy of a token."""
    blocks = sum(1 for gate_up, _ in facts.expert_weights[checkpointed:] if gate_up)
    return blocks * layout.tokens_per_rank * facts.n_activated_experts * facts.cfg.moe_inter_dim * BF16


def head_loss_bytes(facts: ModelFacts, layout: Layout) -> int:
    """The fused LM head and loss at the end of the forward (model/kernels/cross_entropy.py, kernels on):
    the head weight's bf16 copy (none where the weight is bf16), its fp32 gradient, which the forward
    computes and keeps for the backward, and the next chunk's sum beside it (the weight-gradient GEMM
    writes a new tensor); and two [chunk, vocab] bf16 buffers (model.loss_chunk_tokens, or the rank's
    tokens): a chunk's logits, overwritten in place with their gradient, and one more of that size,
    which the measured peaks hold at both widths whatever the tokens."""
    head = facts.head_numel()
    vocab = head // facts.dim
    chunk = min(facts.cfg.loss_chunk_tokens or layout.tokens_per_rank, layout.tokens_per_rank)
    copy = 0 if facts.low_precision(facts.head, layout) else BF16
    return (copy + 2 * FP32) * head + 2 * BF16 * vocab * chunk


def dispatch_bytes(facts: ModelFacts, layout: Layout) -> int:
    """One MoE layer's all-to-all buffers under EP: each routed copy of a token goes out and comes
    back in bf16 (send and receive buffers, both directions of the exchange)."""
    if layout.ep == 1:
        return 0
    return 2 * 2 * layout.tokens_per_rank * facts.n_activated_experts * facts.dim * 2


def accumulation_steps(layout: Layout, global_batch: int) -> int:
    """Micro-steps a rank runs per optimizer step for `global_batch` sequences over the cluster
    (0: one). Each data-parallel group (world / CP ranks) takes micro_batch sequences a micro-step."""
    if global_batch <= 0:
        return 1
    per_micro_step = layout.micro_batch * (layout.world // layout.cp)
    return max(1, -(-global_batch // per_micro_step))


def _link_gbs(ranks: int, gpus_per_node: int, gpu: GPUSpec) -> float:
    """GB/s per GPU of a collective among `ranks` consecutive ranks: NVLink inside a node, the
    network once the group spans nodes."""
    return (gpu.nvlink_gbs if ranks <= gpus_per_node else gpu.network_gbs) * 1e9


def step_time(facts: ModelFacts, layout: Layout, checkpointed: int, accumulation: int, gpu: GPUSpec,
              gpus_per_node: int, rates: StepRates) -> dict[str, float]:
    """Seconds of one optimizer step on a rank, by part, none overlapped (an upper bound where the
    trainer overlaps): the model's FLOPs at the measured fraction of the peak, the per-layer rest,
    moe_act's recomputed weight copies and SwiGLU, the EP all-to-all, the gradient reduction (dense
    and expert gradients in a ring, the Engram tables' sparse rows gathered from every rank), the
    optimizer's update and, at ZeRO-1, the owners' broadcast of the new weights, and host traffic:
    with host Engram tables, every lookup's row copied to the GPU and its gradient back over PCIe (an
    upper bound: repeated rows travel once), and the rows and gradients exchanged with their owners
    over the network; the owners' Sinkhorn update runs on the host CPU behind the step and is not
    counted."""
    tokens = layout.tokens_per_rank * accumulation
    # each checkpointed block runs its forward twice
    again = 1.0 + (rates.recompute - 1.0) * checkpointed / facts.n_layers
    peak = gpu.bf16_tflops * 1e12
    flops = tokens * facts.flops_per_token(layout.seq_len) * again
    parts = {"compute": flops / (peak * rates.compute_efficiency),
             "layers": accumulation * facts.n_layers * rates.layer_overhead_s * again}
    # trainer.recompute_modules=[moe_act]: each whole block's backward makes its experts' weight copies
    # and SwiGLU outputs again, the bytes it did not keep, at the rate measured for them
    remade = (expert_weight_copies(facts, layout, checkpointed) + swiglu_bytes(facts, layout, checkpointed)
              if layout.moe_act else 0)
    parts["moe_act recompute"] = accumulation * remade / rates.moe_act_bytes_per_s
    ep, world = layout.ep, layout.world
    # each routed copy of a token goes out and its result comes back, in the forward and again in
    # the backward, bf16; (ep - 1) / ep of it leaves the rank
    exchanged = 2 * 2 * tokens * facts.n_activated_experts * facts.dim * 2 * facts.n_layers * (ep - 1) / ep
    parts["all-to-all"] = exchanged / _link_gbs(ep, gpus_per_node, gpu) if ep > 1 else 0.0
    # fp32 gradients: dense ones reduced over every rank, expert shards over the world / EP ranks
    # that hold the same experts; a ring all-reduce (ZeRO-0) moves 2 (n - 1) / n of the bytes per
    # rank, ZeRO-1's reduce of each owner's bucket (n - 1) / n
    zero1 = layout.zero_stage >= 1
    passes = 1 if zero1 else 2
    # gradients reduced (a text-only run's vision tower has none, but at ZeRO-2, whose reducer sends
    # zeros for it) and parameters stepped (the tower only with images)
    dense = sum(r.param.numel() for r in facts.routes
                if facts.kinds[r.name] == "dense" and facts.gradient_held(r.name, layout))
    stepped = sum(r.param.numel() for r in facts.routes
                  if facts.kinds[r.name] == "dense" and facts.trained(r.name, layout))
    routed = sum(facts.local(r.name, r.param.numel(), ep) for r in facts.routes
                 if facts.kinds[r.name] == "routed")
    replicas = world // ep
    link = _link_gbs(world, gpus_per_node, gpu)
    # the tables' sparse row gradients are all-gathered: a rank receives every other rank's rows
    rows = facts.engram_rows_per_token * tokens * (facts.table_dim * FP32 + 8)
    gathered = 0 if layout.engram_host else rows * (world - 1)
    # ZeRO-2 reduces each micro-batch's gradients during its backward, in the gradient dtype
    per_step = accumulation if layout.zero_stage == 2 else 1
    gb = layout.grad_bytes if layout.zero_stage == 2 else FP32
    parts["gradient reduction"] = ((per_step * gb * dense * passes * (world - 1) / world + gathered) / link
                                   + per_step * gb * routed * passes * (replicas - 1) / replicas / link)
    # ZeRO-1: a rank updates its share of what it holds (the owners balance it), then each owner
    # broadcasts its new weights to the other replicas
    updated = stepped / world + routed / replicas if zero1 else stepped + routed
    parts["optimizer"] = updated * rates.optimizer_s_per_element
    # bf16 parameters (trainer.param_dtype=bf16) travel in bf16
    dense_b = sum((BF16 if facts.low_precision(r.name, layout) else FP32) * r.param.numel()
                  for r in facts.routes if facts.kinds[r.name] == "dense")
    routed_b = sum((BF16 if facts.low_precision(r.name, layout) else FP32)
                   * facts.local(r.name, r.param.numel(), ep)
                   for r in facts.routes if facts.kinds[r.name] == "routed")
    broadcast = dense_b * (world - 1) / world + routed_b * (replicas - 1) / replicas
    parts["weight broadcast"] = broadcast / link if zero1 else 0.0
    parts["host traffic"] = 0.0
    if layout.engram_host:
        row_bytes = facts.engram_rows_per_token * tokens * facts.table_dim * FP32  # each way
        link_gbs = gpu.network_gbs if world > gpus_per_node else gpu.host_link_gbs
        exchanged = 2 * row_bytes * (world - 1) / world / (link_gbs * 1e9)
        parts["host traffic"] = 2 * row_bytes / (gpu.pcie_gbs * 1e9) + exchanged
    return parts


@dataclass
class RankPlan:
    """One layout and what its fullest rank holds (bytes): each part at its largest, and the peak, the
    sum of those it holds at once."""
    layout: Layout
    checkpointed: int  # blocks with activation checkpointing (the first ones)
    parts: dict[str, int]
    engram_table_bytes: int
    capacity: int
    host_bytes: int = 0  # this rank's Engram row shards in host memory (not counted against capacity)
    peak: str = "forward"  # when the peak comes: the end of a forward, or the optimizer step
    # parts not held at the peak: the gradients, at the end of a forward of one micro-step a step
    absent: frozenset = frozenset()

    @property
    def total(self) -> int:
        return sum(v for name, v in self.parts.items() if name not in self.absent)

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def why_not(self) -> str:
        """The one-line reason a layout does not fit: the total, the capacity and the largest part."""
        held = {k: v for k, v in self.parts.items() if k not in self.absent}
        name, size = max(held.items(), key=lambda kv: kv[1])
        line = (f"needs {self.total / GIB:,.1f} GiB of {self.capacity / GIB:,.1f}; largest: {name} "
                f"{size / GIB:,.1f} GiB")
        if name in ("parameters", "optimizer") and self.engram_table_bytes:
            line += f" (Engram tables: {self.engram_table_bytes / GIB:,.1f} GiB of weights on every rank)"
        return line


def plan_rank(facts: ModelFacts, layout: Layout, checkpointed: int, rates: ActivationRates,
              capacity: int, accumulation: int = 1, state: dict[str, int] | None = None) -> RankPlan:
    """Per-rank memory of one layout at its peak (`peak`: when; `absent`: the parts not held then). The
    kept state (`state`: the layout's `state_bytes`, when already computed) is there throughout but for
    the composite optimizer's gradients: with one micro-step a step they do not exist until the backward
    (the step sets them to None), which frees the activations as it makes them, so the peak is the
    larger of the end of the forward (the activations, with the EP exchange buffers) and the optimizer
    step (the gradients and the step's workspace). With several micro-steps the gradients are there from
    the first backward on, under both; DeepSpeed's engine allocates its gradient buffers up front."""
    parts = dict(state) if state is not None else state_bytes(facts, layout, accumulation)
    acts = activation_bytes(facts, layout, checkpointed, rates) + dispatch_bytes(facts, layout)
    workspace = int(rates.optimizer_workspace * FP32 * optimizer_workspace_elements(facts, layout.ep))
    grads = parts["gradients"]
    up_front = accumulation > 1 or not facts.holds_whole_parameters(layout.ep)
    if (grads if up_front else 0) + acts > grads + workspace:
        parts["activations"], peak = acts, "forward"
        absent = frozenset() if up_front else frozenset({"gradients"})
    else:
        parts["optimizer workspace"], peak, absent = workspace, "optimizer step", frozenset()
    on_gpu = 0 if layout.engram_host else FP32 * facts.of_kind("engram")
    return RankPlan(layout, checkpointed, parts, on_gpu, capacity, host_table_bytes(facts, layout), peak,
                    absent)


def fewest_checkpointed(facts: ModelFacts, layout: Layout, rates: ActivationRates, capacity: int,
                        accumulation: int = 1, state: dict[str, int] | None = None) -> RankPlan | None:
    """The plan with the fewest checkpointed blocks that fits (each block left out runs its forward
    once), or None when even checkpointing all of them does not fit."""
    state = state_bytes(facts, layout, accumulation) if state is None else state
    plan = plan_rank(facts, layout, 0, rates, capacity, accumulation, state)
    if plan.fits:
        return plan
    if not plan_rank(facts, layout, facts.n_layers, rates, capacity, accumulation, state).fits:
        return None
    # activations fall with each checkpointed block by at most its rate's difference and its experts'
    # weight copies: start from the count that covers the excess at that, then step up past rounding
    # (the optimizer step may be the peak)
    copies = max((expert_weight_copies(facts, layout, k) - expert_weight_copies(facts, layout, k + 1)
                  for k in range(facts.n_layers)), default=0)
    saved = (rates.full - rates.checkpointed) * facts.dim * layout.tokens_per_rank + copies
    k = max(0, min(facts.n_layers, int((plan.total - capacity) // saved)))
    while not (plan := plan_rank(facts, layout, k, rates, capacity, accumulation, state)).fits:
        k += 1
    return plan


def candidate_layouts(facts: ModelFacts, world: int, model_cfg, seq_len: int, micro_batches, expert_parallel,
                      zero_stages, context_parallel=(1,), engram_tables=("gpu",),
                      grad_accum_dtypes=("fp32",), param_dtypes=("fp32",), recompute_modules=("none",),
                      images: bool = False) -> list[Layout]:
    """Every layout the trainer can run on `world` ranks among the given options: EP degrees that
    divide both the routed experts and the world (all of them when none are given), each CP degree
    (checked as a run checks it: it divides the world and cuts the sequence into valid slices),
    the ZeRO stages the optimizer path accepts (0-2 for the composite optimizer, 0-3 for
    DeepSpeed's) and, at the composite optimizer's ZeRO-2, each gradient dtype; at its ZeRO-1 and 2,
    each parameter dtype (trainer.param_dtype); each trainer.recompute_modules setting (none or
    moe_act). images: the run trains the vision tower (data.image_text_ratio > 0)."""
    from trainer.parallelize import check_training_layout

    experts = model_cfg.n_routed_experts
    degrees = list(expert_parallel) or [d for d in range(1, world + 1) if world % d == 0 and experts % d == 0]
    out = []
    for cp in context_parallel:
        for ep in degrees:
            check_training_layout(model_cfg, seq_len, world, ep, cp)
            # one rank has nothing to shard: stage 0 only
            whole = facts.holds_whole_parameters(ep)
            allowed = (0,) if world == 1 else (0, 1, 2) if whole else (0, 1, 2, 3)
            # host tables need a whole-sequence slice to hash (trainer/engram_host.py)
            places = [t for t in engram_tables if t == "gpu" or (cp == 1 and facts.of_kind("engram"))]
            out += [Layout(world, ep=ep, cp=cp, zero_stage=z, micro_batch=mb, seq_len=seq_len,
                           engram_host=t == "host", grad_accum_dtype=g, param_dtype=pd,
                           moe_act=rc == "moe_act", images=images)
                    for z in zero_stages if z in allowed for mb in micro_batches for t in places
                    for g in (grad_accum_dtypes if z == 2 and whole else ("fp32",))
                    for pd in (param_dtypes if z in (1, 2) and whole else ("fp32",))
                    for rc in recompute_modules]
    return out


# The planner's peaks are within 10% of every measured one (tests/test_plan.py,
# bench/reports/2026-12-07-planner-memory-refit.md): a layout is refused only when even that error
# could not make it fit.
REFUSE_OVER = 1.10


def check_layout_fits(model: nn.Module, optim: OptimConfig, layout: Layout, checkpointed: int,
                      capacity: int, gpu: str, accumulation: int = 1) -> RankPlan:
    """Before a GPU run builds anything: refuse, in one line, a layout whose fullest rank the planner
    puts above the card's memory by more than its measured error. Returns the plan."""
    rank = plan_rank(ModelFacts.of(model, optim), layout, checkpointed, ActivationRates(), capacity,
                     accumulation)
    if rank.total > REFUSE_OVER * capacity:
        parts = ", ".join(f"{name} {size / GIB:,.1f}" for name, size in rank.parts.items()
                          if name not in rank.absent)
        raise ConfigError(f"trainer: this layout needs about {rank.total / GIB:,.1f} GiB a GPU ({parts}) "
                          f"and the {gpu} has {capacity / GIB:,.1f} GiB; `flashtrain plan` lists the layouts "
                          "that fit (trainer.plan_check=false runs it anyway)")
    return rank
