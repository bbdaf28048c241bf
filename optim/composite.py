"""One optimiser made of Muon, Sinkhorn and AdamW, with whole-parameter ZeRO-1 sharding.

Muon orthogonalises whole matrices (or whole heads / experts) and Sinkhorn balances whole
tables, so neither may see the 1-D flat partitions that DeepSpeed's ZeRO-1/2 hand to an
optimiser. With `shard=True` this class is its own ZeRO-1: every parameter is owned by one
of the ranks that hold a replica of it (greedy by size, so the Newton-Schulz work spreads
evenly), only the owner keeps its optimiser state and computes its update, and the owner
broadcasts the new values to the other replicas. Dense parameters are replicated on every
rank; an expert-parallel shard only on its expert-data-parallel group. Gradients arrive
already averaged (the trainer reduces them, to each parameter's owner: `owner_ranks`).

State is keyed by parameter name, and an expert shard's state by its row offset in the
full expert stack, so a checkpoint written at one world size or EP degree loads at another.

Master weights (`master_weights=True`, trainer.param_dtype=bf16): a parameter held by at least
`master_min_replicas` ranks (by default 2: a copy on a rank that holds the only replica saves
nothing) and not in `keep_fp32` is stored in bf16 on every rank that holds it; its owner keeps the
fp32 master, which the sub-optimiser steps with an fp32 gradient (`master_of`: the trainer puts the
reduced gradient on the master's `.grad`), and broadcasts the rounded bf16 values, half the bytes of an
fp32 broadcast. The master is in the state dict under "master", keyed like momentum. The cast happens
in `store_params_low_precision`, after the trainer has loaded any weights or state into the fp32
parameters, so that a master starts from the exact fp32 value.
"""
from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from conf.optim import OptimConfig
from optim.muon import Muon
from optim.routing import Route
from optim.sinkhorn import Sinkhorn

STATE_FORMAT = "flashtrain-composite-2"


@dataclass(frozen=True)
class Replicas:
    """The ranks holding identical copies of a parameter, and their process group."""
    ranks: tuple[int, ...]
    group: Optional[dist.ProcessGroup] = None  # None: the default (world) group


def assign_owners(routes: list[Route], ranks: tuple[int, ...]) -> dict[str, int]:
    """Largest parameters first, each to the least-loaded rank (the lowest rank among equals):
    balanced and deterministic. A heap keeps it O(n log ranks): the planner assigns the flash
    model's thousands of parameters over hundreds of ranks for every layout it ranks."""
    heap = [(0, k) for k in sorted(ranks)]  # (load, rank): sorted, so already a heap
    owners = {}
    for r in sorted(routes, key=lambda r: (-r.param.numel(), r.name)):
        load, rank = heapq.heappop(heap)
        owners[r.name] = rank
        heapq.heappush(heap, (load + r.param.numel(), rank))
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
                 shard: bool = False, replicas: Optional[dict[int, Replicas]] = None,
                 row_offsets: Optional[dict[int, int]] = None, master_weights: bool = False,
                 keep_fp32: frozenset[int] = frozenset(), master_min_replicas: int = 2,
                 low_dtype: torch.dtype = torch.bfloat16):
        """replicas: id(param) -> Replicas for parameters not held by every rank (expert shards);
        row_offsets: id(param) -> first row of that shard in the full parameter;
        master_weights: store replicated parameters in `low_dtype` with an fp32 master on the owner
        (all but the ids in keep_fp32, and those held by fewer than master_min_replicas ranks)."""
        self.routes, self.rank = routes, rank
        self.shard = shard and world_size > 1
        everyone = Replicas(tuple(range(world_size)))
        replicas = replicas or {}
        self.replicas = {r.name: replicas.get(id(r.param), everyone) for r in routes}
        self.row_offsets = {r.name: (row_offsets or {}).get(id(r.param)) for r in routes}
        self.owners = {r.name: rank for r in routes}
        if self.shard:
            by_replicas: dict[Replicas, list[Route]] = defaultdict(list)
            for r in routes:
                by_replicas[self.replicas[r.name]].append(r)
            for rep, members in by_replicas.items():
                self.owners.update(assign_owners(members, rep.ranks))
        self.names = {id(r.param): r.name for r in routes}
        self.low_dtype = low_dtype
        # names of the parameters stored in low_dtype on every rank holding them
        self.low_precision = {r.name for r in routes if master_weights and id(r.param) not in keep_fp32
                              and len(self.replicas[r.name].ranks) >= master_min_replicas
                              and r.param.is_floating_point()}
        # name -> fp32 master, on the owner only; a clone now, refreshed by store_params_low_precision
        self.masters = {r.name: r.param.detach().clone() for r in routes
                        if r.name in self.low_precision and self.owners[r.name] == rank}
        self.names.update({id(m): name for name, m in self.masters.items()})
        self.params_low_precision = False
        grouped: dict[tuple, list[Route]] = defaultdict(list)
        for r in routes:
            if self.owners[r.name] == rank:
                grouped[r.group_key].append(r)
        by_optimizer: dict[str, list[dict]] = defaultdict(list)
        for (opt, lr_mult, wd, heads), members in grouped.items():
            # the sub-optimiser steps the master where there is one
            group = {"params": [self.masters.get(m.name, m.param) for m in members], "lr": cfg.lr * lr_mult,
                     "weight_decay": wd}
            if opt == "muon":
                group["heads"] = heads
            by_optimizer[opt].append(group)
        self.optimizers = {opt: _build(opt, groups, cfg) for opt, groups in by_optimizer.items()}
        # The base class keeps the members' own group dicts (it does not copy them), so an lr
        # scheduler acting on this object drives every member. A rank that owns nothing still
        # needs one (empty) group to be a valid optimiser.
        groups = [g for o in self.optimizers.values() for g in o.param_groups]
        super().__init__(groups or [{"params": []}], {})

    def owner_ranks(self) -> dict[int, int]:
        """id(param) -> the rank that steps it, when sharded (empty otherwise): a parameter's
        reduced gradient is needed there only."""
        return {id(r.param): self.owners[r.name] for r in self.routes} if self.shard else {}

    def master_of(self) -> dict[int, torch.Tensor]:
        """id(param) -> its fp32 master, for the parameters this rank owns that have one: the reduced
        fp32 gradient of such a parameter goes on the master's `.grad` (the parameter's own `.grad`
        would have to be bf16)."""
        return {id(r.param): self.masters[r.name] for r in self.routes if r.name in self.masters}

    def low_precision_params(self) -> list[torch.Tensor]:
        """The parameters of this rank stored in low_dtype (owned or not)."""
        return [r.param for r in self.routes if r.name in self.low_precision]

    @torch.no_grad()
    def store_params_low_precision(self) -> None:
        """Each master takes its parameter's current (fp32) value, then every rank's copy of those
        parameters is cast to low_dtype. Called once, after weights and state are loaded."""
        if self.params_low_precision:
            return
        for r in self.routes:
            if r.name in self.low_precision:
                if r.name in self.masters:
                    self.masters[r.name].copy_(r.param.data)
                r.param.data = r.param.data.to(self.low_dtype)
        self.params_low_precision = True

    def enable_sparse_table_grads(self, model: torch.nn.Module) -> int:
        """Give Engram tables routed to Sinkhorn sparse row gradients, so a step costs the rows a
        batch touched rather than a pass over the whole table. Returns how many tables."""
        sinkhorn = {id(r.param) for r in self.routes if r.optimizer == "sinkhorn"}
        tables = [m for m in model.modules()
                  if type(m).__name__ == "EngramTable" and id(m.weight) in sinkhorn]
        for table in tables:
            table.sparse_grad = True
        return len(tables)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = closure() if closure is not None else None
        for opt in self.optimizers.values():
            opt.step()
        for r in self.routes:  # the owner's new values, rounded to nearest
            if r.name in self.masters:
                r.param.data.copy_(self.masters[r.name])
        if self.shard:
            self._broadcast_from_owners()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for t in [r.param for r in self.routes] + list(self.masters.values()):
            if set_to_none:
                t.grad = None
            elif t.grad is not None:
                t.grad.zero_()

    def _broadcast_from_owners(self) -> None:
        """Every replica receives its owner's updated values: one flat buffer per (group, owner, dtype)
        (bf16 parameters under master weights travel as bf16)."""
        buckets: dict[tuple[Replicas, int, str], list[torch.Tensor]] = defaultdict(list)
        for r in self.routes:
            buckets[(self.replicas[r.name], self.owners[r.name], str(r.param.dtype))].append(r.param.data)
        for (rep, owner, _), tensors in sorted(buckets.items(), key=lambda kv: (kv[0][0].ranks, *kv[0][1:])):
            if len(rep.ranks) == 1:
                continue
            flat = _flatten_dense_tensors(tensors)
            dist.broadcast(flat, src=owner, group=rep.group)
            if owner != self.rank:
                for t, new in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
                    t.copy_(new)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """This rank's state: {name: [{"offset": first row or None, "state": {key: value}}]}."""
        state: dict[str, list] = {}
        for opt in self.optimizers.values():
            for p, s in opt.state.items():
                name = self.names[id(p)]
                entry = {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v) for k, v in s.items()}
                state[name] = [{"offset": self.row_offsets[name], "state": entry}]
        for name, master in self.masters.items():  # also before a master's first step
            piece = state.setdefault(name, [{"offset": self.row_offsets[name], "state": {}}])[0]
            piece["state"]["master"] = master.detach().cpu().clone()
        return {"format": STATE_FORMAT, "state": state}

    @staticmethod
    def merge_state_dicts(shards: list[dict[str, Any]]) -> dict[str, Any]:
        """The union of several ranks' state dicts (replicated copies of a piece collapse)."""
        merged: dict[str, dict] = defaultdict(dict)
        for shard in shards:
            if shard.get("format") != STATE_FORMAT:
                raise ValueError("not a CompositeOptimizer state dict")
            for name, pieces in shard["state"].items():
                for piece in pieces:
                    merged[name][piece["offset"]] = piece
        return {"format": STATE_FORMAT, "state": {n: list(p.values()) for n, p in merged.items()}}

    @staticmethod
    def saved_masters(state_dict: dict[str, Any]) -> dict[str, torch.Tensor]:
        """name -> the whole fp32 master of each parameter a (merged) state dict holds one of: the
        weights of a run with master weights, where its model states hold bf16 roundings."""
        out = {}
        for name, pieces in state_dict["state"].items():
            masters = sorted(((piece["offset"] or 0, piece["state"]["master"]) for piece in pieces
                              if "master" in piece["state"]), key=lambda offset_master: offset_master[0])
            if masters:
                out[name] = torch.cat([m for _, m in masters]) if len(masters) > 1 else masters[0][1]
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keeps the entries of the parameters this rank owns now; an expert shard's state is cut
        from the saved pieces (at any EP degree) by its row range. Saved masters (a run with master
        weights) become the values of every parameter of this rank that has one, owned or not (a
        state dict merged from all ranks holds them all), so the weights are the fp32 masters
        whether this run keeps masters or not. Call before store_params_low_precision."""
        if state_dict.get("format") != STATE_FORMAT:
            raise ValueError("not a CompositeOptimizer state dict")
        if self.params_low_precision:
            raise RuntimeError("load_state_dict after store_params_low_precision would round the masters")
        saved = state_dict["state"]
        for r in self.routes:
            pieces = [piece for piece in saved.get(r.name, []) if "master" in piece["state"]]
            if pieces:
                only = [{"offset": piece["offset"], "state": {"master": piece["state"]["master"]}}
                        for piece in pieces]
                r.param.data.copy_(self._cut(only, self.row_offsets[r.name], r.param)["master"])
        for opt in self.optimizers.values():
            for group in opt.param_groups:
                for p in group["params"]:
                    name = self.names[id(p)]
                    if name in saved:
                        state = self._cut(saved[name], self.row_offsets[name], p)
                        state.pop("master", None)
                        opt.state[p] = state

    @staticmethod
    def _cut(pieces: list[dict], offset: Optional[int], p: torch.Tensor) -> dict[str, Any]:
        pieces = sorted(pieces, key=lambda piece: piece["offset"] or 0)
        out = {}
        for key, first in pieces[0]["state"].items():
            if torch.is_tensor(first) and first.dim() > 0:
                full = torch.cat([piece["state"][key] for piece in pieces]) if len(pieces) > 1 else first
                rows = slice(offset or 0, (offset or 0) + p.shape[0]) if offset is not None else slice(None)
                out[key] = full[rows].to(p.device).clone()
            else:
                out[key] = first  # scalars such as AdamW's step count are equal on every piece
        return out
