"""The kernel policy (model/ops.py): built from model.kernels, applied from outside, it swaps each
fused op's kernel into the modules that use it and leaves a reference model untouched; its guards
hand inputs a kernel does not take to the reference and say so once; its startup line names what
runs fused and what falls back under trainer.compile and ZeRO-3. The kernels' agreement with
their references is tests/test_kernels_*.py."""
import dataclasses

import pytest
import torch

from conf.model import TinyModelConfig
from model.attention import CSA2Attention
from model.numerics import RMSNorm
from model.ops import OPS, KernelPolicy
from model.transformer import Block, Transformer

CFG = dataclasses.replace(TinyModelConfig(vocab_size=97), engram_min_rows=50)
SITES = {RMSNorm: "rms_norm", Block: "fused_mhc", CSA2Attention: "select", Transformer: "head_loss"}


def _overridden(model) -> dict[type, int]:
    """Per site class: how many of its modules carry their own op (set by a policy)."""
    return {cls: sum(isinstance(m, cls) and name in vars(m) for m in model.modules())
            for cls, name in SITES.items()}


def test_kernels_off_leaves_the_reference_model_as_built():
    model = Transformer(CFG)
    KernelPolicy.from_config(CFG).apply(model)
    assert set(_overridden(model).values()) == {0}
    assert (KernelPolicy.from_config(CFG).describe()
            == "model.kernels: off (every op runs its PyTorch reference)")


def test_kernels_on_swaps_every_site():
    model = KernelPolicy.from_config(dataclasses.replace(CFG, kernels=True)).apply(Transformer(CFG))
    counts = _overridden(model)
    assert (counts[Transformer] == 1 and counts[Block] == CFG.n_layers
            and counts[CSA2Attention] == CFG.n_layers)
    assert counts[RMSNorm] == sum(isinstance(m, RMSNorm) for m in model.modules())
    assert all(layer.attn.attend_rotates for layer in model.layers)
    only_norms = KernelPolicy(["rms_norm"]).apply(Transformer(CFG))
    assert _overridden(only_norms)[RMSNorm] > 0 and _overridden(only_norms)[Block] == 0


def test_an_unknown_op_is_named():
    with pytest.raises(ValueError, match="unknown fused ops \\['rmsnorm'\\]"):
        KernelPolicy(["rmsnorm"])


def test_the_startup_line_names_the_fallbacks():
    line = KernelPolicy(OPS).describe(compile=True, zero_stage=3)
    assert line.startswith("model.kernels: Triton for rms_norm, rotary, stream_mix")
    assert ("under trainer.compile the reference for rms_norm, swiglu, moe_combine, engram_lookup, "
            "engram_gate" in line)
    assert "under ZeRO-3 the reference for engram_lookup, cross_entropy" in line
    assert "compile" not in KernelPolicy(["attention"]).describe(compile=True)


def test_a_refused_input_runs_the_reference_and_says_so_once(capsys):
    from model.rope import rotate

    policy = KernelPolicy(["rotary"])
    rotary = policy._ops()["rotate"]
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    angles = torch.randn(2, 5, 4, dtype=torch.float64)
    for _ in range(2):
        torch.testing.assert_close(rotary(x, angles), rotate(x, angles), rtol=0, atol=0)
    assert policy.fell_back == {"rotary": "fp64"}
    assert capsys.readouterr().err.count("rotary runs its PyTorch reference here (fp64)") == 1
