"""The long-context stage: run the schedule's sub-stages in order, each a full training run in
its own directory (run_dir/stage_<i>_<name>/), each starting from the previous sub-stage's
final checkpoint. Re-running the command resumes inside the unfinished sub-stage, or starts
the next one from the finished one's checkpoint."""
from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from conf.errors import ConfigError
from conf.long_context import ContextStage, LongContextConfig
from conf.pretrain import PretrainConfig

INDEXER_REGIMES = ("dense_warmup", "sparse")


def stage_steps(stage: ContextStage, grad_accum: int, world_size: int) -> int:
    tokens_per_step = stage.micro_batch_size * grad_accum * world_size * stage.seq_len
    return max(1, math.ceil(stage.tokens / tokens_per_step))


def stage_config(cfg: LongContextConfig, stage: ContextStage, world_size: int) -> PretrainConfig:
    if stage.indexer not in INDEXER_REGIMES:
        raise ConfigError(f"schedule stage {stage.name}: indexer={stage.indexer!r}, expected "
                          f"{INDEXER_REGIMES}")
    model = dataclasses.replace(cfg.model, max_seq_len=max(cfg.model.max_seq_len, stage.seq_len),
                                indexer_mode="dense" if stage.indexer == "dense_warmup" else "sparse")
    if stage.rope_factor is not None:
        model = dataclasses.replace(model, rope_factor=stage.rope_factor)
    if stage.original_seq_len is not None:
        model = dataclasses.replace(model, original_seq_len=stage.original_seq_len)
    trainer = dataclasses.replace(cfg.trainer, micro_batch_size=stage.micro_batch_size,
                                  max_steps=stage_steps(stage, cfg.trainer.grad_accum_steps, world_size))
    return PretrainConfig(defaults=[], stage=f"long_context/{stage.name}", model=model,
                          data=dataclasses.replace(cfg.data, seq_len=stage.seq_len),
                          optim=dataclasses.replace(cfg.optim, lr=stage.lr), trainer=trainer,
                          logger=cfg.logger, launcher=cfg.launcher)


def check_schedule(cfg: LongContextConfig, world_size: int) -> None:
    """Every sub-stage's config errors (indexer regime, parallel layout at its sequence length),
    before the first one trains: a layout the 64K stage cannot take fails now, not after hours
    of the stages before it. The CLI runs it before a launcher starts workers, and
    `run_long_context` again in each worker."""
    from trainer.parallelize import check_training_layout  # torch, not the whole trainer

    if not cfg.schedule.stages:
        raise ConfigError("schedule.stages is empty: nothing to train")
    for stage in cfg.schedule.stages:
        scfg = stage_config(cfg, stage, world_size)
        tc = scfg.trainer
        try:
            check_training_layout(scfg.model, stage.seq_len, world_size, tc.expert_parallel,
                                  tc.context_parallel)
        except ConfigError as e:
            raise ConfigError(f"schedule stage {stage.name}: {e}") from e


def run_long_context(cfg: LongContextConfig, run_dir: Path, config_yaml: str) -> list[dict[str, Any]]:
    from trainer.pretrain import Trainer  # heavy: not needed by the CLI's check_schedule

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    check_schedule(cfg, world_size)
    previous = None  # the first sub-stage starts from model.init_from (the Trainer's default)
    summaries = []
    for i, stage in enumerate(cfg.schedule.stages):
        stage_dir = Path(run_dir) / f"stage_{i}_{stage.name}"
        scfg = stage_config(cfg, stage, world_size)
        trainer = Trainer(scfg, stage_dir, OmegaConf.to_yaml(OmegaConf.structured(scfg)), start_from=previous,
                          init_setting=f"the stage before {stage.name} (its checkpoints)",
                          train_only_indexer=stage.indexer == "dense_warmup")
        try:
            summaries.append({"stage": stage.name, "seq_len": stage.seq_len, **trainer.fit()})
        finally:
            trainer.close()
        previous = stage_dir / "checkpoints"
    return summaries
