"""What one rank of a training layout holds in GPU memory, predicted from the model built on the
meta device and the trainer's own rules, before anything is launched.

The trainer has two ways of holding a model (trainer/engine.py, optim/__init__.py):

  whole-parameter  optim=muon (any Muon or Sinkhorn route) or expert parallelism: fp32 weights and
                   gradients under bf16 autocast; the composite optimizer's state is fp32 (Muon and
                   Sinkhorn one buffer a parameter, AdamW two) and, at trainer.zero_stage=1, each
                   parameter's state lives only on its owner (optim/composite.py assign_owners).
                   Routed experts are sharded over the EP group and replicated over the ranks that
                   hold the same experts; Engram tables take sparse row gradients.
  DeepSpeed ZeRO   optim=adamw without EP: bf16 weights and gradients with fp32 master weights and
                   Adam moments that ZeRO stage 1, 2 and 3 partition over the ranks (2 + 2 + 12
                   bytes a parameter; stage 0 keeps fp32 gradients too).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from torch import nn

from conf.errors import ConfigError
from conf.optim import OptimConfig
from model.engram import Engram, EngramTable
from model.moe import RoutedExperts
from optim.composite import assign_owners
from optim.routing import route_parameters

GIB = 2**30
FP32 = 4
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

    @property
    def dp(self) -> int:
        return self.world // self.cp

    @property
    def tokens_per_rank(self) -> int:
        """Tokens one rank runs through the model in a micro-step (its CP slice of each sequence)."""
        return self.micro_batch * self.seq_len // self.cp


def holds_whole_parameters(optim: OptimConfig, ep: int) -> bool:
    """The composite optimizer's path (ZeRO-0/1 by hand) rather than DeepSpeed's ZeRO."""
    return optim.name != "adamw" or bool(optim.rules) or ep > 1


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


def state_bytes(model: nn.Module, optim: OptimConfig, layout: Layout) -> dict[str, int]:
    """Bytes of weights, gradients and optimizer state on the rank that holds the most:
    {"parameters", "gradients", "optimizer"}."""
    if layout.world % layout.ep or layout.world % layout.cp:
        raise ConfigError(f"plan: EP {layout.ep} and CP {layout.cp} must divide the {layout.world} ranks")
    routes = route_parameters(model, optim)
    kinds = _kinds(model)
    if not holds_whole_parameters(optim, layout.ep):
        return _deepspeed_bytes(sum(r.param.numel() for r in routes), layout)
    if layout.zero_stage not in (0, 1):
        raise ConfigError(f"plan: zero_stage {layout.zero_stage} with optim={optim.name} or expert "
                          "parallelism: the composite optimizer shards whole parameters (0 or 1)")
    local = {r.name: r.param.numel() // (layout.ep if kinds.get(id(r.param)) == "routed" else 1)
             for r in routes}
    dense_grads = sum(n for r in routes if kinds.get(id(r.param)) != "engram" for n in [local[r.name]])
    # sparse row gradients of the Engram tables: each read row's values (fp32) and its int64 index
    table_dim = max((m.weight.shape[1] for m in model.modules() if isinstance(m, EngramTable)), default=0)
    sparse = engram_rows_per_token(model) * layout.tokens_per_rank * (table_dim * FP32 + 8)
    return {"parameters": FP32 * sum(local.values()), "gradients": FP32 * dense_grads + sparse,
            "optimizer": _composite_state_bytes(routes, kinds, local, layout)}


def _composite_state_bytes(routes, kinds, local: dict[str, int], layout: Layout) -> int:
    """The largest rank's optimizer state. ZeRO-0: every rank keeps state for all it holds.
    ZeRO-1: dense parameters are owned across all ranks, an expert shard (EP > 1) across the ranks
    that hold the same experts (world / EP of them; rank r is member r // EP of its group)."""
    state = {r.name: STATE_BYTES[r.optimizer] * local[r.name] for r in routes}
    if layout.zero_stage == 0:
        return sum(state.values())
    # the composite optimizer balances each set of identically replicated parameters on its own;
    # without EP every parameter is replicated on every rank, so that is one set
    shards = [r for r in routes if layout.ep > 1 and kinds.get(id(r.param)) == "routed"]
    replicated = [r for r in routes if r not in shards]
    per_rank: dict[int, int] = defaultdict(int)
    for name, rank in assign_owners(replicated, tuple(range(layout.world))).items():
        per_rank[rank] += state[name]
    per_member: dict[int, int] = defaultdict(int)
    for name, member in assign_owners(shards, tuple(range(layout.world // layout.ep))).items():
        per_member[member] += state[name]
    return max(per_rank[r] + per_member[r // layout.ep] for r in range(layout.world))


def _deepspeed_bytes(n: int, layout: Layout) -> dict[str, int]:
    """DeepSpeed's bf16 ZeRO: bf16 weights (2 bytes), gradients (bf16; fp32 at stage 0, which
    accumulates in fp32), fp32 master weights and Adam moments (12), partitioned by stage."""
    w = layout.world
    stage = layout.zero_stage
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"plan: zero_stage {stage}: expected 0-3")
    params = 2 * n // (w if stage == 3 else 1)
    grads = (FP32 * n) if stage == 0 else 2 * n // (w if stage >= 2 else 1)
    optimizer = 12 * n // (w if stage >= 1 else 1)
    return {"parameters": params, "gradients": grads, "optimizer": optimizer}
