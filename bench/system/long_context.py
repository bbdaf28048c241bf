"""Long-sequence training throughput of the `small` model on one GPU; prints one JSON object.

For each sequence length (one document, so every compressed entry is visible and the indexer
has the whole context to search): full training steps (forward, backward, optimiser) with what
a long-context run turns on: per-block activation checkpointing, query-chunked attention and
indexer (model.attn_chunk_tokens), the chunked LM loss, bf16 autocast and the Muon + Sinkhorn +
AdamW composite. Lengths run in increasing order until one runs out of memory.

    python -m bench.system.long_context [--lengths 4096,16384,65536,131072] [--steps 2] [--kernels]
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import time

import torch

from bench import provenance
from conf.model import SmallModelConfig
from conf.optim import MuonConfig
from model.transformer import Transformer
from optim import build_optimizer
from trainer.parallelize import checkpoint_blocks
from trainer.pretrain import assemble_model


def _sync() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


def measure(model: Transformer, opt, seq_len: int, steps: int, vocab: int) -> dict:
    """One warm-up step, then `steps` timed steps at micro-batch 1."""
    g = torch.Generator(device="cuda").manual_seed(seq_len)
    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for step in range(steps + 1):
        ids = torch.randint(0, vocab, (1, seq_len + 1), device="cuda", generator=g)
        t0 = _sync()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(ids[:, :-1], labels=ids[:, 1:])
        t1 = _sync()
        out.loss.backward()
        t2 = _sync()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = _sync()
        losses.append(out.lm_loss.item())
        if step:  # the first step includes allocator and kernel warm-up
            times.append((t1 - t0, t2 - t1, t3 - t2))
    fwd, bwd, opt_s = (sum(t[i] for t in times) / len(times) for i in range(3))
    step_s = fwd + bwd + opt_s
    return {"seq_len": seq_len, "tokens_per_s": seq_len / step_s, "step_s": step_s, "forward_s": fwd,
            "backward_s": bwd, "optimizer_s": opt_s,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
            "lm_loss_first": losses[0], "lm_loss_last": losses[-1], "steps_timed": steps}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="4096,16384,65536,131072")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--attn-chunk", type=int, default=2048)
    ap.add_argument("--loss-chunk", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=129_280)
    ap.add_argument("--kernels", action="store_true", help="model.kernels=true (the Triton kernels)")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    cfg = dataclasses.replace(SmallModelConfig(), vocab_size=args.vocab, attn_chunk_tokens=args.attn_chunk,
                              loss_chunk_tokens=args.loss_chunk, max_seq_len=max(lengths + [131_072]),
                              kernels=args.kernels)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model, _ = assemble_model(cfg)
    checkpoint_blocks(model)
    model.train()
    opt = build_optimizer(model, MuonConfig(), zero_stage=0)
    results = []
    for seq_len in lengths:
        try:
            results.append(measure(model, opt, seq_len, args.steps, args.vocab))
        except torch.OutOfMemoryError as e:
            results.append({"seq_len": seq_len, "oom": str(e).split(".")[0]})
            break
        finally:
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
        print(json.dumps(results[-1]), flush=True)
    base = results[0].get("tokens_per_s")
    for r in results:
        if "tokens_per_s" in r and base:
            r["tokens_per_s_vs_first"] = r["tokens_per_s"] / base
    commit = provenance.commit()
    print(json.dumps({
        "bench": "long_context", "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "date": datetime.date.today().isoformat(), "commit": commit, "model": "small",
        "params": sum(p.numel() for p in model.parameters()), "micro_batch": 1, "attn_impl": cfg.attn_impl,
        "kernels": args.kernels,
        "attn_chunk_tokens": args.attn_chunk, "loss_chunk_tokens": args.loss_chunk,
        "activation_checkpointing": True, "precision": "bf16 autocast, fp32 master",
        "optimizer": "muon composite",
        "longest_trained": max((r["seq_len"] for r in results if "tokens_per_s" in r), default=None),
        "results": results,
    }, indent=1))


if __name__ == "__main__":
    main()
