"""`flashtrain inspect model=<name>`: parameter, active-parameter and KV accounting of a
model built on the meta device (no memory, no weights)."""
import dataclasses
import json
import time
from pathlib import Path

from conf.inspect import InspectConfig
from launch.stages import register_stage


def _fmt(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:,.3f}{unit}"
    return f"{n:,.0f}"


@register_stage("inspect", InspectConfig, help="account for a model's parameters and KV cache (meta device)")
def inspect(cfg: InspectConfig, run_dir: Path, config_yaml: str):
    import torch

    from model.accounting import model_summary
    from model.transformer import Transformer

    model_cfg = cfg.model
    if model_cfg.vocab_size is None:
        model_cfg = dataclasses.replace(model_cfg, vocab_size=cfg.inspect.vocab_size)
    start = time.perf_counter()
    with torch.device("meta"):
        model = Transformer(model_cfg)
    summary = model_summary(model)
    summary["build_seconds"] = round(time.perf_counter() - start, 3)
    if cfg.inspect.json:
        print(json.dumps({"model": model_cfg.name, **summary}))
        return summary
    rows = [
        ("backbone parameters", _fmt(summary["total_params"])),
        ("  of which routed experts", _fmt(summary["routed_expert_params"])),
        ("  of which embedding", _fmt(summary["embedding_params"])),
        ("Engram parameters", _fmt(summary["engram_params"])),
        ("vision tower parameters (ViT, projector, delimiters)", _fmt(summary["vision_params"])),
        ("all parameters", _fmt(summary["all_params"])),
        ("active per token, prefill (encoder + decoder KV writer)", _fmt(summary["active_prefill_params"])),
        ("active per token, decode (all layers + head)", _fmt(summary["active_decode_params"])),
        ("global KV bytes per token", f"{summary['kv_bytes_per_token']:g}"),
        ("window KV bytes per sequence", _fmt(summary["window_kv_bytes_per_sequence"])),
        ("layer plan", model.plan.describe()),
        ("meta-device build", f"{summary['build_seconds']} s"),
    ]
    width = max(len(k) for k, _ in rows)
    print(f"model {model_cfg.name}")
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    return summary
