"""Optimisers and schedules. `build_optimizer` routes parameters to Muon, Sinkhorn or AdamW by
rule (see `optim.routing`) and returns one optimiser for the engine."""
from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from conf.errors import ConfigError
from conf.optim import OptimConfig
from optim.composite import CompositeOptimizer, Replicas
from optim.routing import route_parameters, routing_table
from optim.schedule import lr_multiplier

__all__ = ["CompositeOptimizer", "Replicas", "build_optimizer", "lr_multiplier", "route_parameters",
           "routing_table"]


def build_optimizer(model: nn.Module, cfg: OptimConfig, zero_stage: int = 0, rank: int = 0,
                    world_size: int = 1, verbose: bool = False, replicas: dict[int, Replicas] | None = None,
                    row_offsets: dict[int, int] | None = None, master_weights: bool = False,
                    keep_fp32: frozenset[int] = frozenset()) -> torch.optim.Optimizer:
    """AdamW everywhere on a plainly replicated model: a torch AdamW that DeepSpeed's ZeRO (any
    stage) partitions. Any Muon or Sinkhorn route, or expert-parallel shards (`replicas`): a
    CompositeOptimizer, which needs whole parameters, so DeepSpeed must not partition it:
    zero_stage 0 replicates its state, 1 and 2 shard it by parameter (flashtrain's own ZeRO; at 2 the
    trainer also keeps each gradient on its owner alone: trainer/backward_reduce.py); ZeRO-3 is refused.
    master_weights / keep_fp32: the composite optimiser's bf16 parameters with fp32 masters on their
    owners (trainer.param_dtype=bf16), all but the parameter ids in keep_fp32."""
    try:
        return _build(model, cfg, zero_stage, rank, world_size, verbose, replicas, row_offsets,
                      master_weights, keep_fp32)
    except ConfigError:
        raise
    except ValueError as e:  # the optimisers' own checks of their hyperparameters (lr, momentum, ...)
        raise ConfigError(f"optim: {e}") from e


def _build(model, cfg, zero_stage, rank, world_size, verbose, replicas, row_offsets, master_weights,
           keep_fp32) -> torch.optim.Optimizer:
    routes = route_parameters(model, cfg)
    if verbose:
        print(f"flashtrain: optimizer routing (optim={cfg.name})\n{routing_table(routes)}", flush=True)
    if all(r.optimizer == "adamw" for r in routes) and not replicas:
        groups: dict[tuple, list] = defaultdict(list)
        for r in routes:
            groups[(r.lr_mult, r.weight_decay)].append(r.param)
        return torch.optim.AdamW([{"params": ps, "lr": cfg.lr * mult, "weight_decay": wd}
                                  for (mult, wd), ps in groups.items()],
                                 lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    if zero_stage not in (0, 1, 2):
        raise ConfigError(f"trainer.zero_stage={zero_stage} with optim={cfg.name} or expert parallelism: "
                          "the optimiser needs whole parameters, which ZeRO-3 splits; use zero_stage=1 "
                          "(state sharded by parameter) or 2 (gradients too)")
    return CompositeOptimizer(routes, cfg, rank, world_size, shard=zero_stage >= 1, replicas=replicas,
                              row_offsets=row_offsets, master_weights=master_weights, keep_fp32=keep_fp32)
