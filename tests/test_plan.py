"""The planner's per-rank state memory (trainer/plan.py) against the tensors a real optimizer step
leaves behind: weights, gradients (Engram tables' sparse rows included) and optimizer state."""
import dataclasses
import json

import pytest
import torch

from conf.errors import ConfigError
from conf.model import FlashModelConfig, SmallModelConfig, TinyModelConfig
from conf.optim import MuonConfig
from model.transformer import Transformer
from optim import CompositeOptimizer, build_optimizer, route_parameters
from tests.conftest import cli_env, run_cli
from trainer.plan import Layout, ModelFacts, check_layout_fits, state_bytes


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _state(opt: CompositeOptimizer) -> int:
    return _bytes(t for inner in opt.optimizers.values() for s in inner.state.values() for t in s.values()
                  if torch.is_tensor(t) and t.dim() > 0)


def _backward(model, micro_batch: int, seq_len: int) -> None:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.cfg.vocab_size, (micro_batch, seq_len + 1), generator=g)
    model(ids[:, :-1], labels=ids[:, 1:]).loss.backward()


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = Transformer(TinyModelConfig(vocab_size=97))
    with torch.device("meta"):
        meta = Transformer(TinyModelConfig(vocab_size=97))
    return model, meta


def test_one_rank_holds_what_the_planner_says(tiny):
    model, meta = tiny
    opt = build_optimizer(model, MuonConfig(), zero_stage=0)
    assert opt.enable_sparse_table_grads(model) > 0
    model.zero_grad(set_to_none=True)
    _backward(model, micro_batch=2, seq_len=64)
    sparse = [p.grad for p in model.parameters() if p.grad is not None and p.grad.is_sparse]
    assert sparse  # the Engram tables' row gradients, as the trainer takes them (not yet coalesced)
    grads = _bytes(p.grad for p in model.parameters() if p.grad is not None and not p.grad.is_sparse)
    grads += _bytes(t for g in sparse for t in (g._values(), g._indices()))
    opt.step()
    layout = Layout(world=1, zero_stage=0, micro_batch=2, seq_len=64)
    want = state_bytes(ModelFacts.of(meta, MuonConfig()), layout)
    assert want == {"parameters": _bytes(model.parameters()), "gradients": grads, "optimizer": _state(opt)}
    model.zero_grad(set_to_none=True)


def test_sharded_state_is_the_fullest_ranks(tiny):
    """trainer.zero_stage=1 over 4 ranks: each rank keeps the state of the parameters it owns;
    the planner gives the largest rank's."""
    model, meta = tiny
    world = 4
    routes = route_parameters(model, MuonConfig())
    per_rank = []
    for rank in range(world):
        model.zero_grad(set_to_none=True)
        _backward(model, micro_batch=1, seq_len=32)
        opt = CompositeOptimizer(routes, MuonConfig(), rank, world, shard=True)
        for inner in opt.optimizers.values():  # the owner's update, without the broadcast
            inner.step()
        per_rank.append(_state(opt))
    model.zero_grad(set_to_none=True)
    layout = Layout(world=world, zero_stage=1, seq_len=32)
    want = state_bytes(ModelFacts.of(meta, MuonConfig()), layout)["optimizer"]
    assert want == max(per_rank) and sum(per_rank) > want  # the state really is spread


def _plan(cli_zygote, port_base, *args):
    return run_cli(cli_zygote, ["plan", *args], cli_env(port_base()), timeout=300)


def test_plan_lists_the_layouts_of_a_gpu_and_what_a_rank_holds(cli_zygote, port_base):
    p = _plan(cli_zygote, port_base, "model=small", "cluster.gpus_per_node=2", "cluster.gpu=h100",
              "plan.micro_batches=[1,8]", "plan.json=true", "plan.engram_tables=[gpu]")
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    n_layers = SmallModelConfig().n_layers
    # a layout that fits only with some blocks checkpointed gets a third row: the fewest that fit
    partial = [r for r in out["rows"] if 0 < r["checkpointed_layers"] < n_layers]
    rows = [r for r in out["rows"] if r["checkpointed_layers"] in (0, n_layers)]
    # EP 1 and 2 (both divide 32 experts and 2 ranks) x ZeRO 0/1/2 (2 with fp32 or bf16 gradients; 1 and 2
    # with fp32 or bf16 weights: 1 + 2 + 2 * 2 = 7) x micro-batch 1/8 x checkpointing
    assert out["world"] == 2 and len(rows) == 2 * 7 * 2 * 2 and out["layouts"] == len(out["rows"])
    assert all(r["activation_checkpointing"] == (r["checkpointed_layers"] > 0) for r in out["rows"])
    assert partial and all(r["fits"] for r in partial)
    dtypes = ("fp32", "bf16")
    assert {(r["ep"], r["zero_stage"], r["grad_accum_dtype"], r["param_dtype"]) for r in rows} == {
        (ep, z, g, w) for ep in (1, 2) for z, g, w in ((0, "fp32", "fp32"), *((1, "fp32", w) for w in dtypes),
                                                        *((2, g, w) for g in dtypes for w in dtypes))}
    fits = [r["fits"] for r in out["rows"]]
    assert fits == sorted(fits, reverse=True) and 0 < sum(fits) < len(fits)  # the fitting ones first
    for r in out["rows"]:
        parts = (r["parameters_gib"] + r["gradients_gib"] + r["optimizer_gib"] + r.get("activations_gib", 0)
                 + r.get("optimizer_workspace_gib", 0))
        assert abs(parts - r["total_gib"]) < 1e-6 and r["fits"] == (r["total_gib"] <= out["capacity_gib"])
        need = f"needs {r['total_gib']:,.1f} GiB of {out['capacity_gib']:,.1f}"
        assert r["fits"] or r["why"].startswith(need)
    by = {(r["ep"], r["zero_stage"], r["micro_batch"], r["activation_checkpointing"]): r for r in rows
          if r["grad_accum_dtype"] == r["param_dtype"] == "fp32"}
    bf16 = {r["ep"]: r for r in rows if r["grad_accum_dtype"] == "bf16" and r["micro_batch"] == 1
            and not r["activation_checkpointing"] and r["param_dtype"] == "fp32"}
    weights16 = {r["ep"]: r for r in rows if r["zero_stage"] == 1 and r["param_dtype"] == "bf16"
                 and r["micro_batch"] == 1 and not r["activation_checkpointing"]}
    # expert parallelism halves the routed experts a rank holds; ZeRO-1 spreads the optimizer state,
    # ZeRO-2 the gradients too (about half of them at 2 ranks), bf16 gradients are half of those
    assert by[2, 0, 1, False]["parameters_gib"] < by[1, 0, 1, False]["parameters_gib"]
    assert by[1, 1, 1, False]["optimizer_gib"] < by[1, 0, 1, False]["optimizer_gib"]
    assert by[1, 2, 1, False]["optimizer_gib"] == by[1, 1, 1, False]["optimizer_gib"]
    assert 0.4 < by[1, 2, 1, False]["gradients_gib"] / by[1, 1, 1, False]["gradients_gib"] < 0.6
    assert 0.45 < bf16[1]["gradients_gib"] / by[1, 2, 1, False]["gradients_gib"] < 0.55
    # bf16 weights: every parameter is on both ranks, so all but the fp32 ones halve from 4 to 2 bytes:
    # the Engram tables and the token embedding (a share e of the weights) and small ones (norms, mHC,
    # router: under 2%), a ratio of (2 (1 - e) + 4 e) / 4 = 0.5 + e / 2 plus at most 0.01; each master
    # (4 bytes) lives on one of the 2 owners, so the fullest rank's optimizer state grows by about
    # 4 / 2 = 2 bytes a weight, what the weights lost (the owners' shares are balanced by size, not
    # exactly equal: within 15%)
    with torch.device("meta"):
        small = Transformer(dataclasses.replace(SmallModelConfig(), vocab_size=129_280))
    tables = small.embed.weight.numel() + sum(m.weight.numel() for m in small.modules()
                                              if type(m).__name__ == "EngramTable")
    e = tables / sum(p.numel() for p in small.parameters())
    fp32_w, bf16_w = by[1, 1, 1, False], weights16[1]
    assert 0.5 + e / 2 < bf16_w["parameters_gib"] / fp32_w["parameters_gib"] < 0.5 + e / 2 + 0.01
    saved = fp32_w["parameters_gib"] - bf16_w["parameters_gib"]
    assert 0.85 < (bf16_w["optimizer_gib"] - fp32_w["optimizer_gib"]) / saved < 1.15
    # micro-batch 8 without checkpointing does not fit an 80 GB card; checkpointing makes it fit
    assert not by[1, 0, 8, False]["fits"] and by[1, 0, 8, True]["fits"]


def test_flash_plan_names_what_does_not_fit(cli_zygote, port_base):
    p = _plan(cli_zygote, port_base, "model=flash", "cluster.nodes=8", "plan.top=3",
              "plan.engram_tables=[gpu]")
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.strip().splitlines()
    head = next(line for line in lines if line.startswith("flashtrain plan:"))
    assert "8 x 8 H200 (64 ranks" in head and "layouts fit" in head
    rows = [line for line in lines if line.rstrip().endswith(("fits", "on every rank)")) or "needs" in line]
    # Engram tables of 196B fp32 weights, whole on every rank, fit no layout today
    assert len(rows) == 3 and all("needs" in row and "Engram tables" in row for row in rows)


def test_flash_fits_16_nodes_only_with_host_tables(cli_zygote, port_base):
    # 732 GiB of tables on every rank fit no card; in host memory, a rank keeps its 1/128 of the rows
    p = _plan(cli_zygote, port_base, "model=flash", "cluster.nodes=16", "plan.top=1")
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.strip().splitlines()
    head = next(line for line in lines if line.startswith("flashtrain plan:"))
    assert " 0 of " not in head, head
    best = next(line for line in lines if line.rstrip().endswith("in host memory)") or "needs" in line)
    assert " host " in best and "fits" in best, best


def test_flash_fits_8_nodes_only_with_zero2_and_bf16_gradients(cli_zygote, port_base):
    # at EP=64 each rank holds 8B dense weights whole; only ZeRO-2's owner-only bf16 gradients leave room
    p = _plan(cli_zygote, port_base, "model=flash", "cluster.nodes=8", "plan.json=true")
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    n_layers = FlashModelConfig().n_layers
    fits = [r for r in out["rows"] if r["fits"]]
    assert fits and all((r["zero_stage"], r["grad_accum_dtype"], r["engram_tables"]) == (2, "bf16", "host")
                        for r in fits)
    # the room bf16 weights leave lets some blocks keep their activations: fewer recomputed, a faster step
    partial = [r for r in fits if r["checkpointed_layers"] < n_layers]
    assert len(partial) == 1 and partial[0]["param_dtype"] == "bf16" and partial[0]["checkpointed_layers"] > 0
    fits = [r for r in fits if r["checkpointed_layers"] == n_layers]
    whole = next(r for r in fits
                 if r["param_dtype"] == "bf16" and r["micro_batch"] == partial[0]["micro_batch"])
    assert whole["total_gib"] < partial[0]["total_gib"] <= out["capacity_gib"]
    assert partial[0]["step_s"] < whole["step_s"]
    # with fp32 weights it fits with almost no room; bf16 weights (trainer.param_dtype=bf16) halve the
    # replicated dense weights: at EP=64 an expert shard has world / EP = 1 replica and stays fp32, so
    # the weights shrink by half the dense fp32 bytes, and the masters (dense / 64 ranks, but whole
    # parameters: the fullest owner holds a vocabulary-sized one) cost a few GiB of optimizer state
    by = {r["param_dtype"]: r for r in fits}
    assert set(by) == {"fp32", "bf16"}
    assert by["fp32"]["total_gib"] > out["capacity_gib"] - 1
    assert by["bf16"]["total_gib"] < out["capacity_gib"] - 10
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(FlashModelConfig(), vocab_size=129_280))
    # the dense matrices but the token embedding (kept fp32, as are small ones: mHC, router, compressors)
    routed = {id(p) for m in model.modules() if type(m).__name__ in ("RoutedExperts", "EngramTable")
              for p in m.parameters()} | {id(model.embed.weight)}
    dense_gib = sum(p.numel() for p in model.parameters() if id(p) not in routed and p.dim() >= 2) * 4 / 2**30
    shrink = by["fp32"]["parameters_gib"] - by["bf16"]["parameters_gib"]
    assert 0.95 * dense_gib / 2 < shrink <= dense_gib / 2, (shrink, dense_gib)


def test_plan_refuses_an_unknown_gpu_in_one_line(cli_zygote, port_base):
    p = _plan(cli_zygote, port_base, "model=small", "cluster.gpu=a100")
    assert p.returncode == 2 and "cluster.gpu='a100': expected one of ['h100', 'h200']" in p.stderr, p.stderr


def test_a_layout_that_cannot_fit_is_refused_before_anything_is_built(tiny):
    _, meta = tiny
    layout = Layout(world=1, micro_batch=2, seq_len=64)
    fits = check_layout_fits(meta, MuonConfig(), layout, 0, 2**30, "test GPU")  # 1 GiB: room to spare
    assert fits.total < 2**30
    with pytest.raises(ConfigError) as e:
        check_layout_fits(meta, MuonConfig(), layout, 0, fits.total // 2, "test GPU")
    msg = str(e.value)
    need = fits.total / 2**30
    assert msg.startswith(f"trainer: this layout needs about {need:,.1f} GiB a GPU (parameters ")
    assert "the test GPU has" in msg and "trainer.plan_check=false" in msg and "\n" not in msg
    # within the planner's measured error of the card: left to run
    check_layout_fits(meta, MuonConfig(), layout, 0, int(fits.total / 1.05), "test GPU")


@pytest.mark.gpu
def test_a_gpu_run_too_big_for_the_card_stops_in_one_line(flashtrain, tmp_path):
    p = flashtrain("pretrain", "model=small", "logger=none", "data.seq_len=4096",
                   "trainer.micro_batch_size=64", "trainer.max_steps=1", f"hydra.run.dir={tmp_path / 'run'}",
                   timeout=600)
    assert p.returncode == 2, p.stderr[-3000:]
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("flashtrain: error:")]
    assert len(errors) == 1 and "this layout needs about" in errors[0], p.stderr[-3000:]


def test_context_parallel_layouts_split_each_sequences_activations(tiny):
    """CP degrees are planned as a run checks them; a CP rank keeps its slice's activations."""
    _, meta = tiny
    from conf.plan import ActivationRates
    from trainer.plan import candidate_layouts, plan_rank

    facts = ModelFacts.of(meta, MuonConfig())
    layouts = candidate_layouts(facts, 4, meta.cfg, 1024, [1], [1], [1], context_parallel=[1, 4])
    assert [(lay.cp, lay.tokens_per_rank) for lay in layouts] == [(1, 1024), (4, 256)]
    whole, sliced = (plan_rank(facts, lay, 0, ActivationRates(), 2**40) for lay in layouts)
    assert sliced.parts["parameters"] == whole.parts["parameters"]
    assert sliced.parts["activations"] * 4 == pytest.approx(whole.parts["activations"], rel=1e-6)
    with pytest.raises(ConfigError, match="context_parallel=3 does not divide the world size 4"):
        candidate_layouts(facts, 4, meta.cfg, 1024, [1], [1], [1], context_parallel=[3])


def test_the_fewest_checkpointed_blocks_that_fit(tiny):
    """trainer.checkpointed_layers in the planner: each checkpointed block keeps the checkpointed rate
    instead of the whole one and runs its forward twice; the fewest that fit is the smallest count
    whose plan fits."""
    _, meta = tiny
    from conf.plan import GPUS, ActivationRates, StepRates
    from trainer.plan import activation_bytes, fewest_checkpointed, plan_rank, step_time

    facts, rates, n = ModelFacts.of(meta, MuonConfig()), ActivationRates(), meta.cfg.n_layers
    layout = Layout(world=1, zero_stage=0, micro_batch=64, seq_len=4096)
    tokens, dim = 64 * 4096, meta.cfg.dim
    assert activation_bytes(facts, layout, 0, rates) == int(rates.full * dim * n * tokens)
    assert activation_bytes(facts, layout, n, rates) == int(rates.checkpointed * dim * n * tokens)
    two = activation_bytes(facts, layout, 2, rates)
    assert two == int((2 * rates.checkpointed + (n - 2) * rates.full) * dim * tokens)
    none, every = (plan_rank(facts, layout, k, rates, 2**50).total for k in (0, n))
    assert every < none
    for capacity in (every, (every + none) // 2, none - 1):
        plan = fewest_checkpointed(facts, layout, rates, capacity)
        k = plan.checkpointed
        assert 0 < k <= n and plan.fits and plan.total == plan_rank(facts, layout, k, rates, capacity).total
        assert not plan_rank(facts, layout, k - 1, rates, capacity).fits
    assert fewest_checkpointed(facts, layout, rates, none).checkpointed == 0
    assert fewest_checkpointed(facts, layout, rates, every - 1) is None
    # each checkpointed block adds a third of its forward-and-backward FLOPs and layer cost
    t = {k: step_time(facts, layout, k, 1, GPUS["h100"], 8, StepRates()) for k in (0, 2, n)}
    for part in ("compute", "layers"):
        assert t[n][part] == pytest.approx(t[0][part] * 4 / 3)
        assert t[2][part] == pytest.approx(t[0][part] * (1 + 2 / (3 * n)))


def test_the_step_time_estimate_is_within_a_quarter_of_every_measured_step():
    """Every step `bench/system/step_memory.py` timed (small and flash-width slices, H100 and H200,
    one or four micro-steps, checkpointing on and off) against the planner's estimate."""
    from bench.system.step_memory import model_config
    from conf.plan import GPUS, StepRates
    from tests.conftest import REPO
    from trainer.plan import step_time

    facts, checked = {}, 0
    for path in sorted((REPO / "bench" / "results" / "system").glob("step-memory-*.json")):
        result = json.loads(path.read_text())
        gpu = GPUS["h200" if "H200" in result["device"] else "h100"]
        for row in result["rows"]:
            if "oom" in row:
                continue
            if row["model"] not in facts:
                with torch.device("meta"):
                    facts[row["model"]] = ModelFacts.of(Transformer(model_config(row["model"], 129_280)),
                                                        MuonConfig())
            layout = Layout(world=1, zero_stage=0, micro_batch=row["micro_batch"], seq_len=row["seq_len"])
            checkpointed = row.get("checkpointed_layers",
                                   row["layers"] if row["activation_checkpointing"] else 0)
            parts = step_time(facts[row["model"]], layout, checkpointed,
                              row.get("accumulation", 1), gpu, 8, StepRates())
            assert sum(parts.values()) == pytest.approx(row["step_s"], rel=0.25), (path.name, row)
            checked += 1
    assert checked >= 10


def test_step_time_parts_follow_the_layout():
    """No exchange without EP or replicas; a group that spans nodes runs at the network's rate; the
    optimizer's share shrinks with ZeRO-1, which broadcasts the new weights; micro-steps come from
    the global batch."""
    from conf.model import SmallModelConfig
    from conf.plan import GPUS, StepRates
    from trainer.plan import accumulation_steps, step_time

    with torch.device("meta"):
        facts = ModelFacts.of(Transformer(SmallModelConfig(vocab_size=1024)), MuonConfig())
    gpu, rates = GPUS["h100"], StepRates()

    def parts(world, ep, zero=1, gpus_per_node=8):
        return step_time(facts, Layout(world, ep=ep, zero_stage=zero), 0, 1, gpu, gpus_per_node, rates)

    one = parts(1, 1, zero=0)
    assert one["all-to-all"] == one["gradient reduction"] == one["host traffic"] == 0
    inside, across = parts(8, 8), parts(16, 8, gpus_per_node=4)
    assert inside["all-to-all"] > 0 and across["all-to-all"] > 0
    # the same 8-rank EP group over two nodes of 4: the exchange runs at the network's rate
    assert across["all-to-all"] / inside["all-to-all"] == pytest.approx(gpu.nvlink_gbs / gpu.network_gbs)
    assert parts(8, 1)["optimizer"] < parts(8, 1, zero=0)["optimizer"] == one["optimizer"]
    # ZeRO-1's owners send their new weights; ZeRO-0 updates every replica in place
    assert parts(8, 1)["weight broadcast"] > 0 == parts(8, 1, zero=0)["weight broadcast"]
    # ZeRO-1 reduces each dense or expert gradient to its owner, half an all-reduce's bytes; the
    # Engram rows' gather is the same either way
    saved = parts(8, 1, zero=0)["gradient reduction"] - parts(8, 1)["gradient reduction"]
    reduced = facts.of_kind("dense") + facts.of_kind("routed")
    assert saved == pytest.approx(4 * reduced * 7 / 8 / (gpu.nvlink_gbs * 1e9))
    assert one["weight broadcast"] == 0
    assert accumulation_steps(Layout(16, cp=2, micro_batch=2), 100) == 7  # 100 / (2 x 8), rounded up
    assert accumulation_steps(Layout(16, micro_batch=2), 0) == 1


# One rank of the trainer's DeepSpeed path (every route to AdamW): `tiny` in a bf16 engine, one
# backward after two steps, then the bytes of every live tensor (weights, gradients, master weights,
# moments and the model's small buffers).
ENGINE_BYTES = r"""
import gc, sys, torch, deepspeed
from conf.model import FlashModelConfig, SmallModelConfig, TinyModelConfig
from model.transformer import Transformer
torch.manual_seed(0)
model = Transformer(TinyModelConfig(vocab_size=97))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config={
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 2**31 - 1,
    "zero_optimization": {"stage": int(sys.argv[1])}, "bf16": {"enabled": True}})
ids = torch.randint(0, 97, (2, 65))
for step in range(3):
    engine.backward(engine(ids[:, :-1], labels=ids[:, 1:]).loss)
    if step < 2:
        engine.step()
gc.collect()
storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in gc.get_objects() if isinstance(t, torch.Tensor)}
print("bytes", sum(storages.values()))
"""


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_the_deepspeed_path_holds_what_the_planner_says(tiny, port_base, stage):
    import subprocess
    import sys

    from conf.optim import AdamWConfig
    from tests.conftest import REPO

    _, meta = tiny
    facts = ModelFacts.of(meta, AdamWConfig())
    assert not facts.holds_whole_parameters(1)  # the DeepSpeed path, as build_optimizer picks it
    p = subprocess.run([sys.executable, "-c", ENGINE_BYTES, str(stage)], cwd=REPO, env=cli_env(port_base()),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    held = int(next(ln.split()[1] for ln in p.stdout.splitlines() if ln.startswith("bytes")))
    planned = sum(state_bytes(facts, Layout(world=1, zero_stage=stage)).values())
    assert planned == pytest.approx(held, rel=0.005)
