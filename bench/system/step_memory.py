"""Where a training step's GPU memory goes, and how long the step takes, on one GPU; prints one
JSON object. These are the measured points a memory and step-time model (a planner) is fitted to
and checked against.

For each row (a model, a sequence length, a micro-batch, activation checkpointing off, on, or on
for the first K blocks only (`firstK`: trainer.checkpointed_layers=K), and optionally the
micro-steps a step accumulates): the bytes of the parameters, of the gradients and
of the optimizer state (read off the tensors), the allocator's peak over the whole run and over
the timed steps alone, and the median step time, the optimizer's share of it and the MFU of the
timed steps. Kernels on, bf16 autocast with fp32 master weights, the Muon + Sinkhorn + AdamW
composite with sparse Engram gradients, as the trainer sets a one-GPU run up; random tokens.

A row may name an FP8 recipe (trainer.fp8: tensorwise, rowwise, blockwise; trainer/fp8.py, torchao)
as a sixth field, so FP8 and bf16 rows of one model run side by side in one invocation; its MFU is
still against the bf16 peak. `--compile` compiles every row's blocks (trainer.compile), as
torchao's float8 casts want to be fused.

Models: `small`, and `flash` at its own widths (hidden size, 64 heads on the 512-d latent, the
indexer, o-groups, expert width, 4 mHC streams) with fewer layers and 12 routed experts (one
rank's share at EP=32), top-6 routing, and small Engram tables: `flash-L<layers>`.

`--param-dtypes fp32,bf16` runs every row once per trainer.param_dtype: bf16 stores the weights in bf16
with fp32 masters (optim/composite.py, trainer/master_weights.py). One GPU owns every parameter, so
its masters are all of them (`master_gib`, beside `optimizer_state_gib`); at N ranks an owner keeps
about 1/N of them, which the planner counts. `lm_loss_first` is the first step's loss: the same for
both dtypes, as autocast computes with the same bf16 weights. `--recompute none,moe_act` runs every
row once per trainer.recompute_modules variant (selective recomputation in the blocks not
checkpointed whole).

    python -m bench.system.step_memory [--rows small:4096:2:0,small:4096:2:first8,flash-L4:4096:1:1:4,
        flash-L4:4096:1:1:4:rowwise]
        [--steps 3] [--compile] [--param-dtypes fp32,bf16] [--recompute none,moe_act] [--out FILE]
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from bench import provenance
from conf.errors import ConfigError
from conf.model import FlashModelConfig, SmallModelConfig
from conf.optim import MuonConfig
from model.accounting import model_summary, train_flops_per_token
from optim import CompositeOptimizer, build_optimizer, route_parameters
from trainer.fp8 import apply_fp8, check_fp8
from trainer.master_weights import Fp32Grads, fp32_parameters
from trainer.metrics import device_peak_flops
from trainer.parallelize import (
    build_layout,
    check_recompute_modules,
    checkpoint_blocks,
    compile_blocks,
    recompute_modules,
    reduce_gradients,
)
from trainer.pretrain import assemble_model

GIB = 2**30
DEFAULT_ROWS = ("small:4096:1:0,small:4096:2:0,small:8192:1:0,small:4096:2:1,small:16384:1:1,"
                "flash-L2:4096:1:0,flash-L4:4096:1:0,flash-L4:8192:1:0,flash-L4:4096:1:1,flash-L4:16384:1:1")


def model_config(name: str, vocab: int):
    if name == "small":
        return dataclasses.replace(SmallModelConfig(), vocab_size=vocab, kernels=True, attn_chunk_tokens=0)
    if not name.startswith("flash-L"):
        raise SystemExit(f"--rows: unknown model {name!r} (small or flash-L<layers>)")
    layers = int(name.removeprefix("flash-L"))
    encoder = max(1, layers // 2)
    return dataclasses.replace(FlashModelConfig(), vocab_size=vocab, kernels=True, attn_chunk_tokens=0,
                               n_layers=layers, n_encoder_layers=encoder, n_swa_layers=1,
                               encoder_group=max(1, encoder - 1), decoder_group=2, n_routed_experts=12,
                               engram_layers=[1] if layers > 1 else [], engram_min_rows=10_000)


def _bytes(tensors) -> int:
    """Bytes the tensors occupy; a sparse one (the Engram tables' row gradients) by its values and indices."""
    return sum(_bytes((t._values(), t._indices())) if t.is_sparse else t.numel() * t.element_size()
               for t in tensors)


def measure(name: str, seq_len: int, micro_batch: int, checkpointing: bool | int, steps: int, vocab: int,
            accumulation: int = 1, fp8: str = "none", compiled: bool = False,
            param_dtype: str = "fp32", recompute: str = "none") -> dict:
    check_fp8(fp8, False, "bf16", 0, torch.device("cuda"))
    torch.manual_seed(0)
    with torch.device("cuda"):
        model, _ = assemble_model(model_config(name, vocab))
    conversion = apply_fp8(model, fp8)  # as the trainer: before compiling and checkpointing
    # True: every block; an int: the first that many (trainer.checkpointed_layers)
    layers = None if checkpointing is True else int(checkpointing)
    checkpointed = checkpoint_blocks(model, layers) if checkpointing is not False else 0
    recompute_modules(model, [] if recompute == "none" else [recompute], start=checkpointed)
    if compiled:  # as the trainer: the blocks after the checkpointed ones
        compile_blocks(model, start=checkpointed)
    if param_dtype == "bf16":  # the trainer's bf16 weights, every master on this one rank
        opt = CompositeOptimizer(route_parameters(model, MuonConfig()), MuonConfig(), master_weights=True,
                                 keep_fp32=fp32_parameters(model), master_min_replicas=1)
        opt.store_params_low_precision()
        fp32_grads = Fp32Grads(opt.low_precision_params())
    else:
        opt, fp32_grads = build_optimizer(model, MuonConfig(), zero_stage=0), None
    opt.enable_sparse_table_grads(model)
    masters = opt.master_of() if isinstance(opt, CompositeOptimizer) else {}
    layout = build_layout(0, 1, 1, model.cfg.n_routed_experts)
    params = _bytes(model.parameters())
    first_loss = None
    g = torch.Generator(device="cuda").manual_seed(0)
    times, optimizer_times, grads, warmup_peak = [], [], 0, 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for step in range(steps + 2):  # two warm-up steps: autotuning, allocator growth, optimizer state
        batches = [torch.randint(0, vocab, (micro_batch, seq_len + 1), device="cuda", generator=g)
                   for _ in range(accumulation)]
        torch.cuda.synchronize()
        if step == 2:  # the timed steps' own peak, apart from the warm-up's (autotuning runs there)
            warmup_peak = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        for ids in batches:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(ids[:, :-1], labels=ids[:, 1:])
            (out.loss / accumulation).backward()
            first_loss = out.lm_loss.item() if first_loss is None else first_loss
        grads = (_bytes(p.grad for p in model.parameters() if p.grad is not None)
                 + (fp32_grads.held_bytes() if fp32_grads is not None else 0))
        torch.cuda.synchronize()
        optimizer_start = time.perf_counter()
        if fp32_grads is not None:  # the fp32 gradients onto the masters (one rank: no reduction)
            reduce_gradients(model, layout, set(), {}, fp32_grads=fp32_grads.take(), masters=masters)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if step >= 2:
            times.append(time.perf_counter() - start)
            optimizer_times.append(time.perf_counter() - optimizer_start)
    state = _bytes(t for inner in _inner_optimizers(opt) for st in inner.state.values() for t in st.values()
                   if torch.is_tensor(t))
    master_bytes = _bytes(masters.values())
    step_s = statistics.median(times)
    flops = train_flops_per_token(model, seq_len)
    peak, source = device_peak_flops(torch.device("cuda"), None)
    summary = model_summary(model)
    tokens_per_s = accumulation * micro_batch * seq_len / step_s
    row = {"model": name, "seq_len": seq_len, "micro_batch": micro_batch,
           "activation_checkpointing": checkpointed > 0, "checkpointed_layers": checkpointed,
           "accumulation": accumulation,
           "fp8": fp8, "fp8_matmul_sites": len(conversion.converted), "compiled": compiled,
           "param_dtype": param_dtype, "master_gib": master_bytes / GIB, "recompute_modules": recompute,
           "layers": model.cfg.n_layers,
           "params": summary["all_params"],
           "routed_expert_params": summary["routed_expert_params"],
           "param_gib": params / GIB, "grad_gib": grads / GIB, "optimizer_state_gib": state / GIB,
           "peak_gib": max(warmup_peak, torch.cuda.max_memory_allocated()) / GIB,
           "steady_peak_gib": torch.cuda.max_memory_allocated() / GIB,
           "reserved_peak_gib": torch.cuda.max_memory_reserved() / GIB,
           "step_s": step_s, "optimizer_s": statistics.median(optimizer_times), "tokens_per_s": tokens_per_s,
           "flops_per_token": flops, "mfu": tokens_per_s * flops / peak, "peak_source": source,
           "lm_loss_first": first_loss, "lm_loss_last": out.lm_loss.item()}
    # what the step adds on top of the states it keeps: activations, workspaces, the transient gradients
    row["activation_peak_gib"] = (row["peak_gib"] - row["param_gib"] - row["grad_gib"]
                                  - row["optimizer_state_gib"] - row["master_gib"])
    if fp32_grads is not None:
        fp32_grads.remove()
    del model, opt, out, masters
    torch.cuda.empty_cache()
    return row


def _inner_optimizers(opt):
    """The torch optimizers a composite holds (itself when it is one)."""
    inner = getattr(opt, "optimizers", None)
    return list(inner.values()) if isinstance(inner, dict) else [opt]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default=DEFAULT_ROWS,
                    help="comma-separated model:seq_len:micro_batch:checkpointing(0, 1 or firstK)"
                         "[:micro-steps a step"
                         "[:fp8 recipe]]")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="torch.compile each block in every row")
    ap.add_argument("--param-dtypes", default="fp32",
                    help="comma-separated trainer.param_dtype values (fp32, bf16): each row once per value")
    ap.add_argument("--recompute", default="none",
                    help="comma-separated trainer.recompute_modules variants (none, moe_act): each row once "
                         "per variant, in the blocks the row does not checkpoint whole")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--vocab", type=int, default=129_280)
    args = ap.parse_args()
    result = {**provenance.header("step_memory"), "rows": []}
    dtypes = args.param_dtypes.split(",")
    if not dtypes or any(d not in ("fp32", "bf16") for d in dtypes):
        raise SystemExit(f"--param-dtypes {args.param_dtypes}: expected fp32 and/or bf16")
    variants = args.recompute.split(",")
    try:
        check_recompute_modules([v for v in variants if v != "none"])
    except ConfigError as e:
        raise SystemExit(f"--recompute: {e}") from None
    for spec, param_dtype, recompute in ((spec, d, v) for spec in args.rows.split(",") for d in dtypes
                                         for v in variants):
        name, seq_len, micro_batch, ac, *rest = spec.split(":")
        accumulation, fp8 = (int(rest[0]) if rest else 1), (rest[1] if len(rest) > 1 else "none")
        if ac not in ("0", "1") and not (ac.startswith("first") and ac[5:].isdigit()):
            raise SystemExit(f"--rows {spec}: checkpointing {ac!r} is 0, 1 or firstK")
        checkpointing = int(ac[5:]) if ac.startswith("first") else ac == "1"
        try:
            row = measure(name, int(seq_len), int(micro_batch), checkpointing, args.steps, args.vocab,
                          accumulation, fp8, args.compile, param_dtype, recompute)
        except torch.OutOfMemoryError as e:
            row = {"model": name, "seq_len": int(seq_len), "micro_batch": int(micro_batch),
                   "activation_checkpointing": ac != "0", "fp8": fp8, "oom": " ".join(str(e).split())[:400]}
        except ConfigError as e:  # an fp8 recipe this GPU or torchao install cannot run
            row = {"model": name, "seq_len": int(seq_len), "fp8": fp8, "error": str(e)}
        # A failed row's tensors stay reachable from its traceback's frames until the cycle
        # collector runs; without this every later row would start on a full device.
        gc.collect()
        torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)
        result["rows"].append(row)
        provenance.save_partial(result, args.out)
    provenance.emit(result, args.out)


if __name__ == "__main__":
    main()
