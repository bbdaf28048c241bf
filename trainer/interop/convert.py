"""Import and export of the public layout, one part at a time (trainer/interop/layout.py).

Import reads tensors lazily through the index (safetensors memory-maps its files), so however the
public shards are cut, a process holds one part (a layer, or one Engram table) of decoded weights at
a time. Everything is checked before anything is converted: config.json against the model config,
every expected tensor's presence, safetensors dtype and shape, and every unexpected name; the error
is one line naming each offending tensor. Launched distributed, rank r converts parts r, r + world, ...

The origin of a checkpoint is the public-layout directory its weights first came from (a released
checkpoint, or the `public/` folder `convert import` writes beside the weights it decodes). Export
reads from it what flashtrain's own weights cannot say: the tensors of modules flashtrain does not
train (carried through unchanged), the scale bytes that keep untrained weights byte-identical
(codec.py), the source's float dtypes, the config fields flashtrain has no use for, and the
tokenizer files.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Optional

import torch

from conf.errors import ConfigError
from conf.model import ModelConfig
from model.engram import build_compression_map, compressed_vocab, engram_hash_multipliers
from trainer.checkpoint import LATEST, ORIGIN, CheckpointError, _write_atomic, tag_for, write_manifest
from trainer.distributed import barrier
from trainer.interop.codec import HEADER_BYTES, decode, encode, stored, stored_bytes
from trainer.interop.layout import (
    CARRIED,
    DRAFTER_KEYS,
    DRAFTER_PREFIX,
    TOKENIZER_KEYS,
    Part,
    build_drafter_layout,
    build_layout,
    config_mismatches,
    drafter_config,
    drafter_mismatches,
    public_config,
)

INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
PUBLIC = "public"  # an imported checkpoint's folder of what its fp32 parts do not hold
HEADERS = "headers.json"  # in PUBLIC: dtype and shape of every tensor of the source
PART_FILE = "model_part_{:05d}.pt"
DRAFTER_DIR = "drafter"  # beside an import's checkpoints: the imported drafter's own checkpoints dir
EXPERT_CHUNK = 32  # routed experts quantised together on export
# files of a public directory that describe the tokenizer and generation, copied alongside the weights
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "generation_config.json", "chat_template.jinja")
FLOAT_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}


class InteropError(CheckpointError):
    """A public-layout checkpoint that does not fit the model, or a model the layout cannot hold."""


def is_public_dir(path: Path) -> bool:
    path = Path(path)
    return (path / CONFIG).is_file() and any(path.glob("*.safetensors"))


def origin_of(path: Path) -> Optional[Path]:
    """The public-layout directory the weights at `path` first came from: a public directory
    itself, an imported checkpoint's `public/` folder, or what a trained checkpoint recorded."""
    path = Path(path)
    if (path / PUBLIC / CONFIG).is_file():
        return (path / PUBLIC).resolve()
    if is_public_dir(path):
        return path.resolve()
    if (path / ORIGIN).is_file():
        return Path(json.loads((path / ORIGIN).read_text())["origin"])
    return None


def model_layout(cfg: ModelConfig):
    """(state-dict shapes, parts, layer plan) of `cfg`, from a meta-device build (no memory)."""
    from model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    return shapes, build_layout(cfg, model.plan, shapes), model.plan


def drafter_layout(cfg: ModelConfig):
    """(state-dict shapes, parts, config.json fields) of the DSpark drafter of the target `cfg`
    (its dspark_* keys size it), from a meta-device build."""
    from model.dspark import DSpark

    try:
        with torch.device("meta"):
            drafter = DSpark(cfg)
    except ValueError as e:
        raise ConfigError(f"model {cfg.name}'s drafter: {e}") from None
    shapes = {k: tuple(v.shape) for k, v in drafter.state_dict().items()}
    return (shapes, build_drafter_layout(drafter.cfg, drafter.plan, shapes),
            drafter_config(cfg, drafter.taps, drafter.noise_id))


def has_drafter(reader: PublicReader) -> bool:
    return any(n.startswith(DRAFTER_PREFIX) for n in reader.names())


class PublicReader:
    """config.json, and tensors by public name through the index (or the shards' own headers). An
    imported checkpoint's `public/` folder reads the same way; its headers.json describes every
    tensor of the source, also those whose data it does not keep."""

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
            weight_map = {name: f.name for f in sorted(self.root.glob("*.safetensors"))
                          for name in self._file(f).keys()}
        self.files = {name: self.root / file for name, file in weight_map.items()}
        headers = self.root / HEADERS
        self.headers = {k: (v[0], tuple(v[1])) for k, v in json.loads(headers.read_text()).items()} \
            if headers.is_file() else None

    def _file(self, path: Path):
        if path not in self._handles:
            if not path.is_file():
                raise InteropError(f"{self.root}: the index names shard {path.name}, which does not exist")
            self._handles[path] = self._safe_open(str(path), framework="pt")
        return self._handles[path]

    def names(self) -> list[str]:
        """Every tensor of the source."""
        return sorted(self.headers) if self.headers is not None else sorted(self.files)

    def header(self, name: str) -> Optional[tuple[str, tuple[int, ...]]]:
        """(safetensors dtype, shape) from the header only; None when the source lacks the tensor."""
        if self.headers is not None:
            return self.headers.get(name)
        if name not in self.files:
            return None
        handle = self._file(self.files[name])
        if name not in handle.keys():
            return None
        piece = handle.get_slice(name)
        return piece.get_dtype(), tuple(piece.get_shape())

    def has_data(self, name: str) -> bool:
        return name in self.files

    def tensor(self, name: str) -> torch.Tensor:
        return self._file(self.files[name]).get_tensor(name)

    def carried(self, parts: list[Part]) -> list[str]:
        """The source's tensors of modules the model does not have (layout.CARRIED, less the modules
        the layout `parts` map)."""
        mapped = _mapped_modules(parts)
        return [n for n in self.names() if _carriable(n, mapped)]

    def tokenizer_files(self) -> list[Path]:
        return [self.root / f for f in TOKENIZER_FILES if (self.root / f).is_file()]

    def release(self) -> None:
        """Drop the open shards (and their memory maps) between parts."""
        self._handles.clear()


def _expected_tensors(parts: list[Part]) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {e.name(suffix): spec for part in parts for e in part.entries
            for suffix, spec in stored(e.encoding, e.shape).items()}


def _module(name: str) -> str:
    """Which optional module (layout.CARRIED) a tensor belongs to: mtp, vision, aligner, a delimiter,
    or the image tokens' routing bias."""
    return "bias_vl" if name.endswith(".bias_vl") else name.split(".")[0]


def _mapped_modules(parts: list[Part]) -> set[str]:
    return {_module(e.public) for part in parts for e in part.entries if CARRIED.search(e.public)}


def _carriable(name: str, mapped: set[str]) -> bool:
    """Carried through unchanged: a tensor of an optional module that the layout does not map (one
    it maps must match it tensor for tensor)."""
    return bool(CARRIED.search(name)) and _module(name) not in mapped


# names of DeepSeek-V4-Flash's drafter, whose mHC ends in an hc_head mix and whose Markov head is
# markov_w1 / markov_w2: the V4.1 release (and flashtrain's drafter) collapse the streams with the
# last block's own pre-mix and name it embed / head
V4_DRAFTER_NAMES = ("hc_head_", "markov_w1", "markov_w2")


def check_public(reader: PublicReader, parts: list[Part], expected_config: dict[str, Any], model_name: str,
                 log: Callable[[str], None] = print, drafter: Optional[dict[str, Any]] = None) -> list[str]:
    """Raise one InteropError naming every problem; name the tensors that are carried, not
    imported, in one warning line. Returns those names. `drafter`: config.json's drafter fields the
    model sizes, when `parts` include the drafter's."""
    problems = config_mismatches(expected_config, reader.config)
    if drafter is not None:
        problems += drafter_mismatches(drafter, reader.config)
    expected = _expected_tensors(parts)
    for name, (dtype, shape) in expected.items():
        got = reader.header(name)
        if got is None:
            problems.append(f"missing tensor {name}")
        elif not reader.has_data(name) and not name.endswith(".scale"):
            problems.append(f"{name}: described but not held (an imported checkpoint's {PUBLIC}/ folder: "
                            "give the checkpoint itself)")
            break
        elif got[0] != dtype and not (dtype in FLOAT_DTYPES and got[0] in FLOAT_DTYPES):
            problems.append(f"{name}: dtype {got[0]}, expected {dtype}")
        elif got[1] != shape:
            problems.append(f"{name}: shape {list(got[1])}, expected {list(shape)}")
    carried = reader.carried(parts)
    mapped = _mapped_modules(parts)
    unexpected = [n for n in reader.names() if n not in expected and not _carriable(n, mapped)]
    problems += [f"unexpected tensor {n}" for n in unexpected]
    if any(n.startswith(DRAFTER_PREFIX) and any(k in n for k in V4_DRAFTER_NAMES) for n in unexpected):
        problems.append("these mtp.* names are DeepSeek-V4-Flash's drafter layout (an hc_head output mix, "
                        "markov_w1/w2), which V4.1's drafter and flashtrain's do not have")
    reader.release()
    if problems:
        raise InteropError(f"{reader.root} does not fit model {model_name}: {'; '.join(problems)}")
    if carried:
        groups = sorted({n.split(".")[0] if not n.startswith("layers.") else "layers.*.ffn.gate.bias_vl"
                         for n in carried})
        log(f"flashtrain convert: warning: {len(carried)} tensors of modules flashtrain does not train "
            f"({', '.join(groups)}) are carried through unchanged: not in the model, written back on export")
    return carried


def _tokenizer_fields(reader: PublicReader) -> dict[str, int]:
    return {k: reader.config[k] for k in TOKENIZER_KEYS if k in reader.config}


def _derived(kind: str, key: str, shapes: dict[str, tuple[int, ...]], config: dict[str, Any]) -> torch.Tensor:
    if kind == "zeros":
        return torch.zeros(shapes[key])
    if kind == "engram_multipliers":  # engrams.<layer>.multipliers, from the source's compressed vocabulary
        return engram_hash_multipliers(int(key.split(".")[1]), shapes[key][0],
                                       int(config["engram_compressed_vocab_size"]))
    raise ValueError(f"unknown derived tensor kind {kind!r}")


def import_part(reader: PublicReader, part: Part,
                shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
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
        out[key] = _derived(kind, key, shapes, reader.config)
    return out


def save_shard(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' save_file, with the mode any other file of the run gets: it creates its files
    0600 whatever the umask, so an export would be unreadable to the users it is shared with."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _check_compressed_vocab(model, config: dict[str, Any], root: Path) -> None:
    """The Engram hash depends on the compressed vocabulary: the run's tokenizer must give the
    source's."""
    if not len(model.engrams) or "engram_compressed_vocab_size" not in config:
        return
    mine, theirs = compressed_vocab(model.lookup_map), int(config["engram_compressed_vocab_size"])
    if mine != theirs:
        raise InteropError(f"{root}: config.json says engram_compressed_vocab_size={theirs}, but the run's "
                           f"tokenizer compresses to {mine} ids: train with the tokenizer these weights were "
                           "trained with (data.tokenizer_path)")


def check_imported(model, ckpt: Path) -> None:
    """Before a `convert import` checkpoint's weights go into `model`: its Engram hash
    multipliers were drawn for the source's compressed vocabulary, which the run's must match."""
    config = Path(ckpt) / PUBLIC / CONFIG
    if config.is_file():
        _check_compressed_vocab(model, json.loads(config.read_text()), Path(ckpt))


# ------------------------------------------------------------------ import
def import_into_model(model, root: Path, log: Callable[[str], None] = print) -> None:
    """Load a public-layout checkpoint into a live model (every rank loads all of it), part by part."""
    cfg, state = model.cfg, model.state_dict()
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    parts = build_layout(cfg, model.plan, shapes)
    reader = PublicReader(root)
    _check_compressed_vocab(model, reader.config, reader.root)
    check_public(reader, parts, public_config(cfg, model.plan, cfg.vocab_size, _tokenizer_fields(reader)),
                 cfg.name, log)
    filled = {"lookup_map"}  # built from the run's tokenizer, not stored in the layout
    with torch.no_grad():
        for part in parts:
            for name, tensor in import_part(reader, part, shapes).items():
                state[name].copy_(tensor)
                filled.add(name)
            reader.release()
    if set(state) - filled:
        raise InteropError(f"the layout does not fill {sorted(set(state) - filled)} of model {cfg.name}")


def _unfilled(parts: list[Part], shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """State-dict keys no entry or derived rule of `parts` fills (lookup_map comes from the run's
    tokenizer)."""
    filled = {e.source for part in parts for e in part.entries} | {k for part in parts for k in part.derived}
    return sorted(set(shapes) - filled - {"lookup_map"})


def import_checkpoint(root: Path, out_root: Path, cfg: ModelConfig,
                      log: Callable[[str], None] = print, drafter: bool = True) -> Path:
    """Public layout at `root` -> a weights-only flashtrain checkpoint <out_root>/step_00000000
    (one torch file per part, a manifest, `latest`) and its `public/` folder: the source's
    config.json, tokenizer files, tensor headers, scale bytes and carried tensors, so that an
    export of it needs nothing else. Start training from it with model.init_from.

    A source with a DSpark drafter (`mtp.*`) has it imported too (`drafter`; False carries it
    through unchanged instead), into a weights-only checkpoint of its own,
    <out_root>/drafter/step_00000000 (`rl.drafter=<out_root>/drafter`), sized by the model
    config's dspark_* keys, which must agree with config.json; `public/` keeps the drafter's
    tensors as stored, so that an export without another drafter writes them back unchanged."""
    rank, world = _rank_world()
    reader = PublicReader(root)
    if cfg.vocab_size is None:
        cfg = dataclasses.replace(cfg, vocab_size=reader.config.get("vocab_size"))
    shapes, parts, plan = model_layout(cfg)
    d_shapes, d_parts, d_config = drafter_layout(cfg) if drafter and has_drafter(reader) else ({}, [], None)
    unfilled = _unfilled(parts, shapes) + _unfilled(d_parts, d_shapes)
    if unfilled:
        raise InteropError(f"the layout does not fill {unfilled} of model {cfg.name}")
    carried = check_public(reader, parts + d_parts,
                           public_config(cfg, plan, cfg.vocab_size, _tokenizer_fields(reader)),
                           cfg.name, log if rank == 0 else (lambda _: None), d_config)
    kept = carried + ([n for n in reader.names() if n.startswith(DRAFTER_PREFIX)] if d_parts else [])
    tag = tag_for(0)
    out_root = Path(out_root)
    staging, final = out_root / f".tmp_{tag}", out_root / tag
    d_root = out_root / DRAFTER_DIR
    d_staging = out_root / f".tmp_{DRAFTER_DIR}_{tag}"
    if rank == 0:
        for d in (staging, d_staging):
            shutil.rmtree(d, ignore_errors=True)
        (staging / PUBLIC).mkdir(parents=True)
        if d_parts:
            d_staging.mkdir()
    barrier()
    for k, part in enumerate(parts + d_parts):
        if k % world != rank:
            continue
        if k < len(parts):
            torch.save(import_part(reader, part, shapes), staging / PART_FILE.format(k))
            scales = {e.name("scale"): reader.tensor(e.name("scale")) for e in part.entries if e.encoding
                      not in ("bf16", "fp32")}
            if scales:
                save_shard(scales, staging / PUBLIC / f"scales-{k:05d}.safetensors")
        else:  # the drafter's scales are among the tensors public/ keeps
            torch.save(import_part(reader, part, d_shapes), d_staging / PART_FILE.format(k - len(parts)))
        reader.release()
    if rank == (len(parts) + len(d_parts)) % world and kept:
        save_shard({n: reader.tensor(n) for n in kept}, staging / PUBLIC / "carried.safetensors")
        reader.release()
    barrier()
    if rank == 0:
        shutil.copyfile(Path(root) / CONFIG, staging / PUBLIC / CONFIG)
        for f in reader.tokenizer_files():
            shutil.copyfile(f, staging / PUBLIC / f.name)
        headers = {n: [*reader.header(n)] for n in reader.names()}
        (staging / PUBLIC / HEADERS).write_text(json.dumps(headers, indent=0) + "\n")
        reader.release()
        write_manifest(staging, 0)
        if final.exists():
            shutil.rmtree(final)
        staging.replace(final)
        _write_atomic(out_root / LATEST, tag)
        shutil.rmtree(d_root, ignore_errors=True)  # an earlier import's drafter belongs to other weights
        note = ""
        if d_parts:
            write_manifest(d_staging, 0)
            d_root.mkdir()
            d_staging.replace(d_root / tag)
            _write_atomic(d_root / LATEST, tag)
            note = f"; its drafter ({len(d_parts)} blocks) into {d_root / tag} (rl.drafter={d_root})"
        log(f"flashtrain convert: imported {root} ({len(parts)} parts) into {final}{note}")
    barrier()
    return final


def import_drafter(root: Path, cfg: ModelConfig,
                   log: Callable[[str], None] = print) -> dict[str, torch.Tensor]:
    """The DSpark drafter of a public-layout directory, as a state dict for model/dspark.py's DSpark
    of the target `cfg` (the whole directory is checked against the model, as any import)."""
    reader = PublicReader(root)
    if not has_drafter(reader):
        raise InteropError(f"{reader.root} holds no drafter (no mtp.* tensors)")
    shapes, parts, plan = model_layout(cfg)
    d_shapes, d_parts, d_config = drafter_layout(cfg)
    check_public(reader, parts + d_parts, public_config(cfg, plan, cfg.vocab_size, _tokenizer_fields(reader)),
                 cfg.name, log, d_config)
    state: dict[str, torch.Tensor] = {}
    for part in d_parts:
        state.update(import_part(reader, part, d_shapes))
        reader.release()
    return state


# ------------------------------------------------------------------ export
def export_state(state: Mapping[str, torch.Tensor], dst: Path, cfg: ModelConfig, tokenizer=None,
                 origin: Optional[Path] = None, log: Callable[[str], None] = print,
                 drafter: Optional[Mapping[str, torch.Tensor]] = None,
                 origin_drafter: bool = True) -> dict[str, Any]:
    """A flashtrain state dict (tensors may be memory-mapped) -> the public layout in `dst`: the
    shards, the index, config.json and the tokenizer files. Each rank writes its parts' shards;
    rank 0 then writes the rest. `tokenizer`: the run's TextTokenizer (None: no tokenizer files
    unless the origin has them); `origin`: the public directory the weights came from (None:
    none). `drafter`: a DSpark drafter's state dict (model/dspark.py, sized by cfg's dspark_*
    keys), written as `mtp.*` with its config.json fields, in place of any drafter of the origin's;
    without one, the origin's drafter is carried through unchanged, or left out with
    `origin_drafter=False`."""
    rank, world = _rank_world()
    if cfg.vocab_size is None:
        cfg = dataclasses.replace(cfg, vocab_size=state["embed.weight"].shape[0])
    shapes, parts, plan = model_layout(cfg)
    source = PublicReader(origin) if origin is not None else None
    _check_source(state, shapes, "the checkpoint does not fit this model")
    d_parts, d_config = [], None
    if drafter is not None:
        d_shapes, d_parts, d_config = drafter_layout(cfg)
        _check_source(drafter, d_shapes, f"the drafter does not fit model {cfg.name}'s dspark_* settings")
    config = _export_config(state, cfg, plan, tokenizer, source, d_config, origin_drafter)
    _check_engram_state(state, shapes, config, tokenizer)
    carried = source.carried(parts + d_parts) if source is not None else []
    if not origin_drafter:
        carried = [n for n in carried if not n.startswith(DRAFTER_PREFIX)]
    missing = [n for n in carried if not source.has_data(n)]
    if missing:
        raise InteropError(f"origin {source.root} names {len(missing)} tensors it does not hold "
                           f"({missing[0]}, ...)")
    dst = Path(dst)
    if rank == 0:
        dst.mkdir(parents=True, exist_ok=True)
        for old in [*dst.glob("model-*-of-*.safetensors"), dst / INDEX, dst / CONFIG]:
            old.unlink(missing_ok=True)
    barrier()
    all_parts = parts + d_parts
    n_shards = len(all_parts) + (1 if carried else 0)
    shard = lambda k: f"model-{k + 1:05d}-of-{n_shards:05d}.safetensors"  # noqa: E731
    weight_map, total = {}, 0
    for k, part in enumerate(all_parts):
        for e in part.entries:
            for suffix in stored(e.encoding, e.shape):
                weight_map[e.name(suffix)] = shard(k)
            total += stored_bytes(e.encoding, e.shape)
        if k % world == rank:
            save_shard(_encode_part(part, state if k < len(parts) else drafter, source), dst / shard(k))
            if source is not None:
                source.release()
    if carried:
        for name in carried:
            weight_map[name] = shard(len(all_parts))
            dtype, shape = source.header(name)
            total += int(HEADER_BYTES[dtype] * torch.Size(shape).numel())
        if len(all_parts) % world == rank:
            save_shard({n: source.tensor(n) for n in carried}, dst / shard(len(all_parts)))
            source.release()
    barrier()
    if rank == 0:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        _write_atomic(dst / INDEX, json.dumps(index, indent=2) + "\n")
        _write_atomic(dst / CONFIG, json.dumps(config, indent=2) + "\n")
        note = _write_tokenizer(dst, tokenizer, source)
        if d_parts:
            note += f" (with the drafter: {len(d_parts)} mtp.* blocks)"
        log(f"flashtrain convert: exported {n_shards} shards, {total / 2**20:.1f} MiB, to {dst}{note}")
    barrier()
    return {"shards": n_shards, "bytes": total, "tensors": len(weight_map), "carried": len(carried),
            "drafter_blocks": len(d_parts)}


def _encode_part(part: Part, state: Mapping[str, torch.Tensor],
                 source: Optional[PublicReader]) -> dict[str, torch.Tensor]:
    """The stored tensors of one part. With an origin, quantised blocks it represents exactly keep
    its scales (codec.py) and float tensors keep its dtype."""
    def hint(e):
        name = e.name("scale")
        return source.tensor(name) if source is not None and e.encoding not in ("bf16", "fp32") \
            and source.has_data(name) else None

    def float_dtype(e):
        header = source.header(e.public) if source is not None else None
        return FLOAT_DTYPES.get(header[0]) if header is not None else None

    experts = {(e.source, e.expert): e for e in part.entries if e.expert is not None}
    tensors, stacks = {}, {}
    for e in part.entries:
        if e.expert is None:
            encoded = encode(e.encoding, state[e.source].float().reshape(e.shape), hint(e), float_dtype(e))
        else:  # experts are encoded EXPERT_CHUNK at a time (row-wise blocks: the same codes as one by one)
            key = (e.source, e.expert // EXPERT_CHUNK)
            if key not in stacks:
                stacks.clear()
                lo = key[1] * EXPERT_CHUNK
                chunk = state[e.source][lo:lo + EXPERT_CHUNK].float()
                hints = [hint(experts[e.source, j]) for j in range(lo, lo + chunk.shape[0])]
                stacked_hint = torch.stack(hints) if all(h is not None for h in hints) else None
                stacks[key] = encode(e.encoding, chunk, stacked_hint)
            encoded = {s: t[e.expert % EXPERT_CHUNK] for s, t in stacks[key].items()}
        for suffix, t in encoded.items():
            tensors[e.name(suffix)] = t
    return tensors


def _export_config(state, cfg: ModelConfig, plan, tokenizer, source: Optional[PublicReader],
                   drafter: Optional[dict[str, Any]] = None, origin_drafter: bool = True) -> dict[str, Any]:
    """config.json: flashtrain's fields over the origin's (which keeps the fields of the modules
    flashtrain does not train, and its drafter's compress ratios past the backbone's). `drafter`:
    the fields of the drafter exported with the model (its blocks attend over the window only);
    `origin_drafter=False` drops the origin's drafter fields."""
    engram = _tokenizer_fields(source) if source is not None else {}
    if tokenizer is not None:
        engram["engram_pad_id"] = tokenizer.pad_id
    if "lookup_map" in state:
        engram["engram_compressed_vocab_size"] = compressed_vocab(state["lookup_map"])
    elif tokenizer is not None:  # an imported checkpoint keeps no map: the run's tokenizer gives it
        engram["engram_compressed_vocab_size"] = build_compression_map(tokenizer.tokenizer, cfg.vocab_size)[1]
    config = public_config(cfg, plan, cfg.vocab_size, engram)
    merged = dict(config)
    if source is not None:
        merged = {**source.config, **config}
        extra = source.config.get("compress_ratios", [])[cfg.n_layers:]
        merged["compress_ratios"] = config["compress_ratios"] + list(extra)
        merged["n_mtp_layers"] = source.config.get("n_mtp_layers", 1 if extra else 0)
        for key in ("max_seq_len", "dtype", "expert_dtype"):  # the source's runtime and storage choices
            if key in source.config:
                merged[key] = source.config[key]
    if drafter is not None or not origin_drafter:
        for key in DRAFTER_KEYS:
            merged.pop(key, None)
        merged["compress_ratios"] = list(config["compress_ratios"])
        merged["n_mtp_layers"] = 0
    if drafter is not None:
        merged.update(drafter)
        merged["compress_ratios"] += [0] * drafter["n_mtp_layers"]
    return merged


def _check_source(state: Mapping[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], what: str) -> None:
    problems = [f"missing tensor {k}" for k in shapes if k not in state and k != "lookup_map"]
    problems += [f"unexpected tensor {k}" for k in state if k not in shapes]
    problems += [f"{k}: shape {list(state[k].shape)}, expected {list(s)}" for k, s in shapes.items()
                 if k in state and tuple(state[k].shape) != s]
    if problems:
        raise InteropError(f"{what}: {'; '.join(problems)}")


def _check_engram_state(state, shapes, config: dict[str, Any], tokenizer) -> None:
    """The public code rebuilds the compression map from the tokenizer and the hash multipliers
    from its class count: the checkpoint's must be those, or the export would hash differently."""
    keys = [k for k in shapes if k.endswith(".multipliers")]
    if not keys:
        return
    if "engram_compressed_vocab_size" not in config:
        raise InteropError("the checkpoint holds no Engram compression map (an imported one) and no origin "
                           "gives its size: pass tokenizer=<its tokenizer.json> or origin=<its public "
                           "directory>")
    classes = int(config["engram_compressed_vocab_size"])
    bad = [k for k in keys if not torch.equal(
        state[k].cpu(), engram_hash_multipliers(int(k.split(".")[1]), shapes[k][0], classes))]
    if bad:
        raise InteropError(f"{', '.join(bad)}: not the public code's multipliers for {classes} compressed "
                           "ids (a checkpoint trained with an older Engram hash)")
    if tokenizer is not None and "lookup_map" in state:
        lookup, _ = build_compression_map(tokenizer.tokenizer, state["lookup_map"].numel())
        n_tok = tokenizer.vocab_size
        differ = int((lookup[:n_tok] != state["lookup_map"][:n_tok].cpu()).sum())
        if differ:
            raise InteropError("the checkpoint's Engram compression map differs from the public code's for "
                               f"its tokenizer at {differ} of {n_tok} token ids (a checkpoint trained with "
                               "an older map)")


def _write_tokenizer(dst: Path, tokenizer, source: Optional[PublicReader]) -> str:
    """The tokenizer files: the origin's own when the run used that tokenizer, else the run's
    tokenizer.json with a tokenizer_config.json that transformers' AutoTokenizer reads."""
    from tokenizers import Tokenizer

    files = source.tokenizer_files() if source is not None else []
    same = any(f.name == "tokenizer.json" for f in files) and (
        tokenizer is None or Tokenizer.from_file(str(source.root / "tokenizer.json")).to_str()
        == tokenizer.tokenizer.to_str())
    if same:
        for f in files:
            shutil.copyfile(f, dst / f.name)
        return ""
    if tokenizer is None:
        return " (no tokenizer files: none given and none at the origin)"
    tokenizer.tokenizer.save(str(dst / "tokenizer.json"))
    special = {f"{role}_token": tokenizer.id_to_token(getattr(tokenizer, f"{role}_id"))
               for role in ("bos", "eos", "pad")}
    _write_atomic(dst / "tokenizer_config.json", json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", **special, "clean_up_tokenization_spaces": False},
        indent=2) + "\n")
    return ""


def export_model(model, dst: Path, tokenizer=None, origin: Optional[Path] = None,
                 log: Callable[[str], None] = print, drafter=None) -> dict[str, Any]:
    """`export_state` of a live model (and `drafter`, a DSpark of it)."""
    return export_state(model.state_dict(), dst, model.cfg, tokenizer, origin, log,
                        drafter.state_dict() if drafter is not None else None)
