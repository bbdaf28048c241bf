"""A run's starting weights: a flashtrain checkpoint, a run's checkpoints, or a directory in the
public DeepSeek-V4.1-Flash layout (imported on the fly). Above both trainer/checkpoint.py and
trainer/interop/, which it joins: the training stages call it, and neither of those imports it."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from trainer.checkpoint import ORIGIN, TOKENIZER, CheckpointError, load_model_weights, resolve_checkpoint
from trainer.interop.convert import check_imported, import_into_model, is_public_dir, origin_of


def load_init_weights(model: torch.nn.Module, source: str, what: str = "model.init_from") -> Path:
    """The starting weights of a run (`model.init_from`): a flashtrain checkpoint, a run's
    checkpoints/ dir or a run dir holding one (the newest complete checkpoint), or a directory in
    the public DeepSeek-V4.1-Flash layout (imported on the fly, shard by shard). Weights only: the
    optimiser and data start fresh. Every rank calls it (a checkpoint search is collective);
    returns the checkpoint or directory the weights came from."""
    path = resolve_init_source(source, what)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if is_public_dir(path):
        import_into_model(model, path, log=print if rank == 0 else (lambda _: None))
    else:
        check_imported(model, path)
        load_model_weights(model, path)
    return path


def checkpoint_attachments(tokenizer, weights_from: Optional[Path]) -> dict[str, str]:
    """What a run writes into each of its checkpoints besides the weights: its tokenizer, and the
    public-layout origin of the weights it started from (`weights_from`: model.init_from's
    checkpoint or directory, or the checkpoint a run resumed)."""
    out = {TOKENIZER: tokenizer.tokenizer.to_str()} if tokenizer is not None else {}
    origin = origin_of(weights_from) if weights_from is not None else None
    if origin is not None:
        out[ORIGIN] = json.dumps({"origin": str(origin)}) + "\n"
    return out


def resolve_init_source(source: str, what: str = "model.init_from") -> Path:
    """Where a run's starting weights come from: a public-layout directory as given, or the
    checkpoint that `source` names (resolve_checkpoint; collective). `what` names the setting in
    the error when `source` does not exist."""
    path = existing_init_source(source, what)
    return path if is_public_dir(path) else resolve_checkpoint(path, what)


def existing_init_source(source: str, what: str = "model.init_from") -> Path:
    """`source` as a path, or a one-line error naming `what` when nothing is there (checked before
    a run builds anything)."""
    path = Path(source).expanduser()
    if not path.exists():
        raise CheckpointError(f"{what}={source}: no such checkpoint or directory")
    return path
