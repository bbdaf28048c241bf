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


def _backward(model, micro_batch: int, seq_len: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
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


def test_a_text_only_step_gives_the_vision_tower_no_gradients_or_state():
    """`tiny` with a vision tower, two micro-steps of text: the tower gets no gradient and so no
    optimizer state, and the Engram tables' sparse rows of both micro-steps are held; the planner says
    the same. Image-text training (Layout.images) counts the tower's gradients and state; ZeRO-2 holds
    gradient buffers for it either way (its backward reducer accumulates zeros for the missing ones)."""
    from trainer.plan import STATE_BYTES

    cfg = dataclasses.replace(TinyModelConfig(vocab_size=97), vision_n_layers=2)
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.device("meta"):
        facts = ModelFacts.of(Transformer(cfg), MuonConfig())
    opt = build_optimizer(model, MuonConfig(), zero_stage=0)
    assert opt.enable_sparse_table_grads(model) > 0
    for seed in range(2):  # each micro-step its own tokens, whose rows autograd appends
        _backward(model, micro_batch=2, seq_len=64, seed=seed)
    tower = [p for p in model.visual.parameters()]
    assert tower and all(p.grad is None for p in tower)
    grads = sum(_bytes((p.grad._values(), p.grad._indices())) if p.grad.is_sparse else _bytes([p.grad])
                for p in model.parameters() if p.grad is not None)
    opt.step()
    text = Layout(world=1, zero_stage=0, micro_batch=2, seq_len=64)
    assert state_bytes(facts, text, accumulation=2) == {
        "parameters": _bytes(model.parameters()), "gradients": grads, "optimizer": _state(opt)}
    model.zero_grad(set_to_none=True)
    routes = [r for r in facts.routes if r.name in facts.vision]
    assert len(routes) == len(tower)
    images = state_bytes(facts, dataclasses.replace(text, images=True), accumulation=2)
    assert images["gradients"] - grads == 4 * sum(p.numel() for p in tower)
    momentum = sum(STATE_BYTES[r.optimizer] * r.param.numel() for r in routes)
    assert images["optimizer"] - _state(opt) == momentum
    # ZeRO-2 holds a buffer for every gradient (zeros accumulated for the tower) but steps only those
    # some rank produced: the tower's momentum only with images
    zero2 = Layout(world=2, zero_stage=2, micro_batch=2, seq_len=64)
    text2, images2 = state_bytes(facts, zero2), state_bytes(facts, dataclasses.replace(zero2, images=True))
    assert text2["gradients"] == images2["gradients"] and images2["optimizer"] > text2["optimizer"]


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
    # 4 sequences a step: micro-batch 1 takes two micro-steps, so its gradients are held at every peak;
    # micro-batch 8 one
    p = _plan(cli_zygote, port_base, "model=small", "cluster.gpus_per_node=2", "cluster.gpu=h100",
              "plan.micro_batches=[1,8]", "plan.json=true", "plan.engram_tables=[gpu]", "plan.global_batch=4")
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    n_layers = SmallModelConfig().n_layers
    # a layout that fits only with some blocks checkpointed gets a third row: the fewest that fit
    partial = [r for r in out["rows"] if 0 < r["checkpointed_layers"] < n_layers]
    rows = [r for r in out["rows"] if r["checkpointed_layers"] in (0, n_layers)]
    # EP 1 and 2 (both divide 32 experts and 2 ranks) x ZeRO 0/1/2 (2 with fp32 or bf16 gradients; 1 and 2
    # with fp32 or bf16 weights: 1 + 2 + 2 * 2 = 7) x micro-batch 1/8 x checkpointing, and without
    # checkpointing each once more with moe_act (with every block checkpointed it changes nothing)
    assert out["world"] == 2 and len(rows) == 2 * 7 * 2 * 3 and out["layouts"] == len(out["rows"])
    assert all(r["activation_checkpointing"] == (r["checkpointed_layers"] > 0) for r in out["rows"])
    assert all(r["accumulation"] == (2 if r["micro_batch"] == 1 else 1) for r in out["rows"])
    # one micro-step a step peaks at the end of the forward, before any gradient exists, or in the
    # optimizer step; with two, the gradients are there either way
    for r in out["rows"]:
        assert r["gradients_gib"] > 0
        forward_of_one = r["micro_batch"] == 8 and r["peak"] == "forward"
        assert r["not_at_peak"] == (["gradients"] if forward_of_one else [])
    key = ("ep", "zero_stage", "grad_accum_dtype", "param_dtype", "micro_batch")
    moe_act = {tuple(r[k] for k in key): r for r in rows if r["recompute_modules"] == "moe_act"}
    assert len(moe_act) == 2 * 7 * 2 and all(r["checkpointed_layers"] == 0 for r in moe_act.values())
    for r in rows:
        if r["recompute_modules"] == "none" and r["checkpointed_layers"] == 0:
            twin = moe_act[tuple(r[k] for k in key)]
            assert twin["activations_gib"] < r["activations_gib"] and twin["step_s"] > r["step_s"]
    rows = [r for r in rows if r["recompute_modules"] == "none"]
    assert partial and all(r["fits"] for r in partial)
    dtypes = ("fp32", "bf16")
    assert {(r["ep"], r["zero_stage"], r["grad_accum_dtype"], r["param_dtype"]) for r in rows} == {
        (ep, z, g, w) for ep in (1, 2) for z, g, w in ((0, "fp32", "fp32"), *((1, "fp32", w) for w in dtypes),
                                                        *((2, g, w) for g in dtypes for w in dtypes))}
    fits = [r["fits"] for r in out["rows"]]
    assert fits == sorted(fits, reverse=True) and 0 < sum(fits) < len(fits)  # the fitting ones first
    for r in out["rows"]:
        parts = (r["parameters_gib"] + r["gradients_gib"] + r["optimizer_gib"] + r.get("activations_gib", 0)
                 + r.get("optimizer_workspace_gib", 0) - sum(r[f"{k}_gib"] for k in r["not_at_peak"]))
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


def test_flash_fits_8_nodes_only_with_zero2_and_host_tables(cli_zygote, port_base):
    # at EP=64 each rank holds 8B dense weights whole; only ZeRO-2's owner-only gradients leave room, and
    # not in fp32 beside fp32 weights
    p = _plan(cli_zygote, port_base, "model=flash", "cluster.nodes=8", "plan.json=true")
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    n_layers = FlashModelConfig().n_layers
    fits = [r for r in out["rows"] if r["fits"]]
    assert fits and all((r["ep"], r["zero_stage"], r["engram_tables"]) == (64, 2, "host") for r in fits)
    assert all("bf16" in (r["grad_accum_dtype"], r["param_dtype"]) for r in fits)
    # one micro-step a step: a layout that keeps some blocks whole peaks at the end of its forward,
    # before any gradient exists
    partial = [r for r in fits if r["checkpointed_layers"] < n_layers]
    assert partial and all(r["peak"] == "forward" and r["not_at_peak"] == ["gradients"] for r in partial)
    # the blocks kept whole recompute nothing: a faster step than with all checkpointed, for more memory
    key = ("ep", "zero_stage", "engram_tables", "grad_accum_dtype", "param_dtype", "micro_batch")
    whole = {tuple(r[k] for k in key): r for r in out["rows"] if r["checkpointed_layers"] == n_layers}
    for r in partial:
        every = whole[tuple(r[k] for k in key)]
        assert every["total_gib"] < r["total_gib"] <= out["capacity_gib"] and r["step_s"] < every["step_s"]
    # moe_act keeps neither the experts' weight copies nor their SwiGLU outputs: the room for more whole
    # blocks, fewer recomputed, a faster step
    act = {tuple(r[k] for k in key): r for r in partial if r["recompute_modules"] == "moe_act"}
    plain = {tuple(r[k] for k in key): r for r in partial if r["recompute_modules"] == "none"}
    both = set(act) & set(plain)
    assert both and all(act[k]["checkpointed_layers"] < plain[k]["checkpointed_layers"]
                        and act[k]["step_s"] < plain[k]["step_s"] for k in both)
    # bf16 weights (trainer.param_dtype=bf16) halve the replicated dense weights: at EP=64 an expert
    # shard has world / EP = 1 replica and stays fp32, so the weights shrink by half the dense fp32
    # bytes, and the masters (dense / 64 ranks, but whole parameters: the fullest owner holds a
    # vocabulary-sized one) cost a few GiB of optimizer state
    by = {r["param_dtype"]: r for r in fits if r["checkpointed_layers"] == n_layers and r["micro_batch"] == 1
          and r["grad_accum_dtype"] == "bf16"}
    assert set(by) == {"fp32", "bf16"}
    assert by["fp32"]["total_gib"] - by["bf16"]["total_gib"] > 10
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
    """CP degrees are planned as a run checks them; a CP rank keeps its slice's activations (what
    does not depend on the tokens, the experts' weight copies and the LM head's weight and gradient, it
    keeps whole)."""
    _, meta = tiny
    from conf.plan import ActivationRates
    from trainer.plan import candidate_layouts, expert_weight_copies, plan_rank

    facts = ModelFacts.of(meta, MuonConfig())
    layouts = candidate_layouts(facts, 4, meta.cfg, 1024, [1], [1], [1], context_parallel=[1, 4])
    assert [(lay.cp, lay.tokens_per_rank) for lay in layouts] == [(1, 1024), (4, 256)]
    whole, sliced = (plan_rank(facts, lay, 0, ActivationRates(), 2**40) for lay in layouts)
    assert sliced.parts["parameters"] == whole.parts["parameters"]
    assert meta.cfg.loss_chunk_tokens == 0  # the logits are per token too
    fixed = expert_weight_copies(facts, layouts[0], 0) + (2 + 4 + 4) * facts.head_numel()
    assert (sliced.parts["activations"] - fixed) * 4 == pytest.approx(whole.parts["activations"] - fixed,
                                                                       rel=1e-6)
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
    # each block its rate's bytes a token, and a whole block its experts' weight copies; the LM head's
    # loss (`head`) whatever the blocks
    head = activation_bytes(facts, layout, n, rates) - int(rates.checkpointed * dim * n * tokens)
    copies = [2 * sum(gate_up + down for gate_up, down in facts.expert_weights[k:]) for k in (0, 2)]
    assert copies[0] > copies[1] > 0
    assert activation_bytes(facts, layout, 0, rates) == int(rates.full * dim * n * tokens) + copies[0] + head
    two = activation_bytes(facts, layout, 2, rates)
    assert two == int((2 * rates.checkpointed + (n - 2) * rates.full) * dim * tokens) + copies[1] + head
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


def test_moe_act_drops_the_expert_weight_copies_and_swiglu_of_the_whole_blocks(tiny):
    """trainer.recompute_modules=[moe_act] in the planner: a micro-step keeps, per MoE block not
    checkpointed whole, neither its experts' bf16 weight copies (the rank's shards under EP) nor its
    SwiGLU outputs; blocks checkpointed whole keep neither anyway. bf16 weights need no copy of the down
    weight, so moe_act saves only the stacked gate and up there. The backward makes the same bytes
    again: step time grows by them at the measured rate."""
    _, meta = tiny
    from conf.plan import GPUS, ActivationRates, StepRates
    from trainer.plan import activation_bytes, step_time

    facts, rates, n, cfg = ModelFacts.of(meta, MuonConfig()), ActivationRates(), meta.cfg.n_layers, meta.cfg
    tokens = 2 * 512
    swiglu = tokens * cfg.n_activated_experts * cfg.moe_inter_dim * 2  # bf16, a block
    assert len(facts.expert_weights) == n and all(gate_up > 0 for gate_up, _ in facts.expert_weights)

    def saved(layout, k):
        return (activation_bytes(facts, layout, k, rates)
                - activation_bytes(facts, dataclasses.replace(layout, moe_act=True), k, rates))

    fp32 = Layout(world=1, zero_stage=0, micro_batch=2, seq_len=512)
    bf16 = Layout(world=2, zero_stage=1, micro_batch=2, seq_len=512, param_dtype="bf16")  # 2 replicas
    ep2 = Layout(world=2, ep=2, zero_stage=1, micro_batch=2, seq_len=512)
    for k in (0, 2, n):
        whole = facts.expert_weights[k:]
        assert saved(fp32, k) == sum(2 * (gate_up + down) + swiglu for gate_up, down in whole)
        assert saved(bf16, k) == sum(2 * gate_up + swiglu for gate_up, _ in whole)
        assert saved(ep2, k) == sum(2 * (gate_up + down) // 2 + swiglu for gate_up, down in whole)
    assert saved(fp32, n) == 0 and saved(fp32, 2) < saved(fp32, 0)
    # the step: the same bytes made again in each micro-step's backward
    gpu = GPUS["h100"]
    for k in (0, 2, n):
        plain, act = (step_time(facts, layout, k, 3, gpu, 8, StepRates())
                      for layout in (fp32, dataclasses.replace(fp32, moe_act=True)))
        assert plain["moe_act recompute"] == 0
        assert act["moe_act recompute"] == pytest.approx(3 * saved(fp32, k) / StepRates().moe_act_bytes_per_s)
        assert sum(act.values()) - sum(plain.values()) == pytest.approx(act["moe_act recompute"])


def test_one_micro_step_peaks_before_its_gradients_exist(tiny):
    """With one micro-step a step the gradients do not exist in the forward (the optimizer set them
    to None): the peak is the larger of the end of the forward and the optimizer step (the gradients
    and its workspace). With several, the gradients are there under both."""
    _, meta = tiny
    from conf.plan import ActivationRates
    from trainer.plan import activation_bytes, optimizer_workspace_elements, plan_rank

    facts, rates, n = ModelFacts.of(meta, MuonConfig()), ActivationRates(), meta.cfg.n_layers
    workspace = int(rates.optimizer_workspace * 4 * optimizer_workspace_elements(facts, 1))
    peaks = set()
    for micro_batch, seq_len, k in ((1, 64, n), (64, 4096, 0)):  # few tokens, checkpointed; many, whole
        layout = Layout(world=1, zero_stage=0, micro_batch=micro_batch, seq_len=seq_len)
        state, state4 = state_bytes(facts, layout), state_bytes(facts, layout, 4)
        acts = activation_bytes(facts, layout, k, rates)
        one, four = plan_rank(facts, layout, k, rates, 2**50, 1, state), plan_rank(facts, layout, k, rates,
                                                                                    2**50, 4, state4)
        held = state["parameters"] + state["optimizer"]
        assert one.total == held + max(acts, state["gradients"] + workspace)
        assert one.peak == ("forward" if acts > state["gradients"] + workspace else "optimizer step")
        assert one.parts["gradients"] == state["gradients"]
        assert one.absent == ({"gradients"} if one.peak == "forward" else set())
        assert four.total == held + state4["gradients"] + max(acts, workspace) and not four.absent
        peaks.add(one.peak)
    assert peaks == {"forward", "optimizer step"}


def _measured_steps():
    """(result file name, its device, row, the row's ModelFacts, Layout, checkpointed blocks) for every
    step `bench/system/step_memory.py` measured (rows that ran out of memory or could not run left out).
    The facts are those of the model the row measured: a row whose parameter count matches flash
    without its vision tower measured that model."""
    from bench.system.step_memory import model_config
    from tests.conftest import REPO

    facts = {}
    for path in sorted((REPO / "bench" / "results" / "system").glob("step-memory-*.json")):
        result = json.loads(path.read_text())
        for row in result["rows"]:
            if "oom" in row or "error" in row:
                continue
            key = (row["model"], row["params"])
            if key not in facts:
                cfg = model_config(row["model"], 129_280)
                with torch.device("meta"):
                    model = Transformer(cfg)
                    if sum(p.numel() for p in model.parameters()) != row["params"]:
                        model = Transformer(dataclasses.replace(cfg, vision_n_layers=0))
                assert sum(p.numel() for p in model.parameters()) == row["params"], (path.name, row)
                facts[key] = ModelFacts.of(model, MuonConfig())
            # bf16 weights (trainer.param_dtype=bf16) on one GPU with every master there, as the bench
            # runs them: what a ZeRO-0 rank of two replicas would hold
            bf16 = row.get("param_dtype", "fp32") == "bf16"
            layout = Layout(world=2 if bf16 else 1, zero_stage=0, micro_batch=row["micro_batch"],
                            seq_len=row["seq_len"], param_dtype=row.get("param_dtype", "fp32"),
                            moe_act=row.get("recompute_modules", "none") == "moe_act")
            every = row["layers"] if row["activation_checkpointing"] else 0
            yield path.name, result["device"], row, facts[key], layout, row.get("checkpointed_layers", every)


def test_the_memory_estimate_is_within_a_tenth_of_every_measured_peak():
    """Every peak `bench/system/step_memory.py` measured (small and flash-width slices, H100 and H200,
    one or four micro-steps, checkpointing off, on and on for the first blocks, moe_act, bf16 weights,
    fp8 matmuls) against the planner's, each row's whole layout passed (bench/reports/
    2026-12-07-planner-memory-refit.md). The weights, gradients and optimizer state are exact."""
    from conf.plan import ActivationRates
    from trainer.plan import plan_rank, state_bytes

    checked = 0
    for name, _, row, facts, layout, checkpointed in _measured_steps():
        accumulation = row.get("accumulation", 1)
        if name == "step-memory-h100-03d2740.json" and row["model"] == "flash-L4":
            # Its peak_gib includes the warm-up steps (autotuning), which the planner does not model,
            # and this file has no steady_peak_gib to use instead; the same row traced step by step
            # is compared in bench/reports/2026-12-07-planner-memory-refit.md.
            continue
        state = state_bytes(facts, layout, accumulation)
        if row.get("fp8", "none") == "none":  # fp8 modules change what the bench's state holds a little
            measured = {"parameters": row["param_gib"], "gradients": row["grad_gib"],
                        "optimizer": row["optimizer_state_gib"] + row.get("master_gib", 0)}
            assert {k: round(v / 2**30, 2) for k, v in state.items()} == pytest.approx(measured, abs=0.01), \
                (name, row)
        plan = plan_rank(facts, layout, checkpointed, ActivationRates(), 2**50, accumulation, state)
        assert plan.total / 2**30 == pytest.approx(row["peak_gib"], rel=0.10), (name, row, plan.parts)
        checked += 1
    assert checked >= 22


def test_the_step_time_estimate_is_within_a_quarter_of_every_measured_step():
    """Every step `bench/system/step_memory.py` timed (small and flash-width slices, H100 and H200,
    one or four micro-steps, checkpointing on and off, moe_act) against the planner's estimate."""
    from conf.plan import GPUS, StepRates
    from trainer.plan import step_time

    checked = 0
    for _, device, row, facts, layout, checkpointed in _measured_steps():
        gpu = GPUS["h200" if "H200" in device else "h100"]
        # one GPU: the bench's bf16 weights exchange nothing
        layout = dataclasses.replace(layout, world=1)
        parts = step_time(facts, layout, checkpointed, row.get("accumulation", 1), gpu, 8, StepRates())
        assert sum(parts.values()) == pytest.approx(row["step_s"], rel=0.25), (row, parts)
        assert (parts["moe_act recompute"] > 0) == layout.moe_act
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
