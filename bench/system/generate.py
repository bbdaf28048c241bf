"""Generation engine vs a plain full-forward loop, side by side in one run; prints one JSON object.

  prefill   tokens/s of CED prefill (encoder over the prompt, decoder over the last 128) vs one
            plain forward through every layer (logits of the last position only, as a plain
            generation loop needs), at each prompt length
  decode    tokens/s of the engine's continuous-batching decode step (every busy slot of a
            SlotCache, FP4-packed, one token each) vs re-running the whole sequences per token,
            at each batch size; --compile both adds the step with its forward through torch.compile
            (inductor) before capture, beside it
  prefix    latency of a prompt that extends a cached sequence (hit: replay + new tokens) vs the
            same prompt without the prefix cache (miss: CED prefill of everything)
  rollout   RL-like generate calls (groups of samples of short prompts, stop tokens ending
            samples after ~9 tokens, decode state kept across calls): tokens/s, decode steps per
            call and the prefill's share, with the step's stop flags against polling every 16 steps

    python -m bench.system.generate [--model small] [--prefill 8192,32768] [--batches 1,64]
        [--sections prefill,decode,prefix,rollout] [--compile off|on|both]
        [--rollout CALLS,ROWS,GROUP,SLOTS,PROMPT,MAX_NEW,MEAN_LEN]

With --drafter RUN (a finished `flashtrain dspark` run), it measures speculative decoding instead:
  speculative  at each batch size, the same prompts (the first --prompt-len tokens of validation
               rows of the run's corpus) decoded --spec-tokens tokens by the engine (`generate`)
               and by speculative decoding (`generate_speculative`: slots, each row keeping its own
               accepted drafts) with the run's target and drafter: tokens/s of each, the speed-up,
               the acceptance length (drafts a row keeps per target forward), tokens per target
               forward (that plus one), the acceptance rate, and whether greedy output is
               identical; also the speculative path with no drafts (draft_length=0: the same slots
               and prefill, one token a step, no drafter), whose ratio isolates what the drafts gain

    python -m bench.system.generate --drafter RUN [--batches 1,64] [--out FILE]
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Optional

import torch

from bench import provenance
from conf.model import SmallModelConfig, TinyModelConfig
from inference.cache import DecodeCache
from inference.generate import _Rows, generate, prefill_ced
from inference.graphs import DecodeStep
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
def bench_prefill(model, lengths, vocab, device, profile: Optional[Path] = None) -> dict:
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
        if profile is not None:
            _profile(lambda ids=ids: prefill_ced(model, DecodeCache(1), ids), profile / f"ced-{n}.txt",
                     device)
            _profile(lambda ids=ids: plain_next_logits(model, ids), profile / f"plain-{n}.txt", device)
    return out


def _routed_choices(model):
    """Forward hooks that collect every router's chosen experts: (hooks, {layer: [chosen tensors]})."""
    seen, hooks = {}, []
    for i, layer in enumerate(model.layers):
        def hook(module, args, output, i=i):
            seen.setdefault(i, []).append(output[1].detach())
        hooks.append(layer.moe.router.register_forward_hook(hook))
    return hooks, seen


def step_bytes(model, slots: SlotCache, busy: list[int], experts_touched: dict[int, int]) -> dict:
    """Bytes a decode step over `busy` must read at least: every weight it uses once (the routed
    experts that some row chose, embedding and Engram rows of the step's tokens only), and each
    row's cache as stored (its packed global entries and window rows)."""
    from model.engram import Engram
    from model.moe import RoutedExperts

    weights = experts = 0
    skip = set()
    for module in model.modules():
        if isinstance(module, RoutedExperts):
            skip.update(id(p) for p in module.parameters())
        elif isinstance(module, Engram):
            skip.add(id(module.table.weight))
    skip.add(id(model.embed.weight))
    for p in model.parameters():
        if id(p) not in skip:
            weights += p.numel() * p.element_size()
    B = len(busy)
    weights += B * model.embed.weight.shape[1] * model.embed.weight.element_size()
    for engram in (m for m in model.modules() if isinstance(m, Engram)):
        w = engram.table.weight
        weights += B * len(engram.primes) * w.shape[1] * w.element_size()
    for i, layer in enumerate(model.layers):
        e = layer.moe.experts
        per_expert = sum(p[0].numel() * p.element_size() for p in (e.w1, e.w2, e.w3))
        experts += experts_touched.get(i, e.n_experts) * per_expert
    entries = sum(store.row_bytes() * (slots.lengths[s] // slots.ratio[layer])
                  for (layer, _), store in slots.entries.items() for s in busy)
    window = sum(p[0].numel() * p.element_size() * (p.shape[1] - 1) // p.shape[1] * B
                 for parts in slots.window.values() for p in parts)
    return {"weights": weights, "routed_experts": experts, "global_entries": entries, "window_rows": window,
            "total": weights + experts + entries + window}


@torch.no_grad()
def bench_decode(model, batches, prompt_len, steps, vocab, device, graphs, plain_steps: int,
                 copy_gbs: Optional[float], profile: Optional[Path], compile_modes=(None,)) -> dict:
    """Per batch size: prompts prefilled (CED) into a SlotCache, then the engine's decode step
    (inference/graphs.py: greedy sampling in the step, no host sync between steps) run `steps`
    times untimed (each new shape runs eagerly once, then is captured) and `steps` times timed.
    Against the step's memory floor: `step_bytes` at the copy bandwidth. compile_modes: the
    step's forward eager (None) and/or through torch.compile ("inductor"): the second mode's row
    sits under the first's as "compiled", measured at the same prompts."""
    out = {}
    for b in batches:
        for i, mode in enumerate(compile_modes):
            row = _decode_row(model, b, prompt_len, steps, vocab, device, graphs,
                              plain_steps if i == 0 else 0, copy_gbs, profile, mode)
            if i == 0:
                out[b] = row
            else:
                out[b]["compiled"] = row
                out[b]["compiled_speedup"] = row["tokens_per_s"] / out[b]["tokens_per_s"]
            # each row as it is done: a compile that outruns a time limit still leaves the rows before it
            print(json.dumps({"decode": {b: row}, "compile": mode}), file=sys.stderr, flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


class _TimedInductor:
    """A torch.compile backend: inductor, with each graph's compile time kept and said on stderr as
    it finishes (which graph a slow compile is stuck in, even when the run is cut off)."""

    def __init__(self):
        self.seconds: list[float] = []

    def __call__(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        start = time.perf_counter()
        compiled = compile_fx(gm, example_inputs)
        self.seconds.append(time.perf_counter() - start)
        ops = sorted({getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes
                      if n.op == "call_function"})
        print(json.dumps({"inductor_graph": len(self.seconds), "s": round(self.seconds[-1], 2),
                          "nodes": len(gm.graph.nodes), "ops": ops[:30]}), file=sys.stderr, flush=True)
        return compiled


def _decode_row(model, b, prompt_len, steps, vocab, device, graphs, plain_steps, copy_gbs, profile,
                compile: Optional[str] = None) -> dict:
    ids = _ids(b, prompt_len, vocab, device)
    slots = SlotCache(model, b)
    state = _Rows(b, 2 * steps + 2, 0.0, 1.0, device)  # greedy
    for row in range(b):  # the engine prefills each prompt on its own, then hands it a slot
        cache = DecodeCache(1)
        logits = prefill_ced(model, cache, ids[row:row + 1])[:, -1]
        state.start(row, row, logits.float())
        slots.insert(row, cache)
    backend = _TimedInductor() if compile == "inductor" else compile
    step = DecodeStep(model, slots, state.feed, state.post, graphs=graphs, compile=backend)
    busy = list(range(b))

    def run(n: int) -> None:
        for _ in range(n):
            step(busy)

    hooks, chosen = _routed_choices(model)
    first = _seconds(lambda: run(1), device)  # eager: the first time at these shapes (compiles)
    for h in hooks:
        h.remove()
    touched = {i: int(torch.cat(c).unique().numel()) for i, c in chosen.items()}
    run(steps - 1)
    before = dict(step.counts)
    seconds = _seconds(lambda: run(steps), device)
    nbytes = step_bytes(model, slots, busy, touched)
    row = {"tokens_per_s": b * steps / seconds, "step_ms": 1e3 * seconds / steps,
           "timed_steps": {k: step.counts[k] - before[k] for k in step.counts}, "bytes_per_step": nbytes,
           "experts_touched_per_layer": sum(touched.values()) / max(len(touched), 1),
           "context_tokens": slots.lengths[0], "first_step_s": first}
    if compile is not None:
        row["compile"] = compile
    if isinstance(backend, _TimedInductor):
        row["inductor_graphs"], row["inductor_s"] = len(backend.seconds), sum(backend.seconds)
        row["inductor_s_max"] = max(backend.seconds, default=0.0)
    if step.failed:
        row["graph_capture_failed"] = sorted(set(step.failed.values()))
    if copy_gbs:
        row["floor_ms"] = nbytes["total"] / copy_gbs / 1e6
        row["fraction_of_floor"] = row["floor_ms"] / row["step_ms"]
    if profile is not None:
        _profile(lambda: run(4), profile / f"decode-b{b}{'-compiled' if compile else ''}.txt", device)
    if plain_steps:
        at = slots.lengths[0]
        plain_ids = _ids(b, at + plain_steps, vocab, device, seed=1)
        plain_next_logits(model, plain_ids[:, :at])  # warm-up
        plain = _seconds(lambda: [plain_next_logits(model, plain_ids[:, :p + 1])
                                  for p in range(at, at + plain_steps)], device)
        row["plain_tokens_per_s"] = b * plain_steps / plain
        row["speedup"] = row["tokens_per_s"] / row["plain_tokens_per_s"]
    return row


def _profile(fn, path: Path, device) -> None:
    """fn under torch.profiler: a table of the ops by device time (CPU time without a GPU) to path."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(prof.key_averages().table(sort_by=key, row_limit=60) + "\n")


def bench_prefix(model, prefix_len, new_tokens, vocab, device, profile: Optional[Path] = None) -> dict:
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
    if profile is not None:
        _profile(hit_call, profile / "prefix-hit.txt", device)
        _profile(miss_call, profile / "prefix-miss.txt", device)
    return {"prefix_tokens": prefix_len, "new_tokens": new_tokens, "hit_s": hit, "miss_s": miss,
            "miss_over_hit": miss / hit, "hits": cache.hits, "timed_calls": 3}


@torch.no_grad()
def bench_rollout(model, calls: int, rows: int, group: int, max_batch: int, prompt_len: int,
                  max_new_tokens: int, mean_len: float, vocab: int, device, graphs) -> dict:
    """RL rollout calls: `calls` generate calls of `rows` samples (rows // group prompts, each
    sampled `group` times, temperature 1) through `max_batch` slots, with a stop set of
    round(vocab / mean_len) ids, so that a sample of a random model ends after ~mean_len tokens
    (geometrically distributed), each call with decode state kept from the last (a rollout worker's
    `DecodeEngines`). Two ways the host learns that a sample ended, side by
    side: the step's stop flags read behind the steps (`flags`, the engine's way) and polling every
    16 steps (`poll16`, the way before it). Per way: tokens drawn per second, decode steps and
    tokens per call, and the share of the time in prefill (timed with a sync around each)."""
    import inference.generate as engine
    from inference.generate import DecodeEngines

    stop = set(range(max(1, round(vocab / mean_len))))
    real_prefill, real_take = engine._prefill, engine._EndedWatch.take
    spent = {"prefill": 0.0}

    def timed_prefill(*args, **kwargs):
        box = []
        spent["prefill"] += _seconds(lambda: box.append(real_prefill(*args, **kwargs)), device)
        return box[0]

    out = {"calls": calls, "rows": rows, "group": group, "max_batch": max_batch, "prompt_len": prompt_len,
           "max_new_tokens": max_new_tokens, "stop_ids": len(stop)}
    engine._prefill = timed_prefill
    try:
        for name, check_every in (("flags", None), ("poll16", 16)):
            engines = DecodeEngines(model)
            # poll16: the flags never reach the host, so it learns of stops by polling alone
            engine._EndedWatch.take = real_take if check_every is None else (lambda self: [])

            def call(c: int, engines=engines, check_every=check_every) -> list:
                prompts = [_ids(1, prompt_len + c % 3, vocab, device, seed=100 * c + p)[0].tolist()
                           for p in range(max(rows // group, 1)) for _ in range(group)][:rows]
                return generate(model, prompts, max_new_tokens, temperature=1.0, stop=stop, seed=c,
                                max_batch=max_batch, graphs=graphs, engines=engines, check_every=check_every)

            for c in range(3):  # untimed: each shape runs eagerly once, then is captured
                call(c)
            ((_, _, step),) = engines._kept.values()
            before, spent["prefill"] = dict(step.counts), 0.0
            tokens, seconds = 0, 0.0
            for c in range(3, 3 + calls):
                gens, dt = _timed(lambda c=c: call(c), device)
                tokens += sum(len(g.tokens) for g in gens)
                seconds += dt
            steps = {k: step.counts[k] - before[k] for k in step.counts}
            out[name] = {"tokens_per_s": tokens / seconds, "s_per_call": seconds / calls,
                         "tokens_per_call": tokens / calls, "steps_per_call": sum(steps.values()) / calls,
                         "prefill_share": spent["prefill"] / seconds, "timed_steps": steps}
            print(json.dumps({"rollout": {name: out[name]}}), file=sys.stderr, flush=True)
    finally:
        engine._prefill, engine._EndedWatch.take = real_prefill, real_take
    out["flags_over_poll16"] = out["flags"]["tokens_per_s"] / out["poll16"]["tokens_per_s"]
    return out


def _timed(fn, device):
    """(fn's result, seconds)."""
    box = []
    seconds = _seconds(lambda: box.append(fn()), device)
    return box[0], seconds


@torch.no_grad()
def bench_speculative(target, drafter, prompts, batches, new_tokens, temperature, device,
                      capacity: float = 256.0, draft_length: Optional[int] = None) -> dict:
    from inference.speculative import SpeculativeStats, generate_speculative

    out = {}
    for b in batches:
        batch = [prompts[i % len(prompts)] for i in range(b)]
        kw = dict(temperature=temperature, max_batch=b, seed=1)
        generate(target, batch, 4, **kw)  # warm-up at the batch (kernels compile per shape)
        generate_speculative(target, drafter, batch, 8, **kw)
        stats = SpeculativeStats()
        plain_gens, plain = _timed(partial(generate, target, batch, new_tokens, **kw), device)
        spec_gens, spec = _timed(partial(generate_speculative, target, drafter, batch, new_tokens,
                                         stats=stats, capacity=capacity, draft_length=draft_length, **kw),
                                 device)
        # the same path with no drafts: what it costs besides the drafts (a host read of the accepted
        # counts every step, eager steps where `generate` may replay graphs)
        no_draft_gens, no_draft = _timed(partial(generate_speculative, target, drafter, batch, new_tokens,
                                                 draft_length=0, **kw), device)
        plain_tps = sum(len(g.tokens) for g in plain_gens) / plain
        spec_tps = sum(len(g.tokens) for g in spec_gens) / spec
        no_draft_tps = sum(len(g.tokens) for g in no_draft_gens) / no_draft
        row = {"plain_tokens_per_s": plain_tps, "speculative_tokens_per_s": spec_tps,
               "no_draft_tokens_per_s": no_draft_tps, "speedup": spec_tps / plain_tps,
               "speedup_over_no_draft": spec_tps / no_draft_tps, **stats.as_dict()}
        if temperature <= 0:
            row["greedy_identical"] = [g.tokens for g in plain_gens] == [g.tokens for g in spec_gens]
        out[b] = row
        print(json.dumps({b: row}), file=sys.stderr, flush=True)
    return out


def speculative_main(args, device) -> dict:
    from data import build_datasets
    from trainer.dspark import load_dspark_run

    target, drafter, _, cfg = load_dspark_run(args.drafter)
    _, val, _ = build_datasets(cfg.data)
    n = min(args.prompt_len, val.seq_len)
    prompts = [val.get_batch([i])["input_ids"][0, :n].tolist() for i in range(min(64, len(val)))]
    target.to(device)
    drafter.to(device)
    if device.type == "cuda":
        target.to(torch.bfloat16)
        drafter.to(torch.bfloat16)
    batches = [int(x) for x in args.batches.split(",")]
    return {**provenance.header("generate-speculative"), "model": target.cfg.name,
            "drafter_run": str(args.drafter), "prompt_len": n, "new_tokens": args.spec_tokens,
            "temperature": args.temperature, "capacity": args.capacity, "draft_length": args.draft_length,
            "speculative": bench_speculative(target, drafter, prompts, batches, args.spec_tokens,
                                             args.temperature, device, args.capacity, args.draft_length)}


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
    ap.add_argument("--drafter", default=None, help="a finished `flashtrain dspark` run: speculative rows")
    ap.add_argument("--spec-tokens", type=int, default=64, help="tokens per prompt for speculative rows")
    ap.add_argument("--temperature", type=float, default=0.0, help="speculative rows: 0 is greedy")
    ap.add_argument("--capacity", type=float, default=256.0,
                    help="speculative rows: tokens a forward takes before compute, not weight reads, "
                         "bounds it (the draft-length rule's roofline knee; small on a CPU)")
    ap.add_argument("--draft-length", type=int, default=None,
                    help="speculative rows: verify this many drafts every step (default: the rule's choice)")
    ap.add_argument("--graphs", choices=["auto", "on", "off"], default="auto",
                    help="decode steps replayed from CUDA graphs (auto: on CUDA)")
    ap.add_argument("--compile", choices=["off", "on", "both"], default="off",
                    help="decode rows: the step's forward through torch.compile (inductor) before capture; "
                         "both: the eager-forward row and the compiled one side by side")
    ap.add_argument("--plain-steps", type=int, default=4,
                    help="steps of the plain whole-sequence loop per batch size (0: skip it)")
    ap.add_argument("--rollout", default="8,32,8,16,128,40,9",
                    help="the rollout section: calls, rows, group, slots, prompt length, max new tokens, "
                         "mean sample length")
    ap.add_argument("--sections", default="prefill,decode,prefix",
                    help="which sections to run: prefill, decode, prefix, rollout")
    ap.add_argument("--profile", default=None,
                    help="a folder: torch.profiler tables of a few decode steps per batch size, one CED "
                         "prefill and one prefix hit per length")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.drafter:
        result = speculative_main(args, device)
        text = json.dumps(result, indent=1)
        print(text)
        if args.out:
            Path(args.out).write_text(text + "\n")
        return
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
    sections = set(args.sections.split(","))
    if unknown := sections - {"prefill", "decode", "prefix", "rollout"}:
        sys.exit(f"--sections: unknown {sorted(unknown)}; expected some of prefill, decode, prefix, rollout")
    profile = Path(args.profile) if args.profile else None
    if device.type == "cuda":
        from bench.timing import copy_bandwidth_gbs
        result["copy_bandwidth_gbs"] = copy_gbs = copy_bandwidth_gbs()
    else:
        copy_gbs = None
    graphs = {"auto": None, "on": True, "off": False}[args.graphs]
    result["graphs"] = args.graphs
    if "prefill" in sections:
        lengths = [int(x) for x in args.prefill.split(",")]
        result["prefill"] = bench_prefill(model, lengths, args.vocab, device, profile)
        print(json.dumps(result["prefill"]), file=sys.stderr, flush=True)
    if "decode" in sections:
        result["decode"] = bench_decode(model, [int(x) for x in args.batches.split(",")], args.prompt_len,
                                        args.steps, args.vocab, device, graphs, args.plain_steps, copy_gbs,
                                        profile, {"off": (None,), "on": ("inductor",),
                                                  "both": (None, "inductor")}[args.compile])
    if "prefix" in sections:
        result["prefix"] = bench_prefix(model, args.prefix_len, args.new_tokens, args.vocab, device, profile)
    if "rollout" in sections:
        try:
            calls, rows, group, slots, prompt_len, max_new, mean_len = map(float, args.rollout.split(","))
        except ValueError:
            sys.exit(f"--rollout={args.rollout}: expected seven numbers: calls, rows, group, slots, prompt "
                     f"length, max new tokens, mean sample length")
        result["rollout"] = bench_rollout(model, int(calls), int(rows), int(group), int(slots),
                                          int(prompt_len), int(max_new), mean_len, args.vocab, device, graphs)
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
