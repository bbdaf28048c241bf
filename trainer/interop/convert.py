"""Import and export of the public layout, one part at a time (trainer/interop/layout.py).

Import reads tensors lazily through the index (safetensors memory-maps its files), so however the
public shards are cut, a process holds one part (a layer, or one Engram table) of decoded weights at
a time. Everything is checked before anything is converted: config.json against the model config,
every expected tensor's presence, safetensors dtype and shape, and every unexpected name; the error
is one line naming each offending tensor. Launched distributed, rank r converts parts r, r + world, ...
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Optional

import torch

from conf.model import ModelConfig
from model.engram import _draw_multipliers
from trainer.checkpoint import LATEST, CheckpointError, _write_atomic, tag_for, write_manifest
from trainer.distributed import barrier
from trainer.interop.codec import decode, encode, stored, stored_bytes
from trainer.interop.layout import DSPARK_PREFIX, Part, build_layout, config_mismatches, public_config

INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
KEPT_CONFIG = "public_config.json"  # the source's config.json, kept beside an imported checkpoint
PART_FILE = "model_part_{:05d}.pt"
TOKENIZER_KEYS = ("engram_pad_id", "engram_compressed_vocab_size")
EXPERT_CHUNK = 32  # routed experts quantised together on export


class InteropError(CheckpointError):
    """A public-layout checkpoint that does not fit the model, or a model the layout cannot hold."""


def is_public_dir(path: Path) -> bool:
    path = Path(path)
    return (path / CONFIG).is_file() and any(path.glob("*.safetensors"))


def model_layout(cfg: ModelConfig):
    """(state-dict shapes, parts, layer plan) of `cfg`, from a meta-device build (no memory)."""
    from model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    return shapes, build_layout(cfg, model.plan, shapes), model.plan


def engram_fields(model) -> dict[str, int]:
    """The tokenizer-derived config.json fields of a live model."""
    pads = [e.pad_id for e in model.engrams.values()]
    return {"engram_pad_id": pads[0] if pads else 0,
            "engram_compressed_vocab_size": int(model.lookup_map.max()) + 1}


class PublicReader:
    """config.json, and tensors by public name through the index (or the shards' own headers)."""

    def __init__(self, root: Path):
        from safetensors import safe_open

        self.root, self._safe_open, self._handles = Path(root), safe_open, {}
        if not (self.root / CONFIG).is_file():
            raise InteropError(f"{self.root}: no {CONFIG} (not a public-layout checkpoint)")
        self.config = json.loads((self.root / CONFIG).read_text())
        index = self.root / INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            weight_map = {name: f.name for f in sorted(self.root.glob("*.safetensors")) for name in self._file(f).keys()}
        self.files = {name: self.root / file for name, file in weight_map.items()}

    def _file(self, path: Path):
        if path not in self._handles:
            if not path.is_file():
                raise InteropError(f"{self.root}: the index names shard {path.name}, which does not exist")
            self._handles[path] = self._safe_open(str(path), framework="pt")
        return self._handles[path]

    def header(self, name: str) -> Optional[tuple[str, tuple[int, ...]]]:
        """(safetensors dtype, shape) from the header only; None when the shard lacks the tensor."""
        handle = self._file(self.files[name])
        if name not in handle.keys():
            return None
        piece = handle.get_slice(name)
        return piece.get_dtype(), tuple(piece.get_shape())

    def tensor(self, name: str) -> torch.Tensor:
        return self._file(self.files[name]).get_tensor(name)

    def release(self) -> None:
        """Drop the open shards (and their memory maps) between parts."""
        self._handles.clear()


def _expected_tensors(parts: list[Part]) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {e.name(suffix): spec for part in parts for e in part.entries
            for suffix, spec in stored(e.encoding, e.shape).items()}


def check_public(reader: PublicReader, parts: list[Part], expected_config: dict[str, Any], model_name: str,
                 dspark: str = "skip", log: Callable[[str], None] = print) -> None:
    """Raise one InteropError naming every problem; say what is skipped (DSpark tensors)."""
    if dspark not in ("skip", "error"):
        raise InteropError(f"dspark={dspark!r}: expected skip or error")
    problems = config_mismatches(expected_config, reader.config)
    expected = _expected_tensors(parts)
    for name, (dtype, shape) in expected.items():
        got = reader.header(name) if name in reader.files else None
        if got is None:
            problems.append(f"missing tensor {name}")
        elif got[0] != dtype:
            problems.append(f"{name}: dtype {got[0]}, expected {dtype}")
        elif got[1] != shape:
            problems.append(f"{name}: shape {list(got[1])}, expected {list(shape)}")
    drafter = sorted(n for n in reader.files if n.startswith(DSPARK_PREFIX))
    problems += [f"unexpected tensor {n}" for n in sorted(reader.files) if n not in expected and n not in drafter]
    if drafter and dspark == "error":
        problems.append(f"{len(drafter)} DSpark tensors ({drafter[0]}, ...): flashtrain has no DSpark drafter")
    reader.release()
    if problems:
        raise InteropError(f"{reader.root} does not fit model {model_name}: {'; '.join(problems)}")
    if drafter:
        log(f"flashtrain convert: skipping {len(drafter)} DSpark drafter tensors ({DSPARK_PREFIX}*): "
            "flashtrain has no DSpark module, so they are not imported and an export will not contain them")


def _derived(kind: str, key: str, shapes: dict[str, tuple[int, ...]], cfg: ModelConfig) -> torch.Tensor:
    if kind == "zeros":
        return torch.zeros(shapes[key])
    if kind == "engram_multipliers":  # engrams.<layer>.multipliers
        return _draw_multipliers(cfg, int(key.split(".")[1]))
    raise ValueError(f"unknown derived tensor kind {kind!r}")


def import_part(reader: PublicReader, part: Part, shapes: dict[str, tuple[int, ...]],
                cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The part's flashtrain tensors (fp32; int64 for hash multipliers), decoded from the layout."""
    out: dict[str, torch.Tensor] = {}
    for e in part.entries:
        value = decode(e.encoding, {s: reader.tensor(e.name(s)) for s in stored(e.encoding, e.shape)})
        if e.expert is None:
            out[e.source] = value.reshape(shapes[e.source])
        else:  # expert j of the stacked [E, out, in] parameter
            if e.source not in out:
                out[e.source] = torch.empty(shapes[e.source])
            out[e.source][e.expert] = value
    for key, kind in part.derived.items():
        out[key] = _derived(kind, key, shapes, cfg)
    return out


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


# ------------------------------------------------------------------ import
def import_into_model(model, root: Path, dspark: str = "skip", log: Callable[[str], None] = print) -> None:
    """Load a public-layout checkpoint into a live model (every rank loads all of it), part by part."""
    cfg, state = model.cfg, model.state_dict()
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    parts = build_layout(cfg, model.plan, shapes)
    reader = PublicReader(root)
    check_public(reader, parts, public_config(cfg, model.plan, cfg.vocab_size, engram_fields(model)), cfg.name,
                 dspark, log)
    filled = {"lookup_map"}  # built from the run's tokenizer, not stored in the layout
    with torch.no_grad():
        for part in parts:
            for name, tensor in import_part(reader, part, shapes, cfg).items():
                state[name].copy_(tensor)
                filled.add(name)
            reader.release()
    if set(state) - filled:
        raise InteropError(f"the layout does not fill {sorted(set(state) - filled)} of model {cfg.name}")


def import_checkpoint(root: Path, out_root: Path, cfg: ModelConfig, dspark: str = "skip",
                      log: Callable[[str], None] = print) -> Path:
    """Public layout at `root` -> a weights-only flashtrain checkpoint <out_root>/step_00000000
    (one torch file per part, a manifest, `latest`). Start training from it with model.init_from."""
    rank, world = _rank_world()
    reader = PublicReader(root)
    if cfg.vocab_size is None:
        cfg = dataclasses.replace(cfg, vocab_size=reader.config.get("vocab_size"))
    shapes, parts, plan = model_layout(cfg)
    tokenizer_fields = {k: reader.config[k] for k in TOKENIZER_KEYS if k in reader.config}
    check_public(reader, parts, public_config(cfg, plan, cfg.vocab_size, tokenizer_fields), cfg.name, dspark,
                 log if rank == 0 else (lambda _: None))
    tag = tag_for(0)
    staging, final = Path(out_root) / f".tmp_{tag}", Path(out_root) / tag
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    barrier()
    for k, part in enumerate(parts):
        if k % world == rank:
            torch.save(import_part(reader, part, shapes, cfg), staging / PART_FILE.format(k))
            reader.release()
    barrier()
    if rank == 0:
        shutil.copyfile(Path(root) / CONFIG, staging / KEPT_CONFIG)
        write_manifest(staging, 0)
        if final.exists():
            shutil.rmtree(final)
        staging.replace(final)
        _write_atomic(Path(out_root) / LATEST, tag)
        log(f"flashtrain convert: imported {root} ({len(parts)} parts) into {final}")
    barrier()
    return final


# ------------------------------------------------------------------ export
def export_state(state: Mapping[str, torch.Tensor], dst: Path, cfg: ModelConfig,
                 engram: Optional[dict[str, int]] = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """A flashtrain state dict (tensors may be memory-mapped) -> the public layout in `dst`. Each
    rank writes its parts' shards; rank 0 then writes the index and config.json. `engram`: the
    tokenizer-derived config fields when known (engram_fields)."""
    from safetensors.torch import save_file

    rank, world = _rank_world()
    if cfg.vocab_size is None:
        cfg = dataclasses.replace(cfg, vocab_size=state["embed.weight"].shape[0])
    shapes, parts, plan = model_layout(cfg)
    _check_source(state, shapes, cfg)
    config = public_config(cfg, plan, cfg.vocab_size, engram or {})
    dst = Path(dst)
    if rank == 0:
        dst.mkdir(parents=True, exist_ok=True)
        for old in [*dst.glob("model-*-of-*.safetensors"), dst / INDEX, dst / CONFIG]:
            old.unlink(missing_ok=True)
    barrier()
    weight_map, total = {}, 0
    for k, part in enumerate(parts):
        file = part.shard_file(k, len(parts))
        for e in part.entries:
            for suffix in stored(e.encoding, e.shape):
                weight_map[e.name(suffix)] = file
            total += stored_bytes(e.encoding, e.shape)
        if k % world != rank:
            continue
        tensors, stacks = {}, {}
        for e in part.entries:
            if e.expert is None:
                encoded = encode(e.encoding, state[e.source].float().reshape(e.shape))
            else:  # experts are encoded EXPERT_CHUNK at a time (row-wise blocks: the same codes as one by one)
                key = (e.source, e.expert // EXPERT_CHUNK)
                if key not in stacks:
                    stacks.clear()
                    lo = key[1] * EXPERT_CHUNK
                    stacks[key] = encode(e.encoding, state[e.source][lo:lo + EXPERT_CHUNK].float())
                encoded = {s: t[e.expert % EXPERT_CHUNK] for s, t in stacks[key].items()}
            for suffix, t in encoded.items():
                tensors[e.name(suffix)] = t
        save_file(tensors, str(dst / file), metadata={"format": "pt"})
    barrier()
    if rank == 0:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        _write_atomic(dst / INDEX, json.dumps(index, indent=2) + "\n")
        _write_atomic(dst / CONFIG, json.dumps(config, indent=2) + "\n")
        missing = [k for k in TOKENIZER_KEYS if k not in config]
        note = f" (config.json lacks the tokenizer-derived {missing})" if missing else ""
        log(f"flashtrain convert: exported {len(parts)} shards, {total / 2**20:.1f} MiB, to {dst}{note}")
    barrier()
    return {"shards": len(parts), "bytes": total, "tensors": len(weight_map)}


def _check_source(state: Mapping[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], cfg: ModelConfig) -> None:
    problems = [f"missing tensor {k}" for k in shapes if k not in state and k != "lookup_map"]
    problems += [f"unexpected tensor {k}" for k in state if k not in shapes]
    problems += [f"{k}: shape {list(state[k].shape)}, expected {list(s)}" for k, s in shapes.items()
                 if k in state and tuple(state[k].shape) != s]
    for key in shapes:
        if key.endswith(".multipliers") and key in state and not torch.equal(
                state[key].cpu(), _draw_multipliers(cfg, int(key.split(".")[1]))):
            problems.append(f"{key}: differ from the draw of model.engram_seed={cfg.engram_seed}, "
                            "which is all the public layout can carry")
    if problems:
        raise InteropError(f"the checkpoint does not fit model {cfg.name}: {'; '.join(problems)}")


def export_model(model, dst: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    return export_state(model.state_dict(), dst, model.cfg, engram_fields(model), log)
