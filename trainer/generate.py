"""The `generate` stage: tokenizer and model as the training run built them, weights from a
checkpoint, one prompt through the decode cache."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from conf.errors import ConfigError
from conf.generate import GenerateConfig
from data import build_datasets
from inference.generate import generate
from trainer.checkpoint import load_model_weights, resolve_checkpoint
from trainer.pretrain import build_model


def run_generate(cfg: GenerateConfig, run_dir: Path) -> dict:
    g = cfg.generate
    if g.max_new_tokens < 0 or not 0 < g.top_p <= 1 or g.temperature < 0 or g.max_batch < 1:
        raise ConfigError("generate: need max_new_tokens >= 0, 0 < top_p <= 1, temperature >= 0, "
                          f"max_batch >= 1; got {g.max_new_tokens}, {g.top_p}, {g.temperature}, "
                          f"{g.max_batch}")
    device = torch.device("cuda" if g.device == "auto" and torch.cuda.is_available() else
                          (g.device if g.device != "auto" else "cpu"))
    _, _, tok = build_datasets(cfg.data)  # the tokenizer the run trained (cached next to the data)
    model = build_model(cfg, tok)
    if g.checkpoint:
        load_model_weights(model, resolve_checkpoint(Path(g.checkpoint), "generate.checkpoint"))
    model.to(device)
    prompt = [tok.bos_id, *tok.encode(g.prompt)]
    (out,) = generate(model, [prompt], g.max_new_tokens, g.temperature, g.top_p, stop={tok.eos_id},
                      seed=g.seed, packed=g.packed_cache, max_batch=g.max_batch)
    text = tok.decode(out.tokens, skip_special_tokens=True)
    result = {"prompt": g.prompt, "completion": text, "tokens": out.tokens, "logprobs": out.logprobs,
              "finish": out.finish, "checkpoint": g.checkpoint}
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / "generation.json").write_text(json.dumps(result, indent=1))
    print(g.prompt + text)
    return result
