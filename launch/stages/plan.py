"""`flashtrain plan model=flash cluster.nodes=8 cluster.gpu=h200`: every parallel layout the
trainer can run on that cluster, with what its fullest rank holds in GPU memory and an estimate of
its step time; the layouts that fit first, the fastest first; a layout that does not fit names the
number that does not."""
import dataclasses
import json
from pathlib import Path

from conf.errors import ConfigError
from conf.plan import GPUS, ActivationRates, PlanConfig, StepRates
from launch.stages import register_stage

GIB = 2**30


@register_stage("plan", PlanConfig, help="which parallel layouts fit a cluster, and the memory of one rank")
def plan(cfg: PlanConfig, run_dir: Path, config_yaml: str):
    import torch

    from model.transformer import Transformer
    from trainer.plan import (
        ModelFacts,
        accumulation_steps,
        candidate_layouts,
        fewest_checkpointed,
        plan_rank,
        state_bytes,
        step_time,
    )

    c, o = cfg.cluster, cfg.plan
    if c.gpu not in GPUS:
        raise ConfigError(f"cluster.gpu={c.gpu!r}: expected one of {sorted(GPUS)}")
    if c.nodes < 1 or c.gpus_per_node < 1:
        raise ConfigError(f"cluster: nodes ({c.nodes}) and gpus_per_node ({c.gpus_per_node}) must be >= 1")
    model_cfg = cfg.model
    if model_cfg.vocab_size is None:
        model_cfg = dataclasses.replace(model_cfg, vocab_size=129_280)
    with torch.device("meta"):
        model = Transformer(model_cfg)
    world = c.nodes * c.gpus_per_node
    capacity = int((GPUS[c.gpu].memory_gib - c.memory_headroom_gib) * GIB)
    facts = ModelFacts.of(model, cfg.optim)
    if o.global_batch < 0:
        raise ConfigError(f"plan.global_batch={o.global_batch}: expected sequences per step, or 0")
    gpu = GPUS[c.gpu]
    rows, times = [], {}
    bad = [t for t in o.engram_tables if t not in ("gpu", "host")]
    if bad or not o.engram_tables:
        raise ConfigError(f"plan.engram_tables={list(o.engram_tables)}: expected gpu and/or host")
    bad = [g for g in o.grad_accum_dtypes if g not in ("fp32", "bf16")]
    if bad or not o.grad_accum_dtypes:
        raise ConfigError(f"plan.grad_accum_dtypes={list(o.grad_accum_dtypes)}: expected fp32 and/or bf16")
    bad = [g for g in o.param_dtypes if g not in ("fp32", "bf16")]
    if bad or not o.param_dtypes:
        raise ConfigError(f"plan.param_dtypes={list(o.param_dtypes)}: expected fp32 and/or bf16")
    bad = [m for m in o.checkpointing if m not in ("none", "fewest", "full")]
    if bad or not o.checkpointing:
        raise ConfigError(f"plan.checkpointing={list(o.checkpointing)}: expected none, fewest and/or full")
    bad = [m for m in o.recompute_modules if m not in ("none", "moe_act")]
    if bad or not o.recompute_modules:
        raise ConfigError(f"plan.recompute_modules={list(o.recompute_modules)}: expected none and/or moe_act")
    n_layers = model_cfg.n_layers
    for layout in candidate_layouts(facts, world, model_cfg, o.seq_len, o.micro_batches, o.expert_parallel,
                                    o.zero_stages, o.context_parallel, o.engram_tables, o.grad_accum_dtypes,
                                    o.param_dtypes, o.recompute_modules, o.images):
        accumulation = accumulation_steps(layout, o.global_batch)
        state = state_bytes(facts, layout, accumulation)  # the same for every checkpointing choice
        listed = set()
        for mode in o.checkpointing:
            if mode == "fewest":  # none when nothing fits (the full row says why)
                fewest = fewest_checkpointed(facts, layout, ActivationRates(), capacity, accumulation, state)
                row = plan_rank(facts, layout, n_layers, ActivationRates(), capacity,
                                accumulation, state) if fewest is None else fewest
            else:
                row = plan_rank(facts, layout, 0 if mode == "none" else n_layers, ActivationRates(), capacity,
                                accumulation, state)
            # moe_act acts on the blocks not checkpointed whole: with all of them checkpointed the row is
            # the one without it
            if row.checkpointed in listed or (layout.moe_act and row.checkpointed == n_layers
                                              and "none" in o.recompute_modules):
                continue
            listed.add(row.checkpointed)
            parts = step_time(facts, layout, row.checkpointed, accumulation, gpu, c.gpus_per_node,
                              StepRates())
            step_s = sum(parts.values())
            tokens = layout.tokens_per_rank * accumulation
            flops = tokens * facts.flops_per_token(layout.seq_len)
            times[id(row)] = {"accumulation": accumulation, "step_s": step_s,
                              "tokens_per_s_per_gpu": tokens / step_s,
                              "mfu": flops / step_s / (gpu.bf16_tflops * 1e12),
                              **{f"{k.replace(' ', '_').replace('-', '_')}_s": v for k, v in parts.items()}}
            rows.append(row)
    # fitting layouts first, the fastest (estimated tokens/s per GPU) first; then the nearest to fitting
    rows.sort(key=lambda r: (False, -times[id(r)]["tokens_per_s_per_gpu"]) if r.fits else (True, r.total))
    summary = {"model": model_cfg.name, "world": world, "gpu": c.gpu, "capacity_gib": capacity / GIB,
               "images": o.images, "feasible": sum(r.fits for r in rows), "layouts": len(rows),
               "rows": [{"ep": r.layout.ep, "cp": r.layout.cp, "zero_stage": r.layout.zero_stage,
                         "grad_accum_dtype": r.layout.grad_accum_dtype, "param_dtype": r.layout.param_dtype,
                         "micro_batch": r.layout.micro_batch, "seq_len": r.layout.seq_len,
                         "activation_checkpointing": r.checkpointed > 0,
                         "checkpointed_layers": r.checkpointed,
                         "recompute_modules": "moe_act" if r.layout.moe_act else "none",
                         "peak": r.peak, "not_at_peak": sorted(r.absent),
                         "engram_tables": "host" if r.layout.engram_host else "gpu",
                         "host_engram_gib": r.host_bytes / GIB,
                         "fits": r.fits, "total_gib": r.total / GIB,
                         **{f"{k.replace(' ', '_')}_gib": v / GIB for k, v in r.parts.items()},
                         **times[id(r)],
                         **({} if r.fits else {"why": r.why_not()})} for r in rows]}
    if o.json:
        print(json.dumps(summary))
        return summary
    print(f"flashtrain plan: model {model_cfg.name} on {c.nodes} x {c.gpus_per_node} {c.gpu.upper()} "
          f"({world} ranks, {capacity / GIB:,.1f} GiB usable each), {o.seq_len}-token sequences: "
          f"{summary['feasible']} of {len(rows)} layouts fit")
    print(f"  {'EP':>4} {'CP':>3} {'ZeRO':>4} {'grads':>5} {'param':>5} {'mb':>3} {'AC':>3} {'recomp':>7} "
          f"{'tables':>6} {'GiB':>8} "
          f"{'step s':>7} {'tok/s/GPU':>9} {'MFU':>5}  parameters / gradients / optimizer / "
          "[host-table rows in flight /] activations or optimizer workspace (GiB), whichever peaks")
    for r in rows[:o.top]:
        parts = " / ".join(f"({v / GIB:,.1f})" if k in r.absent else f"{v / GIB:,.1f}"
                           for k, v in r.parts.items())
        verdict = "fits" if r.fits else r.why_not()
        if r.host_bytes:
            verdict += f" (+{r.host_bytes / GIB:,.1f} GiB of Engram shards in host memory)"
        t = times[id(r)]
        print(f"  {r.layout.ep:>4} {r.layout.cp:>3} {r.layout.zero_stage:>4} {r.layout.grad_accum_dtype:>5} "
              f"{r.layout.param_dtype:>5} "
              f"{r.layout.micro_batch:>3} "
              f"{_blocks(r.checkpointed, n_layers):>3} {'moe_act' if r.layout.moe_act else '-':>7} "
              f"{'host' if r.layout.engram_host else 'gpu':>6} "
              f"{r.total / GIB:>8,.1f} {t['step_s']:>7.2f} "
              f"{t['tokens_per_s_per_gpu']:>9,.0f} {t['mfu']:>5.1%}  {parts}  {verdict}")
    print("  step time: the model's FLOPs and each layer's rest at rates measured on one GPU, the EP "
          "all-to-all and the gradient reduction at link bandwidth, the optimizer per element updated; "
          "nothing overlapped (plan.json=true gives each part); AC: the blocks checkpointed, all or the "
          "first N (trainer.activation_checkpointing=true trainer.checkpointed_layers=N); recomp: "
          "trainer.recompute_modules=[moe_act] in the other blocks; (gradients): not held at the peak, "
          "the end of the forward of one micro-step a step, before the backward makes them")
    if len(rows) > o.top:
        print(f"  ... {len(rows) - o.top} more (plan.top, plan.json=true)")
    return summary


def _blocks(checkpointed: int, n_layers: int) -> str:
    """The AC column: off, all, or how many of the first blocks are checkpointed."""
    return "off" if checkpointed == 0 else "all" if checkpointed == n_layers else str(checkpointed)
