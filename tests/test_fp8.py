"""FP8 matmuls for training (trainer/fp8.py, torchao): what converts, emulated numerics against fp32,
the optimiser routing and checkpoint names unchanged, refusals, and the GPU paths (grouped experts,
blockwise) against bf16."""
import dataclasses

import pytest
import torch
from torch import nn

pytest.importorskip("torchao")

from conf.errors import ConfigError  # noqa: E402
from conf.model import TinyModelConfig  # noqa: E402
from conf.optim import MuonConfig  # noqa: E402
from model.moe import RoutedExperts, SharedExpert  # noqa: E402
from model.transformer import Transformer  # noqa: E402
from optim.routing import route_parameters  # noqa: E402
from trainer.fp8 import apply_fp8, check_fp8, float8_modules, pad_groups  # noqa: E402

VOCAB = 512


def tiny_pair(seed: int = 0, **overrides):
    """Two identical `tiny` models (the second to convert)."""
    cfg = dataclasses.replace(TinyModelConfig(), vocab_size=VOCAB, **overrides)
    torch.manual_seed(seed)
    ref = Transformer(cfg)
    fp8 = Transformer(cfg)
    fp8.load_state_dict(ref.state_dict())
    return ref, fp8


def loss_and_grads(model, ids):
    out = model(ids[:, :-1], labels=ids[:, 1:])
    model.zero_grad(set_to_none=True)
    out.lm_loss.backward()
    grads = torch.cat([p.grad.to_dense().flatten() for p in model.parameters() if p.grad is not None])
    return out.lm_loss.detach(), grads


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_tiny_in_emulated_fp8_matches_fp32_within_fp8_error_and_differs(recipe):
    """E4M3 keeps 3 mantissa bits (relative rounding up to 2^-4): the loss moves by well under 1%,
    the whole gradient keeps its direction (cosine > 0.97) and its size (within 10%), yet neither is
    the fp32 one, so the conversion took effect."""
    ref, fp8 = tiny_pair()
    conversion = apply_fp8(fp8, recipe, emulate=True)
    assert conversion.converted and conversion.emulate
    ids = torch.randint(0, VOCAB, (2, 65), generator=torch.Generator().manual_seed(1))
    ref_loss, ref_grad = loss_and_grads(ref, ids)
    loss, grad = loss_and_grads(fp8, ids)
    rel_loss = abs(loss - ref_loss) / ref_loss
    assert 0 < rel_loss < 5e-3, (loss, ref_loss)
    cosine = torch.nn.functional.cosine_similarity(grad, ref_grad, dim=0)
    assert 0.97 < cosine < 1 - 1e-6, cosine
    assert abs(grad.norm() / ref_grad.norm() - 1) < 0.1


def test_which_matmuls_convert_and_which_stay_high_precision():
    _, model = tiny_pair()
    conversion = apply_fp8(model, "rowwise", emulate=True)
    names = set(float8_modules(model))
    plain = {n for n, m in model.named_modules() if type(m) is nn.Linear}
    for n in names:  # every torchao module is one of the listed conversions, and vice versa
        assert conversion.converted[n] == "rowwise"
    assert names == {n for n in conversion.converted if not n.endswith(")")}
    assert any(n.endswith("attn.wq_b") for n in names) and any(n.endswith("moe.shared.w2") for n in names)
    assert any(n.endswith("index_query.wq_b") for n in names) and any(n.startswith("engrams.") for n in names)
    # kept in high precision, by decision (docs/DESIGN.md): head, compressor, indexer head weights
    assert "head" in plain and "head" in conversion.kept
    assert all(n in plain for n in conversion.kept if not n.endswith(")"))
    assert any(".compressor." in n for n in conversion.kept)
    assert any(n.endswith("weights_proj") for n in plain)
    # the shared expert's w1 / w3 are read through its stacked gate|up op, which is float8 now
    for name, module in model.named_modules():
        if isinstance(module, SharedExpert):
            assert f"{name}.w1" in plain and f"{name}.w3" in plain
            assert module.linear is not SharedExpert.linear and f"{name}.(w1|w3)" in conversion.converted
        if isinstance(module, RoutedExperts):
            assert module.linear is not RoutedExperts.linear
            assert module.grouped_mm is not RoutedExperts.grouped_mm and module.grouped is False  # emulated


def test_blockwise_converts_only_what_its_128_blocks_tile():
    """The conversion itself runs anywhere (the kernels are only called in a forward): `tiny`'s
    128-wide projections and experts convert, its 64-wide ones stay."""
    from trainer.fp8 import BlockwiseFloat8Linear

    _, model = tiny_pair()
    conversion = apply_fp8(model, "blockwise")
    assert isinstance(model.layers[0].attn.wo_b, BlockwiseFloat8Linear)  # 128 x 128
    assert type(model.layers[0].attn.wq_a) is nn.Linear  # 128 -> 64
    assert "multiple of 128" in conversion.kept["layers.0.attn.wq_a"]
    assert conversion.converted["layers.0.moe.experts.(w1|w3, w2)"] == "blockwise grouped"
    assert set(float8_modules(model)) == {n for n in conversion.converted if not n.endswith(")")}


def test_a_projection_whose_dims_fp8_cannot_take_stays_and_odd_expert_widths_are_refused():
    model = nn.Sequential(nn.Linear(32, 48, bias=False), nn.Linear(48, 20, bias=False))
    conversion = apply_fp8(model, "tensorwise", emulate=True)
    assert list(conversion.converted) == ["0"] and "multiple of 16" in conversion.kept["1"]
    assert type(model[1]) is nn.Linear and type(model[0]) is not nn.Linear
    _, odd = tiny_pair(moe_inter_dim=40)
    with pytest.raises(ConfigError, match=r"trainer.fp8=rowwise: the routed experts' widths"):
        apply_fp8(odd, "rowwise", emulate=True)


def test_optimiser_routing_and_checkpoint_names_do_not_change():
    ref, fp8 = tiny_pair()
    apply_fp8(fp8, "rowwise", emulate=True)
    assert any(isinstance(m, nn.Linear) and type(m) is not nn.Linear for m in fp8.modules())
    before = [(r.name, r.optimizer, r.heads, r.weight_decay, tuple(r.param.shape))
              for r in route_parameters(ref, MuonConfig())]
    after = [(r.name, r.optimizer, r.heads, r.weight_decay, tuple(r.param.shape))
             for r in route_parameters(fp8, MuonConfig())]
    assert after == before
    # a state dict saved with fp8 on loads with it off (and back), tensor for tensor
    with torch.no_grad():
        for p in fp8.parameters():
            p.add_(0.01)
    saved = fp8.state_dict()
    assert list(saved) == list(ref.state_dict())
    ref.load_state_dict(saved, strict=True)
    for name, tensor in ref.state_dict().items():
        assert torch.equal(tensor, saved[name]), name
    _, again = tiny_pair(seed=3)
    apply_fp8(again, "tensorwise", emulate=True)
    again.load_state_dict(ref.state_dict(), strict=True)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), saved.values()))


@pytest.mark.parametrize("kwargs, needle", [
    (dict(recipe="fp4"), "trainer.fp8='fp4': expected one of none, tensorwise, rowwise, blockwise"),
    (dict(recipe="rowwise", device=torch.device("cpu")), "trainer.fp8=rowwise needs a CUDA GPU"),
    (dict(recipe="blockwise", emulate=True), "trainer.fp8=blockwise has no emulated path"),
    (dict(recipe="blockwise", precision="fp32"), "trainer.fp8=blockwise needs trainer.precision=bf16"),
    (dict(recipe="tensorwise", precision="fp64", emulate=True), "trainer.precision=fp64"),
    (dict(recipe="rowwise", zero_stage=3, emulate=True), "trainer.zero_stage=3"),
])
def test_what_fp8_cannot_run_with_is_refused_in_one_line(kwargs, needle):
    kwargs = {"emulate": False, **kwargs}
    with pytest.raises(ConfigError) as e:
        check_fp8(**kwargs)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_none_and_emulated_recipes_pass_the_check():
    check_fp8("none", False, device=torch.device("cpu"))
    check_fp8("rowwise", True, "fp32", 1, torch.device("cpu"))


def test_pad_groups_moves_each_group_to_a_multiple_of_the_alignment():
    counts = torch.tensor([3, 0, 17, 16, 1])
    offsets = counts.cumsum(0).to(torch.int32)
    dest, ends, rows = pad_groups(offsets, int(counts.sum()), 16)
    assert ends.tolist() == [16, 16, 48, 64, 80] and rows == 128  # 37 rows + 5 x 16, to a multiple of 16
    starts = [0, 16, 16, 48, 64]
    expected = [s + i for s, c in zip(starts, counts.tolist()) for i in range(c)]
    assert dest.tolist() == expected


def test_the_fp8_grouped_gemm_sees_aligned_groups_and_its_rows_come_back_in_place(monkeypatch):
    """Float8GroupedMM around torchao's rowwise grouped GEMM, with that GEMM replaced by a check of
    what it is handed (every group starts at a multiple of 16, the padding rows are zero) and a
    plain grouped matmul: the result and the gradients are torch._grouped_mm's on the unpadded rows."""
    import torchao.prototype.moe_training as moe_training

    from trainer.fp8 import Float8GroupedMM

    def aligned_grouped_mm(a, b_t, offs, out_dtype, pad_token_groups_for_grouped_mm):
        assert not pad_token_groups_for_grouped_mm and out_dtype == a.dtype
        starts = torch.cat((offs.new_zeros(1), offs[:-1]))
        assert (starts % 16 == 0).all() and a.shape[0] % 16 == 0
        assert not a.detach()[offs[-1]:].any()
        return torch._grouped_mm(a, b_t, offs=offs)

    monkeypatch.setattr(moe_training, "_to_fp8_rowwise_then_scaled_grouped_mm", aligned_grouped_mm)
    counts = torch.tensor([5, 0, 21, 16, 1])
    offs = counts.cumsum(0).to(torch.int32)
    x = torch.randn(int(counts.sum()), 32, requires_grad=True)
    w = torch.randn(5, 24, 32).transpose(-2, -1).requires_grad_()  # [E, K, N], column-major per expert
    got = Float8GroupedMM()(x, w, offs)
    want = torch._grouped_mm(x, w, offs=offs)
    torch.testing.assert_close(got, want)
    grads = torch.autograd.grad(got.square().sum(), (x, w))
    want_grads = torch.autograd.grad(want.square().sum(), (x, w))
    for g, h in zip(grads, want_grads):
        torch.testing.assert_close(g, h)


@pytest.mark.slow
def test_a_checkpoint_written_with_fp8_resumes_without_it(flashtrain, tmp_path):
    """A step with emulated rowwise fp8, then the same run resumed with trainer.fp8=none: the
    checkpoint's names and the optimiser state (saved by parameter name) load into the plain model."""
    from tests.conftest import FAST

    run = tmp_path / "run"
    common = [*FAST, f"hydra.run.dir={run}", "trainer.save_every=1"]
    p = flashtrain("pretrain", *common, "trainer.max_steps=1", "trainer.fp8=rowwise",
                   "trainer.fp8_emulate=true")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "trainer.fp8: rowwise, emulated" in p.stdout
    p = flashtrain("pretrain", *common, "trainer.max_steps=2", "trainer.fp8=none")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resuming from" in p.stdout and "trainer.fp8" not in p.stdout


def test_fp8_on_a_cpu_without_emulation_is_one_line_through_the_cli(flashtrain, tmp_path):
    p = flashtrain("pretrain", *["model=tiny", "logger=none"], f"hydra.run.dir={tmp_path / 'run'}",
                   "trainer.fp8=rowwise")
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [line for line in p.stderr.splitlines() if "trainer.fp8" in line]
    assert len(lines) == 1 and "needs a CUDA GPU" in lines[0] and "Traceback" not in p.stderr


# ---------------------------------------------------------------------------- GPU: the real kernels

def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="fp8 GEMMs need compute capability 9.0+")
@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_fp8_grouped_experts_match_bf16_grouped_experts_on_gpu(recipe):
    """The experts' float8 grouped GEMMs (groups of uneven sizes, some empty) against the bf16
    grouped GEMM: close in value and gradient, not equal."""
    torch.manual_seed(0)
    ref = RoutedExperts(8, 256, 256, limit=0.0, grouped=True).cuda()
    for p in ref.parameters():
        nn.init.normal_(p, std=0.05)
    fp8 = RoutedExperts(8, 256, 256, limit=0.0, grouped=True).cuda()
    fp8.load_state_dict(ref.state_dict())
    apply_fp8(nn.ModuleDict({"experts": fp8}), recipe)
    counts = torch.tensor([37, 0, 200, 5, 128, 1, 0, 141], device="cuda")
    x = torch.randn(int(counts.sum()), 256, device="cuda", dtype=torch.bfloat16)
    outs, grads = [], []
    for m in (ref, fp8):
        xi = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = m(xi, counts)
        y.float().square().sum().backward()
        outs.append(y.float())
        grads.append(torch.cat([xi.grad.float().flatten(), m.w1.grad.flatten(), m.w2.grad.flatten()]))
    rel = (outs[1] - outs[0]).norm() / outs[0].norm()
    assert 1e-4 < rel < 0.08, rel
    assert torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0) > 0.98


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="fp8 GEMMs need compute capability 9.0+")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_tiny_fp8_on_gpu_matches_bf16(recipe):
    ref, fp8 = tiny_pair()
    ref.cuda(), fp8.cuda()
    apply_fp8(fp8, recipe)
    ids = torch.randint(0, VOCAB, (4, 257), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref_loss, ref_grad = loss_and_grads(ref, ids)
        loss, grad = loss_and_grads(fp8, ids)
    assert 0 < abs(loss - ref_loss) / ref_loss < 1e-2
    assert torch.nn.functional.cosine_similarity(grad, ref_grad, dim=0) > 0.95
