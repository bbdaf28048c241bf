"""Where a training micro-step's activations go: the bytes autograd saves for the backward, by the
module that saved them, in bytes a token and unit of width (the planner's `ActivationRates` unit,
conf/plan.py). It is the split of the whole-block rate (122.3) that checkpointing inside a block
would start from: which of a block's parts keep the most for their share of the FLOPs.

One forward of `model` (step_memory's configs: `small`, `flash-L<layers>`; kernels on a GPU, the
plain path on a CPU) on random tokens under bf16 autocast on a GPU. Every tensor autograd packs for
the backward (`torch.autograd.graph.saved_tensors_hooks`) is counted once by its storage, against the
innermost module running when it was first saved; parameters and their views are not activations
and are left out. Per-block modules are summed over the blocks (`layers.3.attn.indexer` counts as
`attn.indexer`). Not seen: tensors a custom autograd.Function keeps as attributes of its context
rather than through save_for_backward, and the allocator's transient peaks.

    python -m bench.system.activation_breakdown [--model flash-L2] [--seq-len 4096] [--micro-batch 1]
        [--out FILE]
"""
from __future__ import annotations

import argparse
import contextlib
import re
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from bench import provenance
from bench.system.step_memory import model_config
from trainer.pretrain import assemble_model

BLOCK = re.compile(r"^layers\.\d+(\.|$)")


def saved_bytes_by_module(model: nn.Module, forward: Callable[[], object]) -> dict[str, int]:
    """Run `forward()` and return the bytes autograd saved for the backward, by the qualified name of
    the innermost module that first saved each storage ("" for the model itself)."""
    names = {m: n for n, m in model.named_modules()}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    stack: list[str] = []
    seen: set[int] = set()
    by: dict[str, int] = defaultdict(int)

    def enter(module, _args):
        stack.append(names[module])

    def leave(module, _args, _out):
        stack.pop()

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params and ptr not in seen and storage.nbytes():
            seen.add(ptr)
            by[stack[-1] if stack else ""] += storage.nbytes()
        return t

    handles = [h for m in names for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = forward()
    finally:
        for h in handles:
            h.remove()
    del out
    return dict(by)


def per_block(by: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    """(bytes by module path inside a block, summed over the blocks; bytes saved outside blocks)."""
    inside, outside = defaultdict(int), defaultdict(int)
    for name, n in by.items():
        if BLOCK.match(name):
            inside[BLOCK.sub("", name) or "(block)"] += n
        else:
            outside[name or "(model)"] += n
    return dict(inside), dict(outside)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="flash-L2")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=129_280)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    cfg = model_config(args.model, args.vocab)
    if not cuda:  # the plain path: the kernels are Triton on a GPU
        import dataclasses
        cfg = dataclasses.replace(cfg, kernels=False)
    torch.manual_seed(0)
    with device:
        model, _ = assemble_model(cfg)
    ids = torch.randint(0, args.vocab, (args.micro_batch, args.seq_len + 1), device=device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()

    def forward():
        with autocast:
            return model(ids[:, :-1], labels=ids[:, 1:]).loss

    inside, outside = per_block(saved_bytes_by_module(model, forward))
    tokens, dim, layers = args.micro_batch * args.seq_len, cfg.dim, cfg.n_layers
    rate = 1.0 / (tokens * dim * layers)  # bytes a token, unit of width and layer
    result = {**provenance.header("activation_breakdown"), "model": args.model, "seq_len": args.seq_len,
              "micro_batch": args.micro_batch, "kernels": cfg.kernels, "layers": layers, "dim": dim,
              "block_rate": sum(inside.values()) * rate,
              "outside_blocks_gib": sum(outside.values()) / 2**30,
              "block_parts": {k: v * rate for k, v in sorted(inside.items(), key=lambda kv: -kv[1])},
              "outside_parts_gib": {k: v / 2**30 for k, v in sorted(outside.items(), key=lambda kv: -kv[1])}}
    provenance.emit(result, args.out)


if __name__ == "__main__":
    main()
