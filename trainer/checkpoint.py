"""Atomic, verified checkpoints around DeepSpeed's own save/load.

Layout under <run>/checkpoints/:
  step_00000100/              one complete checkpoint (DeepSpeed files + ours + manifest.json), with
                              the run's tokenizer.json and, for weights that came from a public-layout
                              checkpoint, origin.json (trainer/interop: what an export carries over)
  latest                      the tag of the newest complete checkpoint (written last)
  .tmp_step_00000200/         a save in progress; never read, removed by the next save
  step_00000300.corrupt/      a checkpoint that failed verification, kept for inspection

A save writes everything into a temp directory, writes a manifest with the size and sha256
of every file, renames the directory into place and only then updates `latest`. A process
killed at any moment therefore leaves either the previous state or a complete new one.
Resuming verifies manifests newest-first and falls back past anything incomplete or corrupt.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch

from conf.errors import UserError
from trainer.distributed import barrier, broadcast_object

MANIFEST = "manifest.json"
LATEST = "latest"
TRAINER_STATE = "trainer_state.pt"
TAG_PREFIX = "step_"
TOKENIZER = "tokenizer.json"  # the run's tokenizer, so that a checkpoint can be exported on its own
ORIGIN = "origin.json"  # {"origin": the public-layout directory the weights first came from}


class CheckpointError(UserError):
    """A checkpoint the user asked for cannot be used."""


def tag_for(step: int) -> str:
    return f"{TAG_PREFIX}{step:08d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_manifest(ckpt: Path, step: int) -> None:
    files = {str(p.relative_to(ckpt)): {"size": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(ckpt.rglob("*")) if p.is_file() and p.name != MANIFEST}
    _write_atomic(ckpt / MANIFEST, json.dumps({"step": step, "files": files}, indent=1))


# What a checkpoint's pickles may name besides tensors and plain containers (torch's weights_only
# set): numpy arrays and dtypes (the RNG states in rank_*_state.pt) and the bookkeeping objects of
# DeepSpeed's ZeRO optimiser states. DeepSpeed unpickles its files with weights_only=False, so a
# pickle naming anything else (os.system, a class with a malicious __setstate__) could run code.
PICKLE_GLOBALS = frozenset({
    "numpy.ndarray", "numpy.dtype", "numpy._core.multiarray._reconstruct",
    "numpy.core.multiarray._reconstruct", "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.runtime.zero.config.ZeroStageEnum", "deepspeed.runtime.fp16.loss_scaler.LossScaler",
})


def unsafe_pickle_globals(path: Path) -> list[str]:
    """The globals a torch file's pickle names that are neither in torch's weights_only set nor in
    PICKLE_GLOBALS (read from the pickle's opcodes; nothing is unpickled)."""
    from torch.serialization import get_unsafe_globals_in_checkpoint

    return [g for g in get_unsafe_globals_in_checkpoint(str(path))
            if g not in PICKLE_GLOBALS and not g.startswith("numpy.dtypes.")]


def _pickle_problem(ckpt: Path) -> Optional[str]:
    """Every .pt under the checkpoint (listed in the manifest or not: DeepSpeed finds its files by
    name) must unpickle nothing but data."""
    for path in sorted(ckpt.rglob("*.pt")):
        try:
            bad = unsafe_pickle_globals(path)
        except Exception as e:  # not a torch zip file: torch.load would fall back to plain pickle
            return f"{path.relative_to(ckpt)} is not a torch checkpoint file ({type(e).__name__})"
        if bad:
            return (f"{path.relative_to(ckpt)} pickles {', '.join(bad[:3])}, which flashtrain never writes "
                    "and which could run code when loaded: refused")
    return None


def verify(ckpt: Path) -> Optional[str]:
    """None when the checkpoint is complete and intact, else what is wrong with it."""
    try:
        manifest = json.loads((ckpt / MANIFEST).read_text())
    except FileNotFoundError:
        return "no manifest (incomplete save)"
    except (OSError, ValueError) as e:
        return f"unreadable manifest ({e})"
    for rel, meta in manifest.get("files", {}).items():
        path = ckpt / rel
        if not path.is_file():
            return f"missing file {rel}"
        if path.stat().st_size != meta["size"]:
            return f"{rel} has {path.stat().st_size} bytes, manifest says {meta['size']}"
        if _sha256(path) != meta["sha256"]:
            return f"{rel} fails its checksum"
    if not manifest.get("files"):
        return "empty manifest"
    return _pickle_problem(ckpt)


def _quarantine(ckpt: Path) -> None:
    target, n = ckpt.with_name(ckpt.name + ".corrupt"), 1
    while target.exists():
        target, n = ckpt.with_name(f"{ckpt.name}.corrupt{n}"), n + 1
    ckpt.rename(target)


class CheckpointManager:
    def __init__(self, root: Path, keep_last: int, rank: int, create: bool = True):
        """create=False: only to find and read checkpoints under root, which is left as it is."""
        self.root, self.keep_last, self.rank = Path(root), max(keep_last, 1), rank
        self.attachments: dict[str, str] = {}  # file name -> text, written into every checkpoint (rank 0)
        if rank == 0 and create:
            self.root.mkdir(parents=True, exist_ok=True)
        barrier()

    # ------------------------------------------------------------------ save
    def save(self, engine, step: int, trainer_state: dict[str, Any], rank_state: dict[str, Any],
             write_rank_files: Optional[Callable[[Path], None]] = None) -> Path:
        """Collective: every rank calls it. trainer_state is written by rank 0, rank_state
        (RNG streams) by every rank, and so are the files `write_rank_files` writes into the
        checkpoint directory (host Engram table shards), which the manifest then covers."""
        tag = tag_for(step)
        tmp_root = self.root / f".tmp_{tag}"
        if self.rank == 0:
            for stale in self.root.glob(".tmp_*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp_root.mkdir(parents=True)
        barrier()
        staged = tmp_root / tag
        try:
            engine.save_checkpoint(str(tmp_root), tag=tag, save_latest=False)
            staged.mkdir(parents=True, exist_ok=True)
            torch.save(rank_state, staged / f"rank_{self.rank:05d}_state.pt")
            if write_rank_files is not None:
                write_rank_files(staged)
            if self.rank == 0:
                torch.save(trainer_state, staged / TRAINER_STATE)
                for name, text in self.attachments.items():
                    (staged / name).write_text(text)
        except OSError as e:  # a full disk, a quota, a vanished mount: the last complete checkpoint stays
            shutil.rmtree(tmp_root, ignore_errors=True)  # give the space back
            previous = self.checkpoints()
            kept = f"{previous[-1].name} is intact" if previous else "there is no earlier checkpoint"
            raise CheckpointError(f"could not write checkpoint {tag} to {self.root} ({e.strerror or e}); "
                                  f"{kept}, resume from it once there is room") from None
        barrier()
        final = self.root / tag
        if self.rank == 0:
            _fsync_tree(staged)
            write_manifest(staged, step)
            if final.exists():  # a checkpoint of this step from a run that was later rolled back
                shutil.rmtree(final)
            os.replace(staged, final)
            shutil.rmtree(tmp_root, ignore_errors=True)
            _write_atomic(self.root / LATEST, tag)
            self._prune(keep=final)
        barrier()
        return final

    def _prune(self, keep: Path) -> None:
        complete = self.checkpoints()
        for old in complete[:-self.keep_last]:
            if old != keep:
                shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------------ find
    def checkpoints(self) -> list[Path]:
        """Checkpoint directories, oldest first (complete or not)."""
        if not self.root.is_dir():
            return []
        dirs = [p for p in self.root.iterdir()
                if p.is_dir() and p.name.startswith(TAG_PREFIX) and p.name[len(TAG_PREFIX):].isdigit()]
        return sorted(dirs, key=lambda p: int(p.name[len(TAG_PREFIX):]))

    def find_latest_valid(self) -> Optional[Path]:
        """Newest checkpoint that verifies. Corrupt ones are named in a warning and renamed to
        *.corrupt so that no later save or prune can touch them. Collective."""
        chosen = None
        if self.rank == 0:
            for ckpt in reversed(self.checkpoints()):
                problem = verify(ckpt)
                if problem is None:
                    chosen = str(ckpt)
                    break
                warnings.warn(f"checkpoint {ckpt} is unusable: {problem}; falling back to an older one",
                              stacklevel=2)
                _quarantine(ckpt)
        chosen = broadcast_object(chosen)
        return Path(chosen) if chosen else None

    def resolve(self, resume: str, what: str = "trainer.resume") -> Optional[Path]:
        """trainer.resume: 'auto' (newest valid here, else start fresh), 'none', or a path to a
        checkpoint directory or to a run's checkpoints/ directory. `what`: the setting that named
        it, for the errors."""
        if resume == "none":
            return None
        if resume == "auto":
            return self.find_latest_valid()
        path = Path(resume).expanduser()
        if (path / MANIFEST).exists() or path.name.startswith(TAG_PREFIX):
            if not path.is_dir():
                raise CheckpointError(f"{what}={resume}: no such checkpoint directory")
            problem = verify(path)
            if problem:
                raise CheckpointError(f"{what}={resume}: checkpoint is unusable: {problem}")
            return path
        if path.is_dir():
            found = CheckpointManager(path, self.keep_last, self.rank, create=False).find_latest_valid()
            if found is None:
                raise CheckpointError(f"{what}={resume}: no complete checkpoint in that directory")
            return found
        raise CheckpointError(f"{what}={resume}: no such checkpoint or directory")

    # ------------------------------------------------------------------ load
    def load(self, engine, ckpt: Path,
             load_optimizer_states: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
        """Restore DeepSpeed state from `ckpt`; return (trainer_state, this rank's rank_state)."""
        if not (ckpt / TRAINER_STATE).exists():
            raise CheckpointError(f"{ckpt} holds model weights only (flashtrain convert import): start a run "
                                  f"from it with model.init_from={ckpt}, not trainer.resume")
        try:
            load_path, _ = engine.load_checkpoint(str(ckpt.parent), tag=ckpt.name,
                                                  load_optimizer_states=load_optimizer_states,
                                                  load_lr_scheduler_states=True)
        except RuntimeError as e:  # torch's load_state_dict: one line per tensor that does not fit
            if "Error(s) in loading state_dict" not in str(e):
                raise
            first = next((ln.strip() for ln in str(e).splitlines()[1:] if ln.strip()), "")
            raise CheckpointError(f"{ckpt} was written by another model config ({first.rstrip('.')}): resume "
                                  "with the config it was trained with, or start a new run dir") from None
        if load_path is None:
            raise CheckpointError(f"DeepSpeed could not load {ckpt}")
        trainer_state = torch.load(ckpt / TRAINER_STATE, map_location="cpu", weights_only=True)
        rank_file = ckpt / f"rank_{self.rank:05d}_state.pt"
        rank_state = _load_verified(rank_file) if rank_file.exists() else {}
        return trainer_state, rank_state

    def all_rank_states(self, ckpt: Path) -> list[dict[str, Any]]:
        """Every rank's rank_state of `ckpt` (sharded optimiser state is merged from these, so
        the world size may change between save and load)."""
        return [_load_verified(f) for f in sorted(ckpt.glob("rank_*_state.pt"))]


def _load_verified(path: Path) -> Any:
    """A file of a checkpoint that verify() passed: its pickle names only PICKLE_GLOBALS besides
    torch's weights_only set (numpy's RNG arrays here), so it loads as DeepSpeed's files do."""
    return torch.load(path, map_location="cpu", weights_only=False)


def model_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """The model weights of a checkpoint, memory-mapped (read when touched): DeepSpeed's model
    states file, or the per-part files of a weights-only checkpoint (flashtrain convert import).
    Under ZeRO-3 the model states file holds empty partitions; the fp32 weights are then rebuilt
    from the optimiser shards with DeepSpeed's own zero_to_fp32. A run with trainer.param_dtype=bf16
    gives its fp32 masters in place of the bf16 weights its model states hold."""
    ckpt = Path(ckpt)
    files = sorted(ckpt.glob("mp_rank_*_model_states.pt"))
    if files:
        state = torch.load(files[0], map_location="cpu", weights_only=False, mmap=True)["module"]
        return {**state, **_host_tables(ckpt), **_masters(ckpt)}
    if any(ckpt.glob("zero_pp_rank_*_mp_rank_*_model_states.pt")):  # ZeRO-3: partitions only
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(ckpt.parent), tag=ckpt.name)
    parts = sorted(ckpt.glob("model_part_*.pt"))
    if not parts:
        raise CheckpointError(f"{ckpt}: no model states file")
    state: dict[str, torch.Tensor] = {}
    for part in parts:
        state.update(torch.load(part, map_location="cpu", weights_only=True, mmap=True))
    return state


def _masters(ckpt: Path) -> dict[str, torch.Tensor]:
    """The fp32 master weights of a run with trainer.param_dtype=bf16, whole, under their model names:
    its model states hold those parameters rounded to bf16, the masters are in the owners' optimiser
    state (optim/composite.py). Empty for any other run."""
    from optim.composite import STATE_FORMAT, CompositeOptimizer

    shards = [torch.load(f, map_location="cpu", weights_only=False, mmap=True).get("optimizer")
              for f in sorted(ckpt.glob("rank_*_state.pt"))]
    shards = [s for s in shards if isinstance(s, dict) and s.get("format") == STATE_FORMAT]
    return CompositeOptimizer.saved_masters(CompositeOptimizer.merge_state_dicts(shards)) if shards else {}


def _host_tables(ckpt: Path) -> dict[str, torch.Tensor]:
    """The Engram tables of a run with trainer.engram_tables=host, whole, under their model names
    (the model states leave them out; each rank wrote its rows beside them)."""
    from trainer.engram_host import SHARD_DIR, full_tables

    if not (ckpt / SHARD_DIR).is_dir():
        return {}
    return {f"engrams.{layer}.table.weight": table for layer, table in full_tables(ckpt).items()}


def load_model_weights(model: torch.nn.Module, ckpt: Path) -> None:
    """Model weights of a (verified) checkpoint into a plain, unsharded model: for evaluation
    and generation, without an engine. Checkpoints hold every expert (see full_experts). A
    checkpoint without `lookup_map` (an imported one) keeps the map the model built from its
    tokenizer."""
    missing, unexpected = model.load_state_dict(model_state(ckpt), strict=False)
    missing = [k for k in missing if k != "lookup_map"]
    if missing or unexpected:
        raise CheckpointError(f"{ckpt} does not fit this model: missing {missing[:3]}, unexpected "
                              f"{unexpected[:3]}")


def resolve_checkpoint(path: Path, what: str = "checkpoint") -> Path:
    """A checkpoint directory, or the newest complete one of a checkpoints/ dir or a run dir
    holding checkpoints/ (collective). `what`: the setting that named it, for the errors."""
    path = Path(path).expanduser()
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return CheckpointManager(path, 1, rank, create=False).resolve(str(path), what)
