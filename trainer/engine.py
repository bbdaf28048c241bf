"""The DeepSpeed engine: ZeRO stage, precision, accumulation and clipping from config."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from conf.errors import ConfigError
from conf.trainer import TrainerConfig
from trainer.distributed import DistInfo


def resolve_precision(cfg: TrainerConfig, device: torch.device) -> str:
    if cfg.precision not in ("auto", "fp32", "bf16", "fp64"):
        raise ConfigError(f"trainer.precision={cfg.precision!r}: expected auto, fp32, bf16 or fp64")
    if cfg.precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return cfg.precision


def check_trainer_counts(cfg: TrainerConfig) -> None:
    """ConfigError for a count or interval a run cannot use: a micro-batch or accumulation count
    below 1 (DeepSpeed would assert), log_every below 1, keep_last below 1 (no checkpoint would
    survive to resume from), a negative save / eval interval or grad_clip (0 means off / only at
    the end there)."""
    for name in ("micro_batch_size", "grad_accum_steps", "log_every", "keep_last"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"trainer.{name}={getattr(cfg, name)}: must be at least 1")
    for name in ("save_every", "eval_every", "grad_clip", "max_nonfinite_steps"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"trainer.{name}={getattr(cfg, name)}: must be >= 0 (0: off / only at the end)")


def deepspeed_config(cfg: TrainerConfig, zero_stage: int, bf16_master: bool,
                     clip: bool = True) -> dict[str, Any]:
    check_trainer_counts(cfg)
    if zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"trainer.zero_stage={zero_stage}: expected 0-3")
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum_steps,
        "gradient_clipping": cfg.grad_clip if clip else 0.0,
        "zero_optimization": {"stage": zero_stage},
        "bf16": {"enabled": bf16_master},
        "steps_per_print": 2**31 - 1,  # we log ourselves
        "wall_clock_breakdown": False,
    }


def keep_fp32_buffers(model: nn.Module) -> None:
    """bf16 engines cast floating buffers too; MoE balancing counters must stay fp32 (bf16
    cannot count past 256 exactly)."""
    for router in model.routers():
        for buf in (router.bias, router.bias_vl, *router.loads()):
            if buf is not None:
                buf.data = buf.data.float()


def build_engine(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, cfg: TrainerConfig,
                 dist: DistInfo, whole_param_optimizer: bool):
    """DeepSpeed engine. An optimiser that needs whole parameters (Muon/Sinkhorn, expert
    shards) runs on an unpartitioned engine (ZeRO-0) with fp32 master weights: bf16 then
    comes from DeepSpeed's torch_autocast, because its bf16 optimiser wrapper flattens
    parameters too. Returns (engine, precision)."""
    import deepspeed

    precision = resolve_precision(cfg, dist.device)
    zero_stage = 0 if whole_param_optimizer else cfg.zero_stage
    bf16_master = precision == "bf16" and not whole_param_optimizer
    ds_config = deepspeed_config(cfg, zero_stage, bf16_master, clip=not whole_param_optimizer)
    if precision == "bf16" and whole_param_optimizer:
        ds_config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    model.to(dist.device)
    if precision == "fp64":  # for numerical equivalence checks on CPU
        model.double()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=ds_config)
    if whole_param_optimizer:  # the trainer reduces (dense / expert / sparse) and clips itself
        engine.enable_backward_allreduce = False
    keep_fp32_buffers(engine.module)
    return engine, precision
