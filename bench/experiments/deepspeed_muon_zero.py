"""What DeepSpeed's own Muon under ZeRO-1/2 does with what flashtrain's optimiser path needs; prints JSON.

On CPU ranks over gloo, on a toy model holding the three kinds of parameter that matter (a table
with sparse row gradients, a 2-D matrix, a 3-D expert stack):

  sparse_rows     ZeRO-1 and ZeRO-2 with an embedding that produces sparse row gradients (Engram's)
  bf16_expert     ZeRO-1 under bf16 with a 3-D stack tagged as experts, with DeepSpeed's default bf16
                  gradients and with fp32 gradient accumulation (its BF16 optimiser)
  resume_world    a Muon + ZeRO-1 checkpoint written at 2 ranks, loaded at 1 rank with its optimizer
                  states, and whether the momentum that comes back is the momentum that was saved

    python -m bench.experiments.deepspeed_muon_zero \
        --out bench/results/experiments/deepspeed-muon-zero-cpu.json
"""
from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch import nn

from bench import provenance


class Toy(nn.Module):
    def __init__(self, sparse: bool):
        super().__init__()
        self.table = nn.Embedding(64, 16, sparse=sparse)
        self.proj = nn.Linear(16, 32, bias=False)
        self.experts = nn.Parameter(torch.randn(4, 32, 16) * 0.1)  # [E, out, in]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.table(ids))  # [N, 32]
        return torch.einsum("nd,edk->nek", h, self.experts).square().mean()


def _engine(stage: int, sparse: bool, bf16: bool = False, seed: int = 0, fp32_grads: bool = False):
    import deepspeed

    torch.manual_seed(seed)
    model = Toy(sparse)
    for name, p in model.named_parameters():
        p.use_muon = name != "table.weight"
    model.experts.is_expert_group = True
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
              "bf16": {"enabled": bf16}, "steps_per_print": 2**31 - 1,
              "optimizer": {"type": "muon", "params": {"lr": 1e-2, "momentum": 0.95, "torch_adam": True}}}
    if fp32_grads:
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _step(engine, step: int) -> None:
    ids = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(step))
    engine.backward(engine(ids))
    engine.step()


def _outcome(fn) -> dict:
    try:
        return {"ok": True, **(fn() or {})}
    except Exception as e:  # the refusal (or crash) is the finding
        return {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}


def _momentum(engine) -> dict[str, torch.Tensor]:
    """Muon momentum as the ZeRO optimiser holds it: one flat buffer per group."""
    out = {}
    for i, group in enumerate(engine.optimizer.optimizer.param_groups):
        for p in group["params"]:
            buf = engine.optimizer.optimizer.state.get(p, {}).get("momentum_buffer")
            if buf is not None:
                out[f"group{i}"] = buf.detach().clone()
    return out


def _worker(rank: int, world: int, port: int, task: str, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch.distributed as dist

    from trainer.distributed import init_distributed

    init_distributed(300)
    result: dict = {}
    if task == "sparse_bf16":
        for stage in (1, 2):
            result[f"sparse_rows_zero{stage}"] = _outcome(lambda stage=stage: _step(_engine(stage, True), 0))
        result["bf16_expert_zero1"] = _outcome(lambda: _step(_engine(1, False, bf16=True), 0))
        result["bf16_expert_zero1_fp32_grads"] = _outcome(
            lambda: _step(_engine(1, False, bf16=True, fp32_grads=True), 0))
    elif task == "save":
        engine = _engine(1, False)
        for s in range(2):
            _step(engine, s)
        engine.save_checkpoint(out_dir, tag="ckpt")
        moms = [None] * world
        dist.all_gather_object(moms, {k: v.numel() for k, v in _momentum(engine).items()})
        partition = sum(t.numel() for t in engine.optimizer.single_partition_of_fp32_groups)
        result = {"momentum_numel_per_rank": moms, "fp32_partition_numel_rank0": partition,
                  "params_numel": sum(p.numel() for p in engine.module.parameters())}
        torch.save(_momentum(engine), Path(out_dir) / f"momentum{rank}.pt")
    elif task == "load":
        def load():
            engine = _engine(1, False, seed=1)
            path, _ = engine.load_checkpoint(out_dir, tag="ckpt", load_optimizer_states=True)
            loaded = _momentum(engine)
            saved = [torch.load(Path(out_dir) / f"momentum{r}.pt") for r in range(2)]
            return {"loaded": path is not None,
                    "loaded_momentum_numel": {k: v.numel() for k, v in loaded.items()},
                    "saved_momentum_numel": [{k: v.numel() for k, v in s.items()} for s in saved]}
        result = _outcome(load)
    if rank == 0:
        torch.save(result, Path(out_dir) / f"{task}.pt")
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def _spawn(world: int, task: str, out_dir: str) -> dict:
    from trainer.distributed import free_port

    mp.start_processes(_worker, args=(world, free_port(), task, out_dir), nprocs=world, join=True,
                       start_method="spawn")
    return torch.load(Path(out_dir) / f"{task}.pt", weights_only=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    result = provenance.header("deepspeed_muon_zero")
    import deepspeed

    result["versions"]["deepspeed"] = deepspeed.__version__
    with tempfile.TemporaryDirectory() as tmp:
        result.update(_spawn(2, "sparse_bf16", tmp))
        result["resume_world"] = {"saved_at_2": _spawn(2, "save", tmp), "loaded_at_1": _spawn(1, "load", tmp)}
    provenance.emit(result, args.out)


if __name__ == "__main__":
    main()
