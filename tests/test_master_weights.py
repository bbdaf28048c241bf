"""trainer.param_dtype=bf16 (optim/composite.py master weights, trainer/master_weights.py): replicated
weights in bf16 on every rank, the fp32 master on the owner alone, stepped with the fp32 reduced
gradient; the owners' bf16 broadcast; the masters in the optimiser state and through checkpoints."""
import copy
import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conf.model import TinyModelConfig
from conf.optim import MuonConfig
from model.transformer import Transformer
from optim import CompositeOptimizer, route_parameters
from tests.conftest import FAST

TINY = dataclasses.replace(TinyModelConfig(vocab_size=97), engram_min_rows=50)
STEPS = 3
WORLD = 2
BF16_ULP = 2.0**-8  # relative spacing of bf16 values


def _batch(step: int, rank: int, world: int) -> torch.Tensor:
    """This rank's share (one sequence a rank) of step `step`'s batch."""
    data = torch.randint(0, TINY.vocab_size, (world, 64), generator=torch.Generator().manual_seed(100 + step))
    return data[rank:rank + 1]


def _backward(model: Transformer, batch: torch.Tensor) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the trainer's bf16 compute
        out = model(input_ids=batch, labels=batch)
    (out.lm_loss + out.balance_loss + out.indexer_loss).backward()


def _bf16_run(rank: int, world: int, zero_stage: int,
              bf16: bool = True) -> tuple[Transformer, CompositeOptimizer]:
    """STEPS steps of the trainer's path with bf16 weights: the composite optimiser with masters, the
    gradients reduced to the owners (ZeRO-2 during the backward, ZeRO-1 after it from fp32 buffers).
    bf16=False: the same with fp32 weights."""
    from trainer.backward_reduce import BackwardReducer
    from trainer.master_weights import Fp32Grads, fp32_parameters
    from trainer.parallelize import build_layout, reduce_gradients

    torch.manual_seed(0)
    model = Transformer(TINY)
    layout = build_layout(rank, world, 1, TINY.n_routed_experts)
    opt = CompositeOptimizer(route_parameters(model, MuonConfig()), MuonConfig(), rank, world, shard=True,
                             master_weights=bf16, keep_fp32=fp32_parameters(model), master_min_replicas=1)
    opt.store_params_low_precision()
    masters, owners = opt.master_of(), opt.owner_ranks()
    reducer = (BackwardReducer(model, layout, set(), owners, torch.float32, masters=masters)
               if zero_stage == 2 else None)
    fp32 = Fp32Grads(opt.low_precision_params()) if zero_stage == 1 and bf16 else None
    for step in range(STEPS):
        _backward(model, _batch(step, rank, world))
        if reducer is not None:
            reducer.finish_micro_batch()
        # as the trainer: at ZeRO-2 only sparse table gradients (none here) are left to reduce
        reduce_gradients(model, layout, set(), owners, fp32_grads=fp32.take() if fp32 else None,
                         masters=masters)
        if reducer is not None:
            reducer.finish_step()
        opt.step()
        opt.zero_grad()
    return model, opt


def _reference(world: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The update computed independently on one process: fp32 masters (a plain fp32 model) stepped by
    the composite optimiser without master weights, on the mean of each rank's gradient, taken from a
    copy of the model whose weights are the masters rounded to bf16 after every step (where the
    ranks keep bf16). Returns (masters, the weights every rank must hold)."""
    from trainer.master_weights import fp32_parameters

    torch.manual_seed(0)
    masters = Transformer(TINY)
    work = copy.deepcopy(masters)
    keep = {n for n, p in work.named_parameters() if id(p) in fp32_parameters(work)}
    low = [(p, q) for (n, p), q in zip(work.named_parameters(), masters.parameters()) if n not in keep]
    opt = CompositeOptimizer(route_parameters(masters, MuonConfig()), MuonConfig())
    with torch.no_grad():
        for p, _ in low:
            p.data = p.data.bfloat16()
    for step in range(STEPS):
        total = [torch.zeros_like(q) for q in masters.parameters()]
        for rank in range(world):
            work.zero_grad(set_to_none=True)
            _backward(work, _batch(step, rank, world))
            for t, p in zip(total, work.parameters()):
                t += p.grad.float()
        for q, t in zip(masters.parameters(), total):
            q.grad = t / world
        opt.step()
        with torch.no_grad():
            for p, q in zip(work.parameters(), masters.parameters()):
                p.copy_(q)  # rounded to nearest where p is bf16
    return dict(masters.named_parameters()), dict(work.named_parameters())


def test_one_rank_steps_the_masters_exactly_like_fp32_weights_rounded_to_bf16():
    """At one rank (every parameter given a master: master_min_replicas=1) the owner's sub-optimisers
    see the same groups as the reference's, so the masters and the bf16 weights are bitwise the
    reference's, at ZeRO-1 and ZeRO-2."""
    torch.set_num_threads(1)
    want_masters, want_weights = _reference(1)
    for zero_stage in (1, 2):
        model, opt = _bf16_run(0, 1, zero_stage)
        low = set(opt.low_precision)
        assert low and len(low) < len(want_weights)
        for name, p in model.named_parameters():
            assert p.dtype == want_weights[name].dtype, name
            assert torch.equal(p.detach(), want_weights[name].detach()), (zero_stage, name)
            if name in low:
                assert torch.equal(opt.masters[name], want_masters[name].detach()), (zero_stage, name)


def test_the_model_keeps_fp32_what_it_computes_in_fp32():
    """Of the matrices, fp32 stay: the token embedding (its backward sums repeated tokens in the
    weight's dtype), the Engram tables and norm weights, the pooling compressors' projections (the
    public model's fp32 pooled path), mHC's fn (an fp32 linear) and the router's gate (fp32 logits);
    every vector too. The rest, the LM head included, go bf16."""
    import re

    from trainer.master_weights import fp32_parameters

    model = Transformer(TINY)
    keep = fp32_parameters(model)
    generic = {re.sub(r"\.\d+\.", ".N.", n) for n, p in model.named_parameters()
               if id(p) in keep and p.dim() > 1}
    assert generic == {"embed.weight", "engrams.N.hidden_norm_weight", "engrams.N.key_norm_weight",
                       "engrams.N.table.weight",
                       "layers.N.attn.compressor.wgate.weight", "layers.N.attn.compressor.wkv.weight",
                       "layers.N.attn_hc.fn", "layers.N.ffn_hc.fn", "layers.N.moe.router.weight"}
    assert all(id(p) in keep for p in model.parameters() if p.dim() < 2)
    for layer in model.layers:  # a compressor that does not pool is a plain autocast projection
        wkv = layer.attn.compressor.wkv.weight if getattr(layer.attn, "compressor", None) else None
        if wkv is not None:
            assert (id(wkv) in keep) == (layer.attn.compressor.ratio > 1)
    assert id(model.head.weight) not in keep  # the largest matrix, an autocast matmul


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for zero_stage in (1, 2):
        model, opt = _bf16_run(rank, world, zero_stage)
        fp32_model, _ = _bf16_run(rank, world, zero_stage, bf16=False)
        torch.save({"params": {n: p.detach() for n, p in model.named_parameters()},
                    "masters": dict(opt.masters), "owners": dict(opt.owners),
                    "low": sorted(opt.low_precision), "state": opt.state_dict(),
                    "fp32_params": {n: p.detach() for n, p in fp32_model.named_parameters()}},
                   os.path.join(out_dir, f"z{zero_stage}_rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


@pytest.mark.slow
def test_two_ranks_hold_bf16_replicas_and_each_master_once(tmp_path, port_base):
    """2 ranks, ZeRO-1 and ZeRO-2, three steps: every rank holds the same bf16 weights (the owners'
    rounded masters, broadcast), only owners hold masters (each parameter's once: 4 bytes a bf16
    weight over the world), and masters and weights are the reference's: the fp32 masters stepped
    by the same sub-optimisers on the same gradients, weights = masters rounded. Muon stacks an
    owner's blocks into one batched Newton-Schulz, so which blocks share a rank moves the last fp32
    bits (tests/test_optim.py MUON_ATOL): masters within 1e-6 (an update is ~1e-3), weights within
    one bf16 ulp of the reference's. Against the same layout's fp32-weight run (same owners, same
    groups) it is bitwise: the masters are its weights, since every gradient is the same (the
    parameters whose gradient bf16 storage would change stay fp32, trainer/master_weights.py)."""
    torch.set_num_threads(1)
    mp.start_processes(_worker, args=(WORLD, port_base(), str(tmp_path)), nprocs=WORLD, join=True,
                       start_method="spawn")
    want_masters, want_weights = _reference(WORLD)
    for zero_stage in (1, 2):
        ranks = [torch.load(tmp_path / f"z{zero_stage}_rank{r}.pt", weights_only=False) for r in range(WORLD)]
        low = set(ranks[0]["low"])
        assert low and ranks[1]["low"] == ranks[0]["low"]
        for name, p in ranks[0]["params"].items():
            assert p.dtype == (torch.bfloat16 if name in low else torch.float32), name
            fp32_run = ranks[0]["fp32_params"][name]
            assert torch.equal(p, fp32_run.to(p.dtype)), (zero_stage, name)
            assert torch.equal(p, ranks[1]["params"][name]), (zero_stage, name)  # replicas identical
            want = want_weights[name].detach()
            assert p.dtype == want.dtype
            diff = (p.float() - want.float()).abs()
            close = (diff <= BF16_ULP * want.float().abs()).all() if name in low else diff.max() < 1e-6
            assert close, (zero_stage, name, diff.max().item())
        held = {r: set(ranks[r]["masters"]) for r in range(WORLD)}
        assert held[0] and held[1] and not held[0] & held[1] and held[0] | held[1] == low
        for r in range(WORLD):
            assert all(ranks[r]["owners"][name] == r for name in held[r])
            for name, master in ranks[r]["masters"].items():
                assert master.dtype == torch.float32
                # the weights are the rounded masters
                assert torch.equal(master.bfloat16(), ranks[r]["params"][name])
                assert (master - want_masters[name].detach()).abs().max() < 1e-6, (zero_stage, name)
                assert torch.equal(master, ranks[r]["fp32_params"][name]), (zero_stage, name)
        master_bytes = sum(m.numel() * m.element_size() for r in range(WORLD)
                           for m in ranks[r]["masters"].values())
        assert master_bytes == 4 * sum(ranks[0]["params"][n].numel() for n in low)
        saved = CompositeOptimizer.saved_masters(CompositeOptimizer.merge_state_dicts(
            [ranks[r]["state"] for r in range(WORLD)]))
        assert set(saved) == low
        assert all(torch.equal(saved[n], ranks[n in held[1]]["masters"][n]) for n in low)


def test_checkpoints_convert_between_fp32_and_bf16_weights():
    """An fp32-weight state resumes with masters (master = the fp32 weight, momentum kept), and a
    master-weight state resumes at fp32 (weights = the masters, not their bf16 roundings)."""
    from trainer.master_weights import fp32_parameters

    torch.set_num_threads(1)
    torch.manual_seed(0)
    plain = Transformer(TINY)
    opt = CompositeOptimizer(route_parameters(plain, MuonConfig()), MuonConfig())
    _backward(plain, _batch(0, 0, 1))
    opt.step()
    fp32_state = opt.state_dict()
    assert not CompositeOptimizer.saved_masters(fp32_state)

    torch.manual_seed(1)  # other initial weights: everything must come from the checkpoint
    model = Transformer(TINY)
    with torch.no_grad():
        for p, q in zip(model.parameters(), plain.parameters()):
            p.copy_(q)  # what loading the fp32 model states does
    masters = CompositeOptimizer(route_parameters(model, MuonConfig()), MuonConfig(), master_weights=True,
                                 keep_fp32=fp32_parameters(model), master_min_replicas=1)
    masters.load_state_dict(fp32_state)
    masters.store_params_low_precision()
    by_name = dict(plain.named_parameters())
    assert masters.masters
    for name, m in masters.masters.items():
        assert torch.equal(m, by_name[name].detach()), name
        state = next(o.state[m] for o in masters.optimizers.values() if m in o.state)
        saved = fp32_state["state"][name][0]["state"]
        assert saved and all(torch.equal(state[k], v) if torch.is_tensor(v) else state[k] == v
                             for k, v in saved.items()), name
    for name, p in model.named_parameters():
        want = by_name[name].detach()
        assert torch.equal(p.detach(), want.bfloat16() if name in masters.masters else want), name
    with pytest.raises(RuntimeError, match="after store_params_low_precision"):
        masters.load_state_dict(fp32_state)

    _backward(model, _batch(1, 0, 1))  # a step with masters, then back to fp32 weights
    for name, m in masters.masters.items():
        p = dict(model.named_parameters())[name]
        m.grad, p.grad = p.grad.float(), None
    masters.step()
    bf16_state = masters.state_dict()
    torch.manual_seed(2)
    back = Transformer(TINY)
    with torch.no_grad():
        for p, q in zip(back.parameters(), model.parameters()):
            p.copy_(q)  # what loading the bf16 model states into fp32 weights does
    fp32_again = CompositeOptimizer(route_parameters(back, MuonConfig()), MuonConfig())
    fp32_again.load_state_dict(bf16_state)
    for name, p in back.named_parameters():
        want = masters.masters.get(name, dict(model.named_parameters())[name].detach())
        assert p.dtype == torch.float32 and torch.equal(p.detach(), want.float()), name


def test_param_dtype_config_errors():
    from conf.errors import ConfigError
    from trainer.master_weights import check_param_dtype, check_param_dtype_optimizer

    check_param_dtype("bf16", "bf16", 1)
    check_param_dtype("bf16", "bf16", 2)
    check_param_dtype("fp32", "fp32", 0)
    with pytest.raises(ConfigError, match=r"^trainer.param_dtype='fp16': expected fp32 or bf16$"):
        check_param_dtype("fp16", "bf16", 1)
    with pytest.raises(ConfigError, match=r"^trainer.param_dtype=bf16 needs trainer.precision=bf16"):
        check_param_dtype("bf16", "fp32", 1)
    with pytest.raises(ConfigError, match=r"^trainer.param_dtype=bf16 needs trainer.zero_stage=1 or 2"):
        check_param_dtype("bf16", "bf16", 0)
    check_param_dtype_optimizer("bf16", True)
    check_param_dtype_optimizer("fp32", False)
    with pytest.raises(ConfigError, match=r"^trainer.param_dtype=bf16 needs the composite optimiser"):
        check_param_dtype_optimizer("bf16", False)


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _rows(run) if "loss" in r}


@pytest.mark.slow
@pytest.mark.extended
def test_bf16_weights_resume_bitwise_and_convert_through_the_trainer(flashtrain, tmp_path):
    """2 ranks, bf16 compute and weights, ZeRO-2: resuming the step-2 checkpoint gives steps 3 and 4
    bitwise (losses, bf16 model states, masters); the same checkpoint resumed with fp32 weights
    computes step 3's forward from the masters, which autocast rounds to the same bf16 weights: the
    same loss, bitwise. Three 2-process runs, about a minute on 2 cores: in the extended tier, as the
    default suite is at its time budget (the optimiser-level tests above cover the same state)."""
    common = [*FAST, "trainer.max_steps=4", "trainer.save_every=2", "trainer.precision=bf16",
              "trainer.micro_batch_size=2", "launcher.nproc=2", "trainer.zero_stage=2",
              "trainer.torch_threads=1"]
    straight = tmp_path / "straight"
    p = flashtrain("pretrain", *common, "trainer.param_dtype=bf16", f"hydra.run.dir={straight}")
    assert p.returncode == 0, p.stderr[-3000:]
    step2 = straight / "checkpoints" / "step_00000002"
    resumed = tmp_path / "resumed"
    p = flashtrain("pretrain", *common, "trainer.param_dtype=bf16", f"trainer.resume={step2}",
                   f"hydra.run.dir={resumed}")
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = _losses(straight), _losses(resumed)
    assert sorted(b) == [3, 4] and all(a[s] == b[s] for s in b), (a, b)
    from trainer.checkpoint import model_state

    end_a, end_b = (model_state(run / "checkpoints" / "step_00000004") for run in (straight, resumed))
    raw = torch.load(next((straight / "checkpoints" / "step_00000004").glob("mp_rank_*")),
                     weights_only=False)["module"]
    assert any(t.dtype == torch.bfloat16 for t in raw.values())  # the model states hold bf16 weights
    for name, t in end_a.items():
        assert t.dtype == (torch.float32 if raw[name].dtype == torch.bfloat16 else raw[name].dtype), name
        assert torch.equal(t, end_b[name]), name
    fp32 = tmp_path / "fp32"
    p = flashtrain("pretrain", *common, "trainer.max_steps=3", "trainer.param_dtype=fp32",
                   f"trainer.resume={step2}", f"hydra.run.dir={fp32}")
    assert p.returncode == 0, p.stderr[-3000:]
    assert _losses(fp32)[3] == a[3]


def test_model_state_of_a_bf16_weight_checkpoint_is_its_masters(tmp_path):
    """`checkpoint.model_state` (what convert export, eval, generate and model.init_from read): the
    fp32 masters from the owners' optimiser states in place of the bf16 model states, an expert
    stack's rows put together from its shards' masters; other weights as stored."""
    from optim.composite import STATE_FORMAT
    from trainer.checkpoint import model_state

    master_w = torch.randn(4, 3)
    stack = torch.randn(6, 2)
    kept = torch.randn(5)
    module = {"w": master_w.bfloat16(), "experts": stack.bfloat16(), "norm": kept}
    torch.save({"module": module}, tmp_path / "mp_rank_00_model_states.pt")
    shards = [{"w": [{"offset": None, "state": {"master": master_w, "momentum_buffer": torch.ones(4, 3)}}],
               "experts": [{"offset": 0, "state": {"master": stack[:3]}}]},
              {"experts": [{"offset": 3, "state": {"master": stack[3:]}}],
               "norm": [{"offset": None, "state": {"exp_avg": torch.zeros(5)}}]}]
    for rank, state in enumerate(shards):
        torch.save({"rng": {}, "optimizer": {"format": STATE_FORMAT, "state": state}},
                   tmp_path / f"rank_{rank:05d}_state.pt")
    got = model_state(tmp_path)
    assert got["w"].dtype == got["experts"].dtype == torch.float32
    assert torch.equal(got["w"], master_w) and torch.equal(got["experts"], stack)
    assert torch.equal(got["norm"], kept)
