"""The vision tower's share of a `small` training step (docs/ARCHITECTURE.md §9) on one GPU.

`small` with its vision tower (model.vision_n_layers=12 by default here: width 512, 8 heads, SwiGLU
1,408, 14-pixel patches, 3 x 3 unshuffle) and every fast path on (model.kernels, grouped experts),
bf16 autocast, the Muon + Sinkhorn + AdamW composite, no activation checkpointing. Two batches of the
same shape, [micro_batch, seq_len]:
  image_text  each sequence holds `--images` images of `--image-px` square pixels (their spans, the
              rest random text tokens)
  text        the same token positions, all text (no tower call)
and the tower alone: ViT + aligner forward and backward over the same images. Each is timed as whole
optimizer steps (forward, backward, step), medians of `--steps` after `--warmup`. Reported:
  share_of_step        (image_text - text) / image_text: what the images add to a step
  tower_ms_of_step     tower alone / image_text step: the tower's own forward and backward

    python -m bench.system.vision_step --out bench/results/system/vision_step.json
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import torch

from bench.provenance import emit, header
from conf.model import IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START, TEXT, SmallModelConfig, TinyModelConfig
from conf.optim import MuonConfig
from model.moe import RoutedExperts
from model.vision import ImageBatch, image_token_grid
from optim import build_optimizer
from trainer.pretrain import assemble_model


def build(args, device: torch.device):
    base = SmallModelConfig() if args.model == "small" else TinyModelConfig()
    kernels = device.type == "cuda"
    cfg = dataclasses.replace(base, vocab_size=args.vocab, vision_n_layers=args.vision_layers,
                              kernels=kernels, attn_chunk_tokens=0 if kernels else base.attn_chunk_tokens)
    torch.manual_seed(0)
    with device:
        model, _ = assemble_model(cfg)
    for module in model.modules():
        if isinstance(module, RoutedExperts):
            module.grouped = None if kernels else False
    opt = build_optimizer(model, MuonConfig(), zero_stage=0)
    opt.enable_sparse_table_grads(model)
    return model, opt


def batches(cfg, args, device: torch.device):
    """(image_text kwargs, text kwargs) of one micro-batch."""
    p, r = cfg.vision_patch_size, cfg.vision_downsample_ratio
    n = args.image_px // p  # patches a side
    n_llm_h, n_llm_w = image_token_grid(n, n, r)
    span = [IMAGE_START] + ([IMAGE] * n_llm_w + [IMAGE_NEW_LINE]) * n_llm_h + [IMAGE_END]
    B, T = args.micro_batch, args.seq_len
    gap = T // args.images
    if gap <= len(span):
        raise SystemExit(f"--images {args.images} of {len(span)} span tokens do not fit --seq-len {T}")
    g = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (B, T), device=device, generator=g)
    types = torch.full((B, T), TEXT, device=device)
    patches, grids, rows, starts = [], [], [], []
    for b in range(B):
        for k in range(args.images):
            start = k * gap + 1
            types[b, start:start + len(span)] = torch.tensor(span, device=device)
            patches.append(torch.rand(n * n, 3, p, p, device=device, generator=g) * 2 - 1)
            grids.append((n, n))
            rows.append(b)
            starts.append(start)
    labels = torch.where(types >= 0, -100, ids.roll(-1, 1))
    image_text = dict(input_ids=ids, labels=labels, token_types=types,
                      images=ImageBatch(patches, grids, rows, starts))
    text = dict(input_ids=ids, labels=ids.roll(-1, 1))
    return image_text, text, int((types >= 0).sum())


def timed_steps(step, steps: int, warmup: int, device: torch.device) -> float:
    """Median milliseconds of step()."""
    times = []
    for i in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("small", "tiny"), default="small")
    parser.add_argument("--vision-layers", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--images", type=int, default=8, help="images per sequence")
    parser.add_argument("--image-px", type=int, default=448, help="side of each (square) image in pixels")
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, opt = build(args, device)
    image_text, text, span_tokens = batches(model.cfg, args, device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def step(batch):
        with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
            out = model(**batch)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def tower():
        with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
            tokens = model.visual.encode(image_text["images"])
        tokens.float().square().mean().backward()
        model.zero_grad(set_to_none=True)

    image_ms = timed_steps(lambda: step(image_text), args.steps, args.warmup, device)
    text_ms = timed_steps(lambda: step(text), args.steps, args.warmup, device)
    tower_ms = timed_steps(tower, args.steps, args.warmup, device)
    n_patches = sum(p.shape[0] for p in image_text["images"].patches)
    result = {**header("bench/system/vision_step.py"),
              "config": {k: v for k, v in vars(args).items() if k != "out"},
              "kernels": model.cfg.kernels, "span_tokens_per_batch": span_tokens,
              "patches_per_batch": n_patches,
              "vision_parameters": sum(p.numel() for p in model.visual.parameters()),
              "parameters": sum(p.numel() for p in model.parameters()),
              "image_text_step_ms": round(image_ms, 2), "text_step_ms": round(text_ms, 2),
              "tower_fwd_bwd_ms": round(tower_ms, 2),
              "share_of_step": round((image_ms - text_ms) / image_ms, 4),
              "tower_ms_of_step": round(tower_ms / image_ms, 4)}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    emit(result, args.out)


if __name__ == "__main__":
    main()
