"""One optimiser made of Muon, Sinkhorn and AdamW, with whole-parameter ZeRO-1 sharding.

Muon orthogonalises whole matrices (or whole heads / experts) and Sinkhorn balances whole
tables, so neither may see the 1-D flat partitions that DeepSpeed's ZeRO-1/2 hand to an
optimiser. With `shard=True` this class is its own ZeRO-1: every parameter is owned by one
data-parallel rank (greedy by size, so the Newton-Schulz work spreads evenly), only the
owner keeps its optimiser state and computes its update, and the owner broadcasts the new
values. Gradients arrive already averaged over ranks (the engine all-reduces them).

State is keyed by parameter name, so a checkpoint written at one world size loads at another.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from conf.optim import OptimConfig
from optim.muon import Muon
from optim.routing import Route
from optim.sinkhorn import Sinkhorn


def assign_owners(routes: list[Route], world_size: int) -> dict[str, int]:
    """Largest parameters first, each to the least-loaded rank: balanced and deterministic."""
    load = [0] * world_size
    owners = {}
    for r in sorted(routes, key=lambda r: (-r.param.numel(), r.name)):
        rank = min(range(world_size), key=lambda k: (load[k], k))
        owners[r.name] = rank
        load[rank] += r.param.numel()
    return owners


def _build(optimizer: str, groups: list[dict], cfg: OptimConfig) -> torch.optim.Optimizer:
    if optimizer == "muon":
        return Muon(groups, lr=cfg.lr, momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov,
                    ns_steps=cfg.muon_ns_steps, rms_mode=cfg.muon_rms_mode, target_rms=cfg.muon_target_rms)
    if optimizer == "sinkhorn":
        return Sinkhorn(groups, lr=cfg.lr, momentum=cfg.sinkhorn_momentum, gamma=cfg.sinkhorn_gamma,
                        iters=cfg.sinkhorn_iters, tau=cfg.sinkhorn_tau)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


class CompositeOptimizer(torch.optim.Optimizer):
    def __init__(self, routes: list[Route], cfg: OptimConfig, rank: int = 0, world_size: int = 1,
                 shard: bool = False):
        self.routes, self.rank = routes, rank
        self.shard = shard and world_size > 1
        self.owners = assign_owners(routes, world_size) if self.shard else {r.name: rank for r in routes}
        self.names = {id(r.param): r.name for r in routes}
        grouped: dict[tuple, list[Route]] = defaultdict(list)
        for r in routes:
            if self.owners[r.name] == rank:
                grouped[r.group_key].append(r)
        by_optimizer: dict[str, list[dict]] = defaultdict(list)
        for (opt, lr_mult, wd, heads), members in grouped.items():
            group = {"params": [m.param for m in members], "lr": cfg.lr * lr_mult, "weight_decay": wd}
            if opt == "muon":
                group["heads"] = heads
            by_optimizer[opt].append(group)
        self.optimizers = {opt: _build(opt, groups, cfg) for opt, groups in by_optimizer.items()}
        # The base class keeps the members' own group dicts (it does not copy them), so an lr
        # scheduler acting on this object drives every member. A rank that owns nothing still
        # needs one (empty) group to be a valid optimiser.
        groups = [g for o in self.optimizers.values() for g in o.param_groups]
        super().__init__(groups or [{"params": []}], {})

    def enable_sparse_table_grads(self, model: torch.nn.Module) -> int:
        """Give Engram tables routed to Sinkhorn sparse row gradients, so a step costs the rows a
        batch touched rather than a pass over the whole table. Returns how many tables."""
        sinkhorn = {id(r.param) for r in self.routes if r.optimizer == "sinkhorn"}
        tables = [m for m in model.modules() if type(m).__name__ == "EngramTable" and id(m.weight) in sinkhorn]
        for table in tables:
            table.sparse_grad = True
        return len(tables)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = closure() if closure is not None else None
        for opt in self.optimizers.values():
            opt.step()
        if self.shard:
            self._broadcast_from_owners()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for r in self.routes:
            if set_to_none:
                r.param.grad = None
            elif r.param.grad is not None:
                r.param.grad.zero_()

    def _broadcast_from_owners(self) -> None:
        """Every rank receives each owner's updated parameters, one flat buffer per owner."""
        by_owner: dict[int, list[torch.Tensor]] = defaultdict(list)
        for r in self.routes:
            by_owner[self.owners[r.name]].append(r.param.data)
        for owner in sorted(by_owner):
            tensors = by_owner[owner]
            flat = _flatten_dense_tensors(tensors)
            dist.broadcast(flat, src=owner)
            if owner != self.rank:
                for t, new in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
                    t.copy_(new)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """This rank's state, by parameter name: {"format", "state": {name: {key: value}}}."""
        state = {}
        for opt in self.optimizers.values():
            for p, s in opt.state.items():
                state[self.names[id(p)]] = {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v)
                                            for k, v in s.items()}
        return {"format": "flashtrain-composite-1", "state": state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Accepts the union of any ranks' state dicts (see `merge_state_dicts`); keeps the
        entries of the parameters this rank owns now."""
        if state_dict.get("format") != "flashtrain-composite-1":
            raise ValueError("not a CompositeOptimizer state dict")
        saved = state_dict["state"]
        for opt in self.optimizers.values():
            for group in opt.param_groups:
                for p in group["params"]:
                    entry = saved.get(self.names[id(p)])
                    if entry is not None:
                        opt.state[p] = {k: (v.to(p.device) if torch.is_tensor(v) and v.dim() > 0 else v)
                                        for k, v in entry.items()}

    @staticmethod
    def merge_state_dicts(shards: list[dict[str, Any]]) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for shard in shards:
            merged.update(shard["state"])
        return {"format": "flashtrain-composite-1", "state": merged}
