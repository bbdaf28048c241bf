"""The public DeepSeek-V4.1-Flash checkpoint layout: export, import, validation, training from it.

The exported files are checked with tests/public_reader.py, which decodes the layout without
flashtrain, and against the model's modules by attribute (not through trainer/interop/layout.py)."""
import dataclasses
import hashlib
import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from conftest import FAST
from public_reader import read
from safetensors.torch import load_file, save_file

from conf.model import TinyModelConfig
from model.transformer import Transformer
from trainer.checkpoint import load_model_weights
from trainer.interop.convert import InteropError, export_model, import_checkpoint, import_into_model

VOCAB = 512
CFG = dataclasses.replace(TinyModelConfig(), vocab_size=VOCAB)
QUIET = lambda _: None  # noqa: E731


def _model(seed: int) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(CFG)
    with torch.no_grad():  # state the layout must carry that a fresh model does not show
        for layer in model.layers:
            layer.moe.router.bias.normal_(0, 0.1)
    return model.eval()


def _digests(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir())}


def module_tensor(model: Transformer, name: str) -> torch.Tensor:
    """The model tensor a public name describes, by module attribute, in the public shape."""
    parts = name.split(".")
    if parts[0] != "layers":
        return getattr(model, parts[0]).weight
    i, rest = int(parts[1]), parts[2:]
    block, key = model.layers[i], ".".join(rest)
    if key.startswith("hc_"):
        _, sub, field = key.split("_")
        return getattr(block.attn_hc if sub == "attn" else block.ffn_hc, field)
    if key in ("attn_norm.weight", "ffn_norm.weight"):
        return getattr(block, rest[0]).weight
    if rest[0] == "engram":
        engram = model.engrams[str(i)]
        return {"embed.weight": engram.table.weight, "wkv.weight": engram.proj.weight,
                "q_weight": engram.hidden_norm.weight, "k_weight": engram.key_norm.weight}[".".join(rest[1:])]
    if rest[0] == "attn":
        attn = block.attn
        if rest[1] == "attn_sink":
            return attn.sink
        if rest[1] == "wo_a":  # [G, Ro, H/G*C] -> [G*Ro, H*C/G]
            return attn.wo_a.reshape(-1, attn.wo_a.shape[-1])
        if rest[1] == "indexer":
            owner = attn.index_key if rest[2] in ("wk", "k_norm") else attn.index_query
            return getattr(owner, rest[2]).weight
        if rest[1] == "compressor":
            return getattr(attn.compressor, rest[2]).weight
        return getattr(attn, rest[1]).weight
    moe = block.moe
    if rest[1] == "gate":
        return getattr(moe.router, rest[2])
    if rest[1] == "experts":
        return getattr(moe.experts, rest[3])[int(rest[2])]
    return getattr(moe.shared, rest[2]).weight  # shared_experts.wN.weight


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny model exported, imported into a differently seeded model, exported again."""
    root = tmp_path_factory.mktemp("interop")
    original = _model(0)
    export_model(original, root / "first", log=QUIET)
    imported = _model(1)
    import_into_model(imported, root / "first", log=QUIET)
    export_model(imported, root / "second", log=QUIET)
    return root, original, imported


def test_independent_reader_decodes_the_model(exported):
    root, original, imported = exported
    config, tensors = read(root / "first")
    assert (config["dim"], config["n_layers"], config["vocab_size"]) == (CFG.dim, CFG.n_layers, VOCAB)
    assert config["compress_ratios"] == [0, 2, 2, 1, 1, 1] and config["engram_layer_ids"] == [1, 2]
    covered = set()
    for name, value in tensors.items():
        want = module_tensor(imported, name).detach().double()
        assert torch.equal(value, want), f"{name}: the reader and the import disagree"
        # against the weights before quantisation: within each encoding's rounding
        source = module_tensor(original, name).detach().double()
        err = ((value - source).norm() / source.norm().clamp(min=1e-12)).item()
        bound = 0.15 if ".experts." in name else 0.04  # FP4 experts (Gaussian: ~0.11) / FP8 and bf16
        assert err < bound, f"{name}: relative error {err:.3g} after export"
        covered.add(name)
    assert sum(".experts." in n for n in covered) == CFG.n_layers * CFG.n_routed_experts * 3
    n_public = sum(1 for k in original.state_dict() if not k.endswith(("lookup_map", ".multipliers", ".load")))
    n_public += CFG.n_layers * 3 * (CFG.n_routed_experts - 1)  # stacked experts are one tensor each
    assert len(covered) == n_public


def test_round_trip_is_exact_and_the_second_export_byte_identical(exported):
    root, _, imported = exported
    _, tensors = read(root / "second")
    for name, value in tensors.items():
        assert torch.equal(value, module_tensor(imported, name).detach().double()), name
    assert _digests(root / "first") == _digests(root / "second")


def test_logits_after_export_and_import(exported):
    root, _, snapped = exported  # weights on the stored grids: the layout holds them exactly
    fresh = _model(2)
    import_into_model(fresh, root / "second", log=QUIET)  # the export of `snapped`
    ids = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = snapped(ids).logits, fresh(ids).logits
    torch.testing.assert_close(got, want, rtol=2**-8, atol=2**-8 * want.abs().max().item())


def _rewrite(src: Path, dst: Path, edit) -> None:
    """Copy a public dir, then edit(tensors of the shard holding layer 1, index weight_map)."""
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shard = dst / index["weight_map"]["layers.1.attn.wq_a.weight"]
    tensors = load_file(str(shard))
    edit(tensors, index["weight_map"], shard.name)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))


def _drop(t, wm, _):
    del t["layers.1.attn.wkv.weight"], wm["layers.1.attn.wkv.weight"]


def _reshape(t, wm, _):
    t["layers.1.attn.q_norm.weight"] = t["layers.1.attn.q_norm.weight"][:-1].clone()


def _retype(t, wm, _):
    t["layers.1.ffn.gate.bias"] = t["layers.1.ffn.gate.bias"].bfloat16()


def _extra(t, wm, shard):
    t["layers.1.attn.wq_c.weight"], wm["layers.1.attn.wq_c.weight"] = torch.zeros(2, 2), shard


@pytest.mark.parametrize("edit, needle", [
    (_drop, "missing tensor layers.1.attn.wkv.weight"),
    (_reshape, "layers.1.attn.q_norm.weight: shape [63], expected [64]"),
    (_retype, "layers.1.ffn.gate.bias: dtype BF16, expected F32"),
    (_extra, "unexpected tensor layers.1.attn.wq_c.weight"),
])
def test_a_bad_checkpoint_names_the_tensor(exported, tmp_path, edit, needle):
    root, _, _ = exported
    _rewrite(root / "first", tmp_path / "bad", edit)
    with pytest.raises(InteropError, match="does not fit model tiny") as err:
        import_into_model(_model(3), tmp_path / "bad", log=QUIET)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_dspark_tensors_are_named_and_skipped_or_refused(exported, tmp_path):
    root, _, imported = exported
    _rewrite(root / "first", tmp_path / "mtp", lambda t, wm, shard: (
        t.__setitem__("mtp.0.norm.weight", torch.ones(4)), wm.__setitem__("mtp.0.norm.weight", shard)))
    said = []
    model = _model(4)
    import_into_model(model, tmp_path / "mtp", log=said.append)
    assert "skipping 1 DSpark drafter tensors" in said[0]
    assert torch.equal(model.layers[1].attn.wq_a.weight, imported.layers[1].attn.wq_a.weight)
    with pytest.raises(InteropError, match=r"1 DSpark tensors \(mtp.0.norm.weight"):
        import_into_model(_model(4), tmp_path / "mtp", dspark="error", log=QUIET)


def test_a_config_that_differs_is_named(exported, tmp_path):
    root, _, _ = exported
    shutil.copytree(root / "first", tmp_path / "pub")
    config = json.loads((tmp_path / "pub" / "config.json").read_text())
    config["swiglu_limit"] = 7.0
    del config["index_topk"]
    (tmp_path / "pub" / "config.json").write_text(json.dumps(config))
    with pytest.raises(InteropError) as err:
        import_into_model(_model(5), tmp_path / "pub", log=QUIET)
    assert "config.json swiglu_limit=7.0 but the model has 10.0" in str(err.value)
    assert "config.json lacks index_topk" in str(err.value)


# ------------------------------------------------------------------ the CLI and training
@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    for d in range(8):
        lines = [f"{a} + {b} = {a + b}." for a, b in ((rng.randint(0, 99), rng.randint(0, 99)) for _ in range(150))]
        (root / f"doc{d}.txt").write_text("\n".join(lines))
    return ["data=files", f"data.path={root}", f"data.vocab_size={VOCAB}", "data.val_fraction=0.1",
            f"model.vocab_size={VOCAB}"]


def test_imported_checkpoint_then_cli_export_is_byte_identical(exported, flashtrain, tmp_path):
    root, _, imported = exported
    import_checkpoint(root / "first", tmp_path / "imp" / "checkpoints", CFG, log=QUIET)  # what `convert import=` runs
    model = _model(6)
    load_model_weights(model, tmp_path / "imp" / "checkpoints" / "step_00000000")
    for name, value in imported.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    p = flashtrain("convert", "model=tiny", f"export={tmp_path / 'out'}", f"checkpoint={tmp_path / 'imp'}",
                   f"hydra.run.dir={tmp_path / 'exp'}", cache=False)
    assert p.returncode == 0, p.stderr[-3000:]
    assert _digests(tmp_path / "out") == _digests(root / "first")


def test_cli_bad_checkpoint_exits_2_with_one_line(exported, flashtrain, tmp_path):
    root, _, _ = exported
    _rewrite(root / "first", tmp_path / "bad", _drop)
    p = flashtrain("convert", "model=tiny", f"import={tmp_path / 'bad'}", f"hydra.run.dir={tmp_path / 'run'}",
                   cache=False)
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("flashtrain: error:")]
    assert p.returncode == 2 and len(errors) == 1, p.stderr[-3000:]
    assert "missing tensor layers.1.attn.wkv.weight" in errors[0] and "Traceback" not in p.stderr


def test_pretrain_starts_from_a_public_layout_dir(exported, flashtrain, corpus, tmp_path):
    root, _, imported = exported
    run = tmp_path / "run"
    # lr 0 and no bias updates: the weights after a step are the starting weights
    p = flashtrain("pretrain", *FAST, *corpus, f"model.init_from={root / 'first'}", "trainer.max_steps=1",
                   "optim.lr=0", "model.bias_update_speed=0", "trainer.torch_threads=1", f"hydra.run.dir={run}")
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"weights from {root / 'first'}" in p.stdout, p.stdout[-2000:]
    trained = _model(7)
    load_model_weights(trained, run / "checkpoints" / "step_00000001")
    for name, value in imported.state_dict().items():
        if name != "lookup_map":  # the run's own, from its tokenizer
            assert torch.equal(trained.state_dict()[name], value), name


def test_rl_and_distill_take_their_policy_from_model_init_from(exported, tmp_path):
    """rl/run.py's initial_policy (flashtrain distill's student goes through it too)."""
    from types import SimpleNamespace

    from conf.errors import ConfigError
    from rl.run import initial_policy

    root, _, _ = exported
    cfg = lambda policy, init: SimpleNamespace(rl=SimpleNamespace(policy=policy),  # noqa: E731
                                               model=SimpleNamespace(init_from=init))
    assert initial_policy(cfg(None, str(root / "first"))) == str(root / "first")  # the trainers import it
    ckpt = import_checkpoint(root / "first", tmp_path / "checkpoints", CFG, log=QUIET)
    assert initial_policy(cfg(None, str(tmp_path))) == str(ckpt)  # a run dir: its newest checkpoint
    assert initial_policy(cfg(None, None)) is None  # the built-in SFT
    with pytest.raises(ConfigError, match="give one"):
        initial_policy(cfg(str(ckpt), str(root / "first")))
