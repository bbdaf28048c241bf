"""Optimiser routing, the composite optimiser and its whole-parameter ZeRO-1 sharding."""
import dataclasses
import datetime
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conf.errors import ConfigError
from conf.model import FlashModelConfig, TinyModelConfig
from conf.optim import AdamWConfig, MuonConfig, RouteRule
from model.transformer import Transformer
from optim import CompositeOptimizer, build_optimizer, route_parameters

TINY = dataclasses.replace(TinyModelConfig(vocab_size=97), engram_min_rows=50)


def test_flash_routing_assigns_every_parameter_once():
    with torch.device("meta"):
        model = Transformer(FlashModelConfig())
    routes = route_parameters(model, MuonConfig())
    names = [r.name for r in routes]
    assert len(names) == len(set(names)) == len(list(model.parameters()))
    by_name = {r.name: r for r in routes}
    assert by_name["embed.weight"].optimizer == by_name["head.weight"].optimizer == "sinkhorn"
    assert by_name["engrams.14.table.weight"].optimizer == "sinkhorn"
    assert by_name["layers.20.attn.wq_b.weight"].heads == 64
    assert by_name["layers.20.attn.index_query.wq_b.weight"].heads == 32
    assert by_name["layers.3.moe.experts.w2"].optimizer == "muon"  # per expert: a 3-D stack
    assert by_name["layers.3.attn.sink"].optimizer == "adamw"
    assert by_name["layers.3.attn_norm.weight"].weight_decay == 0.0
    assert {r.optimizer for r in routes if r.param.dim() == 1} == {"adamw"}
    for name in ("engrams.14.hidden_norm_weight", "engrams.1.key_norm_weight"):  # [4, 5120]: not Muon's
        assert by_name[name].param.dim() == 2
        assert (by_name[name].optimizer, by_name[name].weight_decay) == ("adamw", 0.0)


def test_engram_norm_weights_never_decay():
    model = Transformer(TINY)
    for cfg in (MuonConfig(), AdamWConfig()):
        routes = {r.name: r for r in route_parameters(model, cfg)}
        gate = [r for n, r in routes.items() if n.endswith("_norm_weight")]
        assert len(gate) == 2 * len(TINY.engram_layers)
        assert {(r.optimizer, r.weight_decay) for r in gate} == {("adamw", 0.0)}
        assert routes["engrams.1.proj.weight"].weight_decay > 0  # other matrices keep their decay


def test_rules_from_config_and_errors():
    model = Transformer(TINY)
    cfg = MuonConfig(rules=[RouteRule(pattern=r"\.experts\.", optimizer="adamw", lr_mult=0.5),
                            RouteRule(pattern=".", optimizer="muon", min_dim=2),
                            RouteRule(pattern=".", optimizer="adamw", weight_decay=0.0)])
    routes = {r.name: r for r in route_parameters(model, cfg)}
    assert routes["layers.0.moe.experts.w1"].optimizer == "adamw"
    assert routes["layers.0.moe.experts.w1"].lr_mult == 0.5
    assert routes["embed.weight"].optimizer == "muon"
    with pytest.raises(ConfigError, match="no rule matches"):
        route_parameters(model, MuonConfig(rules=[RouteRule(pattern="wq_a", optimizer="muon")]))
    with pytest.raises(ConfigError, match="zero_stage=3"):
        build_optimizer(model, MuonConfig(), zero_stage=3)
    assert build_optimizer(model, MuonConfig(), zero_stage=2, world_size=2).shard  # state sharded too
    assert isinstance(build_optimizer(model, AdamWConfig(), zero_stage=2), torch.optim.AdamW)


def _fake_grads(model: Transformer, step: int) -> None:
    """The same (already all-reduced) gradients on every rank, different every step."""
    g = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g) * 0.1


STEPS = 3  # optimiser steps per phase: momentum, Adam's moments and Sinkhorn's rows all carry over


def _full_grads(model: Transformer, full_shapes: dict[str, torch.Size], step: int) -> None:
    """Step `step`'s gradients as every rank holds them after the reduction: drawn for the full,
    unsharded model (the same on every layout), cut to this rank's expert rows; Engram tables get
    row-sparse gradients of a few rows, as the trainer's sparse lookups give them."""
    g = torch.Generator().manual_seed(100 + step)
    stacks = {f"{n}.{w}": m for n, m in model.named_modules() if hasattr(m, "expert_offset")
              for w in ("w1", "w2", "w3")}
    for name, p in model.named_parameters():
        full = torch.randn(full_shapes[name], generator=g, dtype=p.dtype) * 0.1
        if name.endswith(".table.weight"):
            rows = torch.randperm(full.shape[0], generator=g)[: full.shape[0] // 4].sort().values
            p.grad = torch.sparse_coo_tensor(rows[None], full[rows], full.shape, check_invariants=True)
        elif name in stacks:
            p.grad = full[stacks[name].expert_offset:][: p.shape[0]].clone()
        else:
            p.grad = full


def _run_steps(model: Transformer, opt, full_shapes, first: int, steps: int) -> None:
    for step in range(first, first + steps):
        _full_grads(model, full_shapes, step)
        opt.step()
        opt.zero_grad()


def _sharded_setup(rank: int, world: int, ep: int):
    """The tiny model on `world` ranks at expert-parallel degree `ep`, and its composite optimiser
    at zero_stage=1, placed as the trainer places it."""
    from trainer.parallelize import build_layout, optimizer_placement, parallelize

    torch.manual_seed(0)
    model = Transformer(TINY)
    full_shapes = {n: p.shape for n, p in model.named_parameters()}
    layout = build_layout(rank, world, ep, TINY.n_routed_experts)
    expert_params = parallelize(model, layout)
    replicas, offsets = optimizer_placement(model, layout, expert_params)
    opt = build_optimizer(model, MuonConfig(), zero_stage=1, rank=rank, world_size=world, replicas=replicas,
                          row_offsets=offsets)
    return model, full_shapes, layout, opt


def _sharded_worker(rank: int, world: int, ep: int, port: int, out_dir: str, load: str | None,
                    first: int, save: str) -> None:
    """Steps [first, first + STEPS) at this layout, from a fresh model or from the merged state
    saved under `load`; writes this rank's full parameters (every expert) and optimiser state."""
    from trainer.parallelize import full_experts

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model, full_shapes, layout, opt = _sharded_setup(rank, world, ep)
    if load is not None:
        _load(model, opt, layout, load)
    _run_steps(model, opt, full_shapes, first, STEPS)
    with full_experts(model, layout):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    owned = sum(o == rank for o in opt.owners.values())
    torch.save({"params": params, "state": opt.state_dict(), "owned": owned},
               os.path.join(out_dir, f"{save}_rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def _saved(out_dir, save: str) -> list[dict]:
    files = sorted(Path(out_dir).glob(f"{save}_rank*.pt"), key=lambda f: int(f.stem.rsplit("rank", 1)[1]))
    return [torch.load(f, weights_only=False) for f in files]


def _load(model: Transformer, opt, layout, save: str) -> None:
    """What the trainer's resume does: full weights into the model (experts gathered, then cut
    back to this rank's rows), and every saved rank's optimiser state merged."""
    from trainer.parallelize import full_experts

    shards = _saved(*os.path.split(save))
    with full_experts(model, layout), torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(shards[0]["params"][name])
    opt.load_state_dict(CompositeOptimizer.merge_state_dicts([s["state"] for s in shards]))


def _spawn(world: int, ep: int, port: int, out_dir, save: str, load: str | None = None, first: int = 0):
    mp.start_processes(_sharded_worker, args=(world, ep, port, str(out_dir), load, first, save), nprocs=world,
                       join=True, start_method="spawn")
    return _saved(out_dir, save)


def _member_optimizers(model: Transformer) -> list[torch.optim.Optimizer]:
    """The unsharded reference: one member optimiser per parameter (Muon with the parameter's head
    count, Sinkhorn or AdamW), so no parameter's update can depend on which others share its rank."""
    from optim.composite import _build

    return [_build(r.optimizer, [{"params": [r.param], "lr": MuonConfig().lr * r.lr_mult,
                                  "weight_decay": r.weight_decay,
                                  **({"heads": r.heads} if r.optimizer == "muon" else {})}], MuonConfig())
            for r in route_parameters(model, MuonConfig())]


def _reference(steps: int) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(TINY)
    full_shapes = {n: p.shape for n, p in model.named_parameters()}
    members = _member_optimizers(model)
    for step in range(steps):
        _full_grads(model, full_shapes, step)
        for opt in members:
            opt.step()
        model.zero_grad(set_to_none=True)
    return model


# Muon's Newton-Schulz stacks the blocks of the parameters one rank owns into one batched matmul
# chain, and a batch of one block rounds differently from a larger batch (CPU: MKL's single and
# batched gemm; GPU: cuBLAS picks kernels by batch count): which blocks share an owner changes the
# last bits of an update. A layout bug (wrong rows, heads, owner or broadcast) moves a parameter by a
# whole update, RMS ~0.2 lr = 2e-3 a step here; the rounding moves it by ~1e-9.
MUON_ATOL = 1e-7


def _assert_same(shards: list[dict], reference: Transformer) -> float:
    """Every rank's parameters against the reference: Sinkhorn's and AdamW's bitwise, Muon's within
    MUON_ATOL. Returns the largest Muon difference."""
    routes = {r.name: r.optimizer for r in route_parameters(reference, MuonConfig())}
    worst = 0.0
    for name, p in reference.named_parameters():
        for rank, shard in enumerate(shards):  # after the owners' broadcast every rank holds every result
            got = shard["params"][name].detach()
            if routes[name] == "muon":
                worst = max(worst, (got - p.detach()).abs().max().item())
                assert worst < MUON_ATOL, (rank, name, worst)
            else:
                assert torch.equal(got, p.detach()), (rank, name)
    return worst


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory, port_base):
    """(world, ep) -> the saved shards of STEPS steps at that layout from a fresh model, each layout
    run once per module (the resume tests continue from these runs' state)."""
    root, done = tmp_path_factory.mktemp("sharded"), {}

    def run(world: int, ep: int) -> tuple[list[dict], Path]:
        save = f"w{world}ep{ep}"
        if save not in done:
            done[save] = _spawn(world, ep, port_base(), root, save)
        return done[save], root / save

    return run


@pytest.mark.parametrize("world, ep", [(1, 1), (2, 1), (2, 2), (4, 2)])
def test_sharded_update_equals_the_unsharded_one(sharded_run, world, ep):
    """ZeRO-1 by whole parameter at 1, 2 and 4 ranks, with expert parallelism (EP=2 at 2 ranks:
    every rank alone with its experts; inside 4 ranks: expert stacks owned within their
    expert-data-parallel pair, dense parameters over all 4): after
    three steps every rank's parameters are those of one optimiser per parameter on one rank:
    bitwise for Sinkhorn and AdamW, Muon within MUON_ATOL (see there). Each update is a function of
    its own parameter's gradient and state only; the owner computes it and the broadcast copies
    bytes."""
    reference = _reference(STEPS)
    if world == 1:
        model, full_shapes, _, opt = _sharded_setup(0, 1, 1)
        _run_steps(model, opt, full_shapes, 0, STEPS)
        shards = [{"params": dict(model.named_parameters()), "state": opt.state_dict(),
                   "owned": len(opt.owners)}]
    else:
        shards, _ = sharded_run(world, ep)
    assert all(s["owned"] > 0 for s in shards)  # every rank did real work
    print(f"largest Muon difference at {world} ranks, EP={ep}: {_assert_same(shards, reference):.2e}")
    merged = CompositeOptimizer.merge_state_dicts([s["state"] for s in shards])["state"]
    assert sorted(merged) == sorted(r.name for r in route_parameters(reference, MuonConfig()))


@pytest.mark.slow
def test_resume_from_2_ranks_at_4_and_at_1(sharded_run, tmp_path, port_base):
    """Three steps at 2 ranks (EP=2), continued for three at 4 ranks (EP=2) and at 1 rank: every
    rank's parameters after step 6 against the uninterrupted unsharded run (which the test above
    makes the uninterrupted run at either size, to MUON_ATOL). The checkpoint is what the trainer
    writes: full weights and every rank's optimiser state, merged and re-cut to the new owners and
    expert rows; expert momentum then lives on other ranks than the ones that wrote it."""
    reference = _reference(2 * STEPS)
    _, saved = sharded_run(2, 2)
    _assert_same(_spawn(4, 2, port_base(), tmp_path, "at4", load=str(saved), first=STEPS), reference)
    model, full_shapes, layout, opt = _sharded_setup(0, 1, 1)
    _load(model, opt, layout, str(saved))
    _run_steps(model, opt, full_shapes, STEPS, STEPS)
    _assert_same([{"params": dict(model.named_parameters())}], reference)


def test_resume_from_4_ranks_at_2(sharded_run, tmp_path, port_base):
    """The reverse: three steps at 4 ranks (EP=2), three more at 2 ranks without EP (each rank
    now owns whole expert stacks, its state cut from two ranks' pieces)."""
    reference = _reference(2 * STEPS)
    _, saved = sharded_run(4, 2)
    _assert_same(_spawn(2, 1, port_base(), tmp_path, "at2", load=str(saved), first=STEPS), reference)


def _global_batch() -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (4, 64), generator=torch.Generator().manual_seed(7))


def _reduced_gradients(model: Transformer, batch: torch.Tensor, layout, expert_params,
                       owners: dict[int, int] | None = None) -> float:
    """The trainer's backward on this rank's share of the batch, then its own reduction and norm."""
    from trainer.parallelize import clip_grad_norm, reduce_gradients

    for m in model.modules():
        if type(m).__name__ == "EngramTable":
            m.sparse_grad = True  # as the trainer's composite optimiser sets them
    out = model(input_ids=batch, labels=batch)
    (out.lm_loss + out.balance_loss + out.indexer_loss).backward()
    reduce_gradients(model, layout, expert_params, owners)
    return clip_grad_norm(model, layout, expert_params, 0.0, sharded=bool(owners))


def _reduction_worker(rank: int, world: int, ep: int, port: int, out_dir: str) -> None:
    """The same backward reduced both ways: for zero_stage 0 (all-reduce) and 1 (to the owners)."""
    from trainer.parallelize import build_layout, optimizer_placement, parallelize

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = Transformer(TINY).double()
    layout = build_layout(rank, world, ep, TINY.n_routed_experts)
    expert_params = parallelize(model, layout)
    replicas, offsets = optimizer_placement(model, layout, expert_params)
    per = _global_batch().shape[0] // world
    for stage in (0, 1):
        opt = build_optimizer(model, MuonConfig(), zero_stage=stage, rank=rank, world_size=world,
                              replicas=replicas, row_offsets=offsets)
        norm = _reduced_gradients(model, _global_batch()[rank * per:(rank + 1) * per], layout, expert_params,
                                  opt.owner_ranks())
        grads = {name: (None if p.grad is None else p.grad.to_dense() if p.grad.is_sparse else p.grad,
                        offsets.get(id(p), 0)) for name, p in model.named_parameters()}
        torch.save({"grads": grads, "norm": norm}, os.path.join(out_dir, f"zero{stage}_grads{rank}.pt"))
        model.zero_grad(set_to_none=True)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def _uneven_gradients_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """Rank 1 alone reaches `only_one` and the table's rows; no rank reaches `neither`."""
    from trainer.parallelize import build_layout, reduce_gradients

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # mismatched buckets wait in a collective: the deadline turns that into this worker's failure
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"both": torch.nn.Linear(3, 2), "only_one": torch.nn.Linear(3, 2),
                                 "neither": torch.nn.Linear(3, 2),
                                 "table": torch.nn.Embedding(5, 2, sparse=True)}).double()
    layout = build_layout(rank, world, 1, TINY.n_routed_experts)
    out = {}
    for stage, owners in ((0, None), (1, {id(p): i % world for i, p in enumerate(model.parameters())})):
        x = torch.full((1, 3), float(rank + 1), dtype=torch.float64)
        loss = model["both"](x).sum()
        if rank == 1:
            loss = loss + model["only_one"](x).sum() + model["table"](torch.tensor([1, 3])).sum()
        loss.backward()
        reduce_gradients(model, layout, set(), owners)
        out[stage] = {n: None if p.grad is None else p.grad.to_dense() if p.grad.is_sparse else p.grad.clone()
                      for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
    torch.save(out, os.path.join(out_dir, f"uneven{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def test_ranks_that_differ_in_which_parameters_got_a_gradient_reduce_them_alike(tmp_path, port_base):
    """A parameter only some ranks have a gradient for (the vision tower when only some ranks' batches
    held images; an Engram table whose rows only one rank touched) is averaged with zeros for the
    ranks without one, at zero_stage 0 and 1 (to its owner), where the ranks' buckets used to differ
    in size and the collectives waited for each other forever; one no rank has a gradient for keeps
    none."""
    mp.start_processes(_uneven_gradients_worker, args=(2, port_base(), str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    got = [torch.load(tmp_path / f"uneven{r}.pt") for r in range(2)]
    f64 = dict(dtype=torch.float64)
    x = [torch.full((1, 3), r + 1.0, **f64) for r in range(2)]
    want = {"both.weight": (x[0] + x[1]).expand(2, 3) / 2, "both.bias": torch.ones(2, **f64),
            "only_one.weight": x[1].expand(2, 3) / 2, "only_one.bias": torch.full((2,), 0.5, **f64),
            "table.weight": torch.tensor([[0, 0], [0.5, 0.5], [0, 0], [0.5, 0.5], [0, 0]], **f64)}
    names = list(want) + ["neither.weight", "neither.bias"]
    owner = {n: i % 2 for i, n in enumerate(["both.weight", "both.bias", "only_one.weight", "only_one.bias",
                                              "neither.weight", "neither.bias", "table.weight"])}
    for rank in range(2):
        assert got[rank][0]["neither.weight"] is None and got[rank][1]["neither.bias"] is None
        for name in want:
            torch.testing.assert_close(got[rank][0][name], want[name], rtol=0, atol=1e-15, msg=name)
            if owner[name] == rank:
                torch.testing.assert_close(got[rank][1][name], want[name], rtol=0, atol=1e-15, msg=name)
            else:
                assert got[rank][1][name] is None, (rank, name)
    assert set(got[0][0]) == set(names)


@pytest.mark.slow
def test_reduced_gradients_at_4_ranks_with_ep2_are_the_whole_batch_gradients(tmp_path, port_base):
    """The hand reduction the composite optimiser relies on, at 4 ranks with EP=2 in float64: dense
    gradients reduced over the world, expert stacks over their expert-data-parallel pair (after
    the all-to-all's backward summed their EP pair's tokens), Engram tables' sparse rows gathered,
    and the global norm counting every expert once. zero_stage 0: every rank ends with every
    gradient; 1: each gradient lands on its optimiser owner alone (None elsewhere), each
    parameter's rows on exactly one rank. Either way they are the gradients of one process with
    the whole batch. Not bitwise: the ranks sum the batch in another order (float64 rounding)."""
    from trainer.parallelize import build_layout

    torch.manual_seed(0)
    model = Transformer(TINY).double()
    norm = _reduced_gradients(model, _global_batch(), build_layout(0, 1, 1, TINY.n_routed_experts), set())
    mp.start_processes(_reduction_worker, args=(4, 2, port_base(), str(tmp_path)), nprocs=4, join=True,
                       start_method="spawn")
    for stage in (0, 1):
        held: dict[str, int] = dict.fromkeys((n for n, _ in model.named_parameters()), 0)
        for rank in range(4):
            got = torch.load(tmp_path / f"zero{stage}_grads{rank}.pt", weights_only=False)
            assert got["norm"] == pytest.approx(norm, rel=1e-12)
            for name, p in model.named_parameters():
                grad, offset = got["grads"][name]
                if grad is None:
                    continue
                held[name] += grad.shape[0]
                want = (p.grad.to_dense() if p.grad.is_sparse else p.grad)[offset:offset + grad.shape[0]]
                torch.testing.assert_close(grad, want, rtol=1e-10, atol=1e-14, msg=(stage, name))
        for name, p in model.named_parameters():  # rows held: on every rank (stage 0), once in all (1)
            copies = 1 if stage == 1 else 2 if ".experts." in name else 4  # an EP=2 shard is on 2 ranks
            assert held[name] == p.shape[0] * copies, (stage, name)


def test_scheduler_drives_every_member_group():
    model = Transformer(TINY)
    opt = build_optimizer(model, MuonConfig(), zero_stage=0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    _fake_grads(model, 0)
    opt.step()
    sched.step()
    lrs = {g["lr"] for o in opt.optimizers.values() for g in o.param_groups}
    assert lrs == {MuonConfig().lr * 0.5}


def test_schedules():
    from optim.schedule import lr_multiplier

    cos = lr_multiplier(MuonConfig(schedule="cosine", warmup_steps=10, min_lr_ratio=0.1), max_steps=110)
    assert cos(0) == pytest.approx(0.1) and cos(9) == pytest.approx(1.0)
    assert cos(60) == pytest.approx(0.1 + 0.9 * 0.5)  # half-way through the decay
    assert cos(110) == pytest.approx(0.1) and cos(500) == pytest.approx(0.1)
    wsd = lr_multiplier(MuonConfig(schedule="wsd", warmup_steps=10, min_lr_ratio=0.0, decay_fraction=0.2),
                        max_steps=100)
    assert [wsd(s) for s in (10, 50, 79)] == [1.0, 1.0, 1.0]  # stable until 80% of the run
    assert wsd(90) == pytest.approx(0.5) and wsd(100) == pytest.approx(0.0)
    with pytest.raises(ConfigError):
        lr_multiplier(MuonConfig(schedule="exp"), 10)
    with pytest.raises(ConfigError, match="optim.warmup_steps=-5: must be >= 0"):  # was read as 0
        lr_multiplier(MuonConfig(warmup_steps=-5), 10)
    assert lr_multiplier(MuonConfig(schedule="constant", warmup_steps=0), 10)(0) == 1.0
