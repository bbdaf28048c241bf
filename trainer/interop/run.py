"""The `convert` stage (conf/convert.py): import or export, on every rank of the launch."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from conf.convert import ConvertConfig
from conf.errors import ConfigError
from trainer.checkpoint import model_state, resolve_checkpoint
from trainer.interop.convert import (
    KEPT_CONFIG,
    TOKENIZER_KEYS,
    export_state,
    import_checkpoint,
    is_public_dir,
)


def run_convert(cfg: ConvertConfig, run_dir: Path) -> dict[str, Any]:
    if (cfg.import_ is None) == (cfg.export is None):
        raise ConfigError("convert: give exactly one of import=DIR or export=DIR")
    if cfg.import_ is not None:
        if cfg.checkpoint is not None:
            raise ConfigError("convert: checkpoint= names the checkpoint to export; import writes to out=")
        source = Path(cfg.import_).expanduser()
        if not is_public_dir(source):
            raise ConfigError(f"import={cfg.import_}: no config.json and *.safetensors shards there")
        out = Path(cfg.out).expanduser() if cfg.out else Path(run_dir) / "checkpoints"
        return {"checkpoint": str(import_checkpoint(source, out, cfg.model, cfg.dspark))}
    if cfg.checkpoint is None:
        raise ConfigError("convert: export=DIR needs checkpoint=<a flashtrain checkpoint, checkpoints/ dir or run dir>")
    if not Path(cfg.checkpoint).expanduser().exists():
        raise ConfigError(f"checkpoint={cfg.checkpoint}: no such checkpoint or directory")
    ckpt = resolve_checkpoint(Path(cfg.checkpoint))
    state = model_state(ckpt)
    return export_state(state, Path(cfg.export).expanduser(), cfg.model, _engram_fields(ckpt, state))


def _engram_fields(ckpt: Path, state) -> dict[str, int]:
    """The tokenizer-derived config.json fields: from the public config an imported checkpoint
    keeps, else what the checkpoint's compression map says (the pad id needs the tokenizer)."""
    kept = ckpt / KEPT_CONFIG
    if kept.is_file():
        config = json.loads(kept.read_text())
        return {k: config[k] for k in TOKENIZER_KEYS if k in config}
    if "lookup_map" in state:
        return {"engram_compressed_vocab_size": int(state["lookup_map"].max()) + 1}
    return {}
