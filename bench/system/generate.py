"""Generation engine vs a plain full-forward loop, side by side in one run; prints one JSON object.

  prefill   tokens/s of CED prefill (encoder over the prompt, decoder over the last 128) vs one
            plain forward through every layer (logits of the last position only, as a plain
            generation loop needs), at each prompt length
  decode    tokens/s of the engine's continuous-batching decode step (every busy slot of a
            SlotCache, FP4-packed, one token each) vs re-running the whole sequences per token,
            at each batch size
  prefix    latency of a prompt that extends a cached sequence (hit: replay + new tokens) vs the
            same prompt without the prefix cache (miss: CED prefill of everything)

    python -m bench.system.generate [--model small] [--prefill 8192,32768] [--batches 1,64]
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import time

import torch

from bench import provenance
from conf.model import SmallModelConfig, TinyModelConfig
from inference.cache import DecodeCache
from inference.generate import generate, prefill_ced
from inference.prefix import PrefixCache
from inference.slots import SlotCache
from model.chunking import apply_chunking
from model.runtime import AttentionRuntime
from trainer.pretrain import assemble_model


def _seconds(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _ids(batch: int, length: int, vocab: int, device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g).to(device)


@torch.no_grad()
def plain_next_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """The plain loop's step: every layer over the whole of ids [B, T], logits of the last position.
    Query chunks shrink with the batch so a chunk's gathered KV stays as large as at batch 1."""
    chunk, cfg = model.cfg.attn_chunk_tokens, model.cfg
    apply_chunking(model, max(chunk // ids.shape[0], cfg.window) if chunk else 0, cfg.loss_chunk_tokens)
    try:
        h = model.hidden(ids, AttentionRuntime(ids.shape[0], ids.shape[1], ids.device))
    finally:
        apply_chunking(model, chunk, cfg.loss_chunk_tokens)
    return model.head(h[:, -1:])


@torch.no_grad()
def bench_prefill(model, lengths, vocab, device) -> dict:
    out = {}
    for n in lengths:
        ids = _ids(1, n, vocab, device)
        # each path once untimed at this length: Triton compiles and autotunes per size, so a
        # shorter warm-up leaves the timed call to pay for it
        prefill_ced(model, DecodeCache(1), ids)
        plain_next_logits(model, ids)
        ced = statistics.median(_seconds(lambda ids=ids: prefill_ced(model, DecodeCache(1), ids), device)
                                for _ in range(3))
        plain = statistics.median(_seconds(lambda ids=ids: plain_next_logits(model, ids), device)
                                  for _ in range(3))
        out[n] = {"ced_tokens_per_s": n / ced, "plain_tokens_per_s": n / plain, "ced_speedup": plain / ced}
    return out


@torch.no_grad()
def bench_decode(model, batches, prompt_len, steps, vocab, device) -> dict:
    """`steps` untimed decode steps first (kernel compilation: Triton specialises on sizes that
    change as the cache grows), then `steps` timed ones."""
    out = {}
    for b in batches:
        ids = _ids(b, prompt_len + 2 * steps, vocab, device)
        slots = SlotCache(model, b)
        for row in range(b):  # the engine prefills each prompt on its own, then hands it a slot
            cache = DecodeCache(1)
            prefill_ced(model, cache, ids[row:row + 1, :prompt_len])
            slots.insert(row, cache)
        busy = list(range(b))

        def decode(start, ids=ids, slots=slots, busy=busy):
            for p in range(start, start + steps):
                slots.begin(busy, ids[:, p:p + 1])
                model(ids[:, p:p + 1], shard=slots)
                slots.end(ids[:, p:p + 1])

        decode(prompt_len)
        cached = _seconds(lambda: decode(prompt_len + steps), device)
        plain_steps = min(steps, 4)  # the plain loop is O(length) per token: a few steps suffice
        at = prompt_len + steps
        [plain_next_logits(model, ids[:, :p + 1]) for p in range(at - 2, at)]  # warm-up
        positions = range(at, at + plain_steps)
        plain = _seconds(lambda ids=ids, positions=positions: [plain_next_logits(model, ids[:, :p + 1])
                                                               for p in positions],
                         device)
        out[b] = {"cached_tokens_per_s": b * steps / cached, "plain_tokens_per_s": b * plain_steps / plain,
                  "speedup": (b * steps / cached) / (b * plain_steps / plain)}
    return out


def bench_prefix(model, prefix_len, new_tokens, vocab, device) -> dict:
    prefix = _ids(1, prefix_len, vocab, device, seed=1)[0].tolist()
    prompt = prefix + _ids(1, new_tokens, vocab, device, seed=2)[0].tolist()
    cache = PrefixCache(max_bytes=1 << 40)
    generate(model, [prefix + prompt[prefix_len:prefix_len + 1]], max_new_tokens=1, temperature=0,
             prefix_cache=cache)
    def hit_call():  # the prompt itself is offered back, so every call hits the same prefix
        return generate(model, [prompt], max_new_tokens=1, temperature=0, prefix_cache=cache)

    def miss_call():
        return generate(model, [prompt], max_new_tokens=1, temperature=0)

    # each path once untimed: a path's first call compiles and autotunes the kernels of its shapes
    # (the hit runs the new tokens over a cached prefix, the miss a CED prefill of everything)
    hit_call(), miss_call()
    hit = statistics.median(_seconds(hit_call, device) for _ in range(3))
    miss = statistics.median(_seconds(miss_call, device) for _ in range(3))
    return {"prefix_tokens": prefix_len, "new_tokens": new_tokens, "hit_s": hit, "miss_s": miss,
            "miss_over_hit": miss / hit, "hits": cache.hits, "timed_calls": 3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small", choices=["small", "tiny"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prefill", default="8192,32768")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prefix-len", type=int, default=16384)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=129_280)
    ap.add_argument("--kernels", action="store_true",
                    help="model.kernels=true (Triton attention, indexer, mHC)")
    args = ap.parse_args()
    device = torch.device(args.device)
    base = SmallModelConfig() if args.model == "small" else TinyModelConfig()
    cfg = dataclasses.replace(base, vocab_size=args.vocab, max_seq_len=max(base.max_seq_len, 32768),
                              kernels=args.kernels)
    torch.manual_seed(0)
    with device:
        model, _ = assemble_model(cfg)
    model.eval()
    if device.type == "cuda":
        model.to(torch.bfloat16)  # inference weights
    commit = provenance.commit()
    result = {"bench": "generate",
              "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "date": datetime.date.today().isoformat(), "commit": commit,
              "model": args.model, "kernels": args.kernels}
    result["prefill"] = bench_prefill(model, [int(x) for x in args.prefill.split(",")], args.vocab, device)
    print(json.dumps(result["prefill"]), file=sys.stderr, flush=True)
    result["decode"] = bench_decode(model, [int(x) for x in args.batches.split(",")], args.prompt_len,
                                    args.steps, args.vocab, device)
    result["prefix"] = bench_prefix(model, args.prefix_len, args.new_tokens, args.vocab, device)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
