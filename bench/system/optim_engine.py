"""Gradient reduction + optimizer step: flashtrain's hand path against DeepSpeed's ZeRO-1/2; prints JSON.

The same model at each world size, one timed step after `--warmup` untimed ones, median of `--steps`:

  hand-muon       the trainer's default: DeepSpeed at ZeRO-0 with its all-reduce off; the trainer
                  reduces each gradient to its owner (`reduce_gradients`), takes the global norm, and
                  the composite optimiser (Muon + Sinkhorn + AdamW) steps whole parameters on their
                  owners and broadcasts them (trainer.zero_stage=1)
  hand-muon-allreduce  the same, but every rank receives every gradient (an all-reduce): the
                  trainer's reduction before it reduced to owners
  hand-adamw      the same machinery with AdamW on every parameter: the cost of the hand sharding itself
  ds-zero{1,2}-adamw   DeepSpeed's own ZeRO with torch AdamW (what `optim=adamw` runs)
  ds-zero{1,2}-muon    DeepSpeed's MuonWithAuxAdam under its ZeRO: Muon on the matrices our routing gives
                  Muon (head counts and expert stacks tagged as DeepSpeed reads them), its Adam on the rest
                  (it has no Sinkhorn); a failure to build or step is recorded, not raised

Each step backpropagates a loss linear in the parameters (sum of p * g for fixed random g), so the
gradients are the same on every path and the backward costs a few elementwise passes: what differs
is the reduction (in DeepSpeed's backward hooks or at the boundary) and the step. `backward_s` is
that backward alone, for reference. `step_cpu_s` is the slowest rank's process CPU time for the
step: on a CPU shared with other work it is steadier than the wall time, which counts waiting for
a core (gloo waits for its peers without spinning). Bytes per rank and step are counted from the
parameter sizes (ring collectives): a reduce-scatter (or a reduce of each owner's share) and an
all-gather (or a broadcast of each owner's share) each move (W-1)/W of the buffer, an all-reduce
twice that.

    python -m bench.system.optim_engine --world 2,4 --out bench/results/system/optim-engine-cpu.json
    python -m bench.system.optim_engine --world 1 --model small \
        --out bench/results/system/optim-engine-h100.json
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench import provenance

PATHS = ("hand-muon", "hand-muon-allreduce", "hand-adamw", "ds-zero1-adamw", "ds-zero2-adamw",
         "ds-zero1-muon", "ds-zero2-muon")


def _model(name: str):
    from conf.model import SmallModelConfig, TinyModelConfig
    from model.transformer import Transformer

    cfg = {"tiny": TinyModelConfig(vocab_size=50_000), "small": SmallModelConfig(vocab_size=129_280)}[name]
    torch.manual_seed(0)
    return Transformer(dataclasses.replace(cfg, engram_min_rows=1000))


def _tag_for_deepspeed_muon(model, routes) -> None:
    """DeepSpeed's Muon reads these attributes off each parameter (deepspeed/runtime/zero/muon)."""
    by_param = {id(r.param): r for r in routes}
    for p in model.parameters():
        r = by_param[id(p)]
        p.use_muon = r.optimizer == "muon"
        if r.optimizer == "muon" and r.heads > 1:
            p.muon_num_heads = r.heads
        if r.optimizer == "muon" and p.dim() == 3:
            p.is_expert_group = True


def _build(path: str, model, rank: int, world: int, precision: str, device):
    """(engine, owners): owners is None for DeepSpeed's own paths, else the hand path's owner of
    each parameter (the trainer reduces each gradient to it)."""
    import deepspeed

    from conf.optim import AdamWConfig, MuonConfig
    from conf.trainer import TrainerConfig
    from optim import CompositeOptimizer, route_parameters
    from trainer.distributed import DistInfo
    from trainer.engine import build_engine, deepspeed_config, keep_fp32_buffers

    info = DistInfo(rank, world, rank if device.type == "cuda" else 0, device)
    tc = TrainerConfig(precision=precision, grad_clip=1.0)
    if path.startswith("hand"):
        cfg = AdamWConfig() if path == "hand-adamw" else MuonConfig()
        opt = CompositeOptimizer(route_parameters(model, cfg), cfg, rank, world, shard=True)
        engine, _ = build_engine(model, opt, None, tc, info, whole_param_optimizer=True)
        return engine, {} if path == "hand-muon-allreduce" else opt.owner_ranks()
    stage = int(path[len("ds-zero")])
    if path.endswith("adamw"):
        cfg = AdamWConfig()
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
        engine, _ = build_engine(model, opt, None, dataclasses.replace(tc, zero_stage=stage), info,
                                 whole_param_optimizer=False)
        return engine, None
    cfg = MuonConfig()
    _tag_for_deepspeed_muon(model, route_parameters(model, cfg))
    ds = deepspeed_config(dataclasses.replace(tc, zero_stage=stage, micro_batch_size=1), stage,
                          bf16_master=precision == "bf16")
    ds["optimizer"] = {"type": "muon", "params": {"lr": cfg.lr, "momentum": cfg.muon_momentum,
                                                  "weight_decay": cfg.muon_weight_decay, "torch_adam": True}}
    model.to(device)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    keep_fp32_buffers(engine.module)
    return engine, None


def _run_path(path: str, model_name: str, rank: int, world: int, precision: str, device, steps: int,
              warmup: int) -> dict:
    from trainer.parallelize import build_layout, clip_grad_norm, reduce_gradients

    model = _model(model_name)
    n_params = sum(p.numel() for p in model.parameters())
    try:
        engine, owners = _build(path, model, rank, world, precision, device)
    except Exception as e:  # a path DeepSpeed refuses is a result, not a crash
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    layout = build_layout(rank, world, 1, model.cfg.n_routed_experts)
    params = [p for p in engine.module.parameters() if p.requires_grad]
    g = torch.Generator(device="cpu").manual_seed(1)
    directions = [(torch.randn(p.shape, generator=g) * 1e-3).to(device, p.dtype) for p in params]

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def backward():
        loss = sum((p * d).sum() for p, d in zip(params, directions))
        engine.backward(loss)

    times, back, reduce, cpu = [], [], [], []
    try:
        for i in range(warmup + steps):
            dist.barrier()
            sync()
            start, start_cpu = time.perf_counter(), time.process_time()
            backward()
            sync()
            mid = time.perf_counter()
            if owners is not None:
                reduce_gradients(engine.module, layout, set(), owners)
                clip_grad_norm(engine.module, layout, set(), 1.0, sharded=bool(owners))
                sync()
            reduced = time.perf_counter()
            engine.step()
            sync()
            if i >= warmup:
                times.append(time.perf_counter() - start)
                back.append(mid - start)
                reduce.append(reduced - mid)
                cpu.append(time.process_time() - start_cpu)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}",
                "where": traceback.format_exc().splitlines()[-3][:200]}
    slow = torch.tensor([statistics.median(x) for x in (times, back, reduce, cpu)], dtype=torch.float64)
    dist.all_reduce(slow, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
    # backward_s holds DeepSpeed's reduction (its hooks, or its boundary reduce at ZeRO-1) and, for
    # its Muon, the Newton-Schulz iterations; hand_reduce_s is the hand path's reduction and norm
    out = {"step_s": slow[0].item(), "backward_s": slow[1].item(), "step_cpu_s": slow[3].item(),
           "params": n_params}
    if owners is not None:
        out["hand_reduce_s"] = slow[2].item()
    out.update(bytes_per_rank(path, n_params, world, precision))
    return out


def bytes_per_rank(path: str, n_params: int, world: int, precision: str) -> dict:
    """Gradient and weight bytes one rank sends per step (ring collectives; see the docstring)."""
    share = (world - 1) / world
    grad = 4  # the hand path reduces fp32 gradients (fp32 master weights, autocast compute)
    weight = 4
    if path.startswith("ds") and precision == "bf16":
        grad = weight = 2  # DeepSpeed's bf16 engine reduces and gathers bf16
    # the hand path reduces to owners and broadcasts from them; ZeRO reduce-scatters and all-gathers:
    # the same bytes. An all-reduce moves twice a reduce-scatter's.
    reduce = (2 if path.endswith("allreduce") else 1) * share * grad * n_params
    gather = share * weight * n_params
    return {"reduce_bytes": reduce, "gather_bytes": gather, "total_bytes": reduce + gather}


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from trainer.distributed import init_distributed

    if args.threads:
        torch.set_num_threads(args.threads)
    info = init_distributed(600)
    precision = args.precision
    if precision == "auto":
        precision = "bf16" if info.device.type == "cuda" else "fp32"
    results = {}
    for path in args.paths.split(","):
        results[path] = _run_path(path, args.model, rank, world, precision, info.device, args.steps,
                                  args.warmup)
        if info.device.type == "cuda":
            torch.cuda.empty_cache()
        dist.barrier()
    if rank == 0:
        torch.save({"precision": precision, "paths": results}, Path(out_dir) / "result.pt")
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", default="2,4", help="comma-separated world sizes, one run each")
    ap.add_argument("--model", default="tiny", choices=("tiny", "small"))
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16"))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (0: torch's default)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from trainer.distributed import free_port

    result = {**provenance.header("optim_engine"), "model": args.model, "steps": args.steps,
              "warmup": args.warmup, "threads_per_rank": args.threads, "runs": {}}
    try:
        import deepspeed

        result["versions"]["deepspeed"] = deepspeed.__version__
    except ImportError:
        pass
    for world in map(int, args.world.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            mp.start_processes(_worker, args=(world, free_port(), args, tmp), nprocs=world, join=True,
                               start_method="spawn")
            run = torch.load(Path(tmp) / "result.pt", weights_only=False)
        hand = run["paths"].get("hand-muon", {}).get("step_s")
        for entry in run["paths"].values():
            if hand and "step_s" in entry:
                entry["over_hand_muon"] = entry["step_s"] / hand
        result["runs"][str(world)] = run
    provenance.emit(result, args.out)


if __name__ == "__main__":
    main()
