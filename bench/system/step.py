"""End-to-end training step of `small` on one GPU, Triton kernels off vs on, in one process:
tokens/s, their ratio, and MFU (model FLOPs per token x tokens/s over the datasheet bf16 peak).

Off is every reference path (the per-expert MoE loop included); on is every fast path (Triton
kernels and grouped-GEMM experts). Each path runs at the settings it needs: the reference attention keeps an
O(T x k x C) gather per query chunk, so it runs in query chunks of 2048 (model.attn_chunk_tokens, as `small`
defaults); the kernel needs no chunking. Both: bf16 autocast, fp32 master weights, the Muon +
Sinkhorn + AdamW composite with sparse Engram table gradients (as the trainer sets it up), no
activation checkpointing, random tokens.

Two more rows, kernels on: `compiled` adds trainer.compile (torch.compile per block,
trainer/parallelize.py compile_blocks) and `compiled_accum` also takes one optimizer step per
`accum` micro-batches, as a run whose global batch exceeds one micro-batch does: the optimizer's
fixed cost (Muon's Newton-Schulz on every matrix) is then shared by more tokens.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from conf.model import SmallModelConfig
from conf.optim import MuonConfig
from model.accounting import train_flops_per_token
from model.moe import RoutedExperts
from optim import build_optimizer
from trainer.metrics import device_peak_flops
from trainer.pretrain import assemble_model


def small_model(kernels: bool, vocab: int, compiled: bool = False):
    """(model on the GPU, its Muon + Sinkhorn + AdamW optimizer): `small` with every fast path
    (kernels) or every reference path, as the module docstring describes."""
    cfg = dataclasses.replace(SmallModelConfig(), vocab_size=vocab, kernels=kernels,
                              attn_chunk_tokens=0 if kernels else 2048)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model, _ = assemble_model(cfg)
    for module in model.modules():
        if isinstance(module, RoutedExperts):
            module.grouped = None if kernels else False  # None: grouped GEMMs under bf16 autocast
    if compiled:
        from trainer.parallelize import compile_blocks

        compile_blocks(model)
    opt = build_optimizer(model, MuonConfig(), zero_stage=0)
    # as the trainer does (trainer/pretrain.py): Engram rows a batch touched
    opt.enable_sparse_table_grads(model)
    return model, opt


def _tokens_per_s(kernels: bool, seq_len: int, micro_batch: int, steps: int, vocab: int,
                  compiled: bool = False, accum: int = 1) -> dict:
    model, opt = small_model(kernels, vocab, compiled)
    cfg = model.cfg
    g = torch.Generator(device="cuda").manual_seed(0)
    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    warmup_s = 0.0
    for step in range(steps + 2):  # two warm-up steps: Triton autotuning, compilation, allocator growth
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(accum):
            ids = torch.randint(0, vocab, (micro_batch, seq_len + 1), device="cuda", generator=g)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(ids[:, :-1], labels=ids[:, 1:])
            (out.loss / accum).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if step >= 2:
            times.append(time.perf_counter() - start)
        else:
            warmup_s += time.perf_counter() - start
        losses.append(out.lm_loss.item())
    step_s = sorted(times)[len(times) // 2]
    flops = train_flops_per_token(model, seq_len)
    peak, source = device_peak_flops(torch.device("cuda"), None)
    tps = micro_batch * seq_len * accum / step_s
    result = {"tokens_per_s": tps, "step_s": step_s, "accum": accum, "warmup_s": warmup_s,
              "compiled": compiled, "mfu": tps * flops / peak, "peak_source": source,
              "flops_per_token": flops, "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
              "attn_chunk_tokens": cfg.attn_chunk_tokens, "lm_loss_first": losses[0],
              "lm_loss_last": losses[-1]}
    if compiled:
        from torch._dynamo.utils import counters

        result["graphs"] = counters["stats"]["unique_graphs"]
        result["graph_breaks"] = sum(counters["graph_break"].values())
        counters.clear()
    del model, opt, out
    torch.cuda.empty_cache()
    return result


def bench(device, seq_len: int = 4096, micro_batch: int = 2, steps: int = 3, vocab: int = 129_280,
          accum: int = 4) -> dict:
    torch.cuda.set_device(device)
    off = _tokens_per_s(False, seq_len, micro_batch, steps, vocab)
    on = _tokens_per_s(True, seq_len, micro_batch, steps, vocab)
    compiled = _tokens_per_s(True, seq_len, micro_batch, steps, vocab, compiled=True)
    torch._dynamo.reset()  # a fresh model: compile again rather than run into the recompile limit
    compiled_accum = _tokens_per_s(True, seq_len, micro_batch, steps, vocab, compiled=True, accum=accum)
    torch._dynamo.reset()
    return {"model": "small", "seq_len": seq_len, "micro_batch": micro_batch, "timed_steps": steps,
            "kernels_off": off, "kernels_on": on,
            "tokens_per_s_ratio": on["tokens_per_s"] / off["tokens_per_s"],
            "compiled": compiled, "compiled_accum": compiled_accum,
            "compiled_vs_on": compiled["tokens_per_s"] / on["tokens_per_s"],
            "compiled_accum_vs_off": compiled_accum["tokens_per_s"] / off["tokens_per_s"],
            "kernels_used": "sparse attention fwd+bwd, indexer scoring (dense with fused mask, Reindex, KL), "
                            "fused mHC at every sub-layer boundary (attention->MoE in a block, and MoE->next "
                            "attention across blocks), rotary, LM head + cross-entropy, grouped-GEMM "
                            "experts; not wired: Engram, KV quant"}
