"""Optimiser routing, the composite optimiser and its whole-parameter ZeRO-1 sharding."""
import dataclasses
import os

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
    with pytest.raises(ConfigError, match="zero_stage=2"):
        build_optimizer(model, MuonConfig(), zero_stage=2)
    assert isinstance(build_optimizer(model, AdamWConfig(), zero_stage=2), torch.optim.AdamW)


def _fake_grads(model: Transformer, step: int) -> None:
    """The same (already all-reduced) gradients on every rank, different every step."""
    g = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g) * 0.1


def _train(model: Transformer, opt: torch.optim.Optimizer, steps: int) -> None:
    for step in range(steps):
        _fake_grads(model, step)
        opt.step()
        opt.zero_grad()


def _sharded_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = Transformer(TINY)
    opt = build_optimizer(model, MuonConfig(), zero_stage=1, rank=rank, world_size=world)
    _train(model, opt, steps=3)
    torch.save({"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                "state": opt.state_dict(), "owned": sum(1 for o in opt.owners.values() if o == rank)},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def test_two_rank_sharded_update_equals_single_rank(tmp_path, port_base):
    torch.manual_seed(0)
    model = Transformer(TINY)
    single = build_optimizer(model, MuonConfig(), zero_stage=0)
    _train(model, single, steps=3)

    mp.start_processes(_sharded_worker, args=(2, port_base(), str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    shards = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert all(s["owned"] > 0 for s in shards)  # both ranks did real work
    for name, p in model.named_parameters():
        for shard in shards:  # after the broadcast every rank holds every owner's result
            torch.testing.assert_close(shard["params"][name], p.detach(), rtol=0, atol=1e-5, msg=name)
    # the two shards' state, merged, is the single-rank state: resumable at another world size
    merged = CompositeOptimizer.merge_state_dicts([s["state"] for s in shards])["state"]
    ref = single.state_dict()["state"]
    assert merged.keys() == ref.keys()
    for name in ref:
        (piece,) = merged[name]
        for key, value in ref[name][0]["state"].items():
            torch.testing.assert_close(piece["state"][key], value, rtol=0, atol=1e-5)
    restored = build_optimizer(Transformer(TINY), MuonConfig(), zero_stage=0)
    restored.load_state_dict(CompositeOptimizer.merge_state_dicts([s["state"] for s in shards]))
    assert sum(len(o.state) for o in restored.optimizers.values()) == len(ref)


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
