"""The `convert` stage (conf/convert.py): import or export, on every rank of the launch."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from conf.convert import ConvertConfig
from conf.errors import ConfigError
from trainer.checkpoint import LATEST, TOKENIZER, model_state, resolve_checkpoint
from trainer.interop.convert import (
    DRAFTER_DIR,
    InteropError,
    export_state,
    import_checkpoint,
    is_public_dir,
    origin_of,
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
        if cfg.drafter not in (None, "auto", "none"):
            raise ConfigError(f"drafter={cfg.drafter}: import takes drafter=auto (import the source's "
                              "drafter) or drafter=none (carry it through unchanged)")
        out = Path(cfg.out).expanduser() if cfg.out else Path(run_dir) / "checkpoints"
        result = {"checkpoint": str(import_checkpoint(source, out, cfg.model, drafter=cfg.drafter != "none"))}
        if (out / DRAFTER_DIR / LATEST).is_file():
            result["drafter"] = str(out / DRAFTER_DIR)
        return result
    if cfg.checkpoint is None:
        raise ConfigError("convert: export=DIR needs checkpoint=<a flashtrain checkpoint, checkpoints/ dir "
                          "or run dir>")
    if not Path(cfg.checkpoint).expanduser().exists():
        raise ConfigError(f"checkpoint={cfg.checkpoint}: no such checkpoint or directory")
    ckpt = resolve_checkpoint(Path(cfg.checkpoint))
    origin = _origin(cfg.origin, ckpt)
    return export_state(model_state(ckpt), Path(cfg.export).expanduser(), cfg.model,
                        _tokenizer(cfg.tokenizer, ckpt), origin, drafter=_drafter(cfg.drafter),
                        origin_drafter=cfg.drafter != "none")


def _drafter(setting: Optional[str]):
    """export's drafter=: the weights of a drafter checkpoint, or None (auto, none)."""
    if setting in (None, "auto", "none"):
        return None
    path = Path(setting).expanduser()
    if not path.exists():
        raise ConfigError(f"drafter={setting}: no such checkpoint or directory")
    return model_state(resolve_checkpoint(path, "drafter"))


def _origin(setting: Optional[str], ckpt: Path) -> Optional[Path]:
    """origin=auto: what the checkpoint recorded; none: no origin; else a public-layout directory."""
    if setting == "none":
        return None
    origin = origin_of(ckpt) if setting in (None, "auto") else Path(setting).expanduser()
    if origin is not None and not is_public_dir(origin):
        where = f"origin={origin}" if setting not in (None, "auto") else f"{ckpt} came from {origin}, which"
        raise InteropError(f"{where} is not a public-layout directory (gone or moved?): it holds the tensors "
                           "flashtrain does not train and the scales of untrained weights; pass "
                           "origin=<its new place>, or origin=none to export without them")
    return origin


def _tokenizer(setting: Optional[str], ckpt: Path):
    """The run's tokenizer: tokenizer=PATH, else the tokenizer.json the checkpoint carries (None: the
    origin's files, if any, are exported)."""
    from data.tokenizer import TextTokenizer

    path = Path(setting).expanduser() if setting else ckpt / TOKENIZER
    if not path.is_file():
        if setting:
            raise ConfigError(f"tokenizer={setting}: no such file")
        return None
    return TextTokenizer.from_file(path)
