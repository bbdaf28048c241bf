"""The `generate` stage: tokenizer and model as the training run built them, weights from a
checkpoint, one prompt through the decode cache."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from conf.errors import ConfigError
from conf.generate import GenerateConfig
from data import build_datasets
from data.errors import DataError
from data.images import encode_document, interleave
from inference.generate import generate
from model.vision import ImageBatch
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
    prompt, vision = [tok.bos_id, *tok.encode(g.prompt)], None
    if g.images:
        prompt, vision = _image_prompt(g, model.cfg, tok)
    (out,) = generate(model, [prompt], g.max_new_tokens, g.temperature, g.top_p, stop={tok.eos_id},
                      seed=g.seed, packed=g.packed_cache, max_batch=g.max_batch, vision=vision)
    text = tok.decode(out.tokens, skip_special_tokens=True)
    result = {"prompt": g.prompt, "completion": text, "tokens": out.tokens, "logprobs": out.logprobs,
              "finish": out.finish, "checkpoint": g.checkpoint}
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / "generation.json").write_text(json.dumps(result, indent=1))
    print(g.prompt + text)
    return result


def _image_prompt(g, model_cfg, tok):
    """The prompt's ids with each generate.images file's span at its `<image>`, and [(types, images)]."""
    if model_cfg.vision_n_layers == 0:
        raise ConfigError(f"generate.images has {len(g.images)} images but the model has no vision tower "
                          "(model.vision_n_layers=0)")
    try:
        segments = interleave(g.prompt, [{"path": p} for p in g.images], "generate.prompt")
        image_id = tok.pad_id if model_cfg.image_token_id is None else model_cfg.image_token_id
        doc = encode_document(segments, tok, model_cfg, tok.bos_id, tok.eos_id, image_id)
    except DataError as e:
        raise ConfigError(f"generate.images: {e}") from e
    images = ImageBatch([im.patches for im in doc.images], [im.grid for im in doc.images],
                        [0] * len(doc.images), doc.image_starts)
    return doc.ids[:-1], [(doc.types[:-1], images)]  # no EOS: the continuation comes next
