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
from trainer.checkpoint import load_model_weights, write_manifest
from trainer.interop.convert import (
    InteropError,
    export_model,
    export_state,
    import_checkpoint,
    import_into_model,
)

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
                "q_weight": engram.hidden_norm_weight, "k_weight": engram.key_norm_weight}[".".join(rest[1:])]
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
    """A tiny model exported, imported into a differently seeded model, exported again with the
    first export as its origin."""
    root = tmp_path_factory.mktemp("interop")
    original = _model(0)
    with torch.no_grad():  # per-copy Engram gate weights: the layout must keep them apart
        for engram in original.engrams.values():
            engram.hidden_norm_weight.normal_(1, 0.1)
            engram.key_norm_weight.normal_(1, 0.1)
    export_model(original, root / "first", log=QUIET)
    imported = _model(1)
    import_into_model(imported, root / "first", log=QUIET)
    export_model(imported, root / "second", origin=root / "first", log=QUIET)
    return root, original, imported


def test_independent_reader_decodes_the_model(exported):
    root, original, imported = exported
    config, tensors = read(root / "first")
    assert (config["dim"], config["n_layers"], config["vocab_size"]) == (CFG.dim, CFG.n_layers, VOCAB)
    assert config["compress_ratios"] == [0, 2, 2, 1, 1, 1] and config["engram_layer_ids"] == [1, 2]
    assert (config["kv_source_layers"], config["index_source_layers"], config["candidate_source_layer"]) == (
        [1, 3], [1, 3, 5], 3)
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
    n_public = sum(1 for k in original.state_dict()
                   if not k.endswith(("lookup_map", ".multipliers", ".load")))
    n_public += CFG.n_layers * 3 * (CFG.n_routed_experts - 1)  # stacked experts are one tensor each
    assert len(covered) == n_public


def test_exported_files_get_the_umask_mode(exported):
    """safetensors alone writes 0600: an export must be as readable as any other file."""
    import os

    root, _, _ = exported
    umask = os.umask(0)
    os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (root / "first").iterdir()}
    assert set(modes.values()) == {0o666 & ~umask}, modes


def test_round_trip_is_exact_and_the_second_export_byte_identical(exported):
    root, _, imported = exported
    _, tensors = read(root / "second")
    for name, value in tensors.items():
        assert torch.equal(value, module_tensor(imported, name).detach().double()), name
    assert _digests(root / "first") == _digests(root / "second")


def test_without_an_origin_the_values_survive_but_not_always_the_bytes(exported, tmp_path):
    """Re-quantising dequantised weights can pick the other form of a block whose largest code is
    half the format's range; the values are the same."""
    root, _, imported = exported
    export_model(imported, tmp_path / "bare", log=QUIET)
    _, first = read(root / "first")
    _, bare = read(tmp_path / "bare")
    assert all(torch.equal(first[n], bare[n]) for n in first)
    first_bytes = load_file(str(next((root / "first").glob("model-00002-*"))))
    bare_bytes = load_file(str(next((tmp_path / "bare").glob("model-00002-*"))))
    scales = [n for n in first_bytes if ".experts." in n and n.endswith(".scale")]
    moved = sum(not torch.equal(first_bytes[n].view(torch.uint8), bare_bytes[n].view(torch.uint8))
                for n in scales)
    assert moved > 0  # FP4 experts: a quarter of Gaussian blocks have the two forms


def test_logits_after_export_and_import(exported):
    root, _, snapped = exported  # weights on the stored grids: the layout holds them exactly
    fresh = _model(2)
    import_into_model(fresh, root / "second", log=QUIET)  # the export of `snapped`
    ids = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = snapped(ids).logits, fresh(ids).logits
    torch.testing.assert_close(got, want, rtol=2**-8, atol=2**-8 * want.abs().max().item())


def _rewrite(src: Path, dst: Path, edit, key: str = "layers.1.attn.wq_a.weight") -> None:
    """Copy a public dir, then edit(tensors of the shard holding `key` (layer 1), index weight_map)."""
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shard = dst / index["weight_map"][key]
    tensors = load_file(str(shard))
    edit(tensors, index["weight_map"], shard.name)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))


def _drop(t, wm, _):
    del t["layers.1.attn.wkv.weight"], wm["layers.1.attn.wkv.weight"]


def _reshape(t, wm, _):
    t["layers.1.attn.q_norm.weight"] = t["layers.1.attn.q_norm.weight"][:-1].clone()


def _retype(t, wm, _):
    t["layers.1.attn.wq_a.weight"] = t["layers.1.attn.wq_a.weight"].float().bfloat16()


def _extra(t, wm, shard):
    t["layers.1.attn.wq_c.weight"], wm["layers.1.attn.wq_c.weight"] = torch.zeros(2, 2), shard


@pytest.mark.parametrize("edit, needle", [
    (_drop, "missing tensor layers.1.attn.wkv.weight"),
    (_reshape, "layers.1.attn.q_norm.weight: shape [63], expected [64]"),
    (_retype, "layers.1.attn.wq_a.weight: dtype BF16, expected F8_E4M3"),
    (_extra, "unexpected tensor layers.1.attn.wq_c.weight"),
])
def test_a_bad_checkpoint_names_the_tensor(exported, tmp_path, edit, needle):
    root, _, _ = exported
    _rewrite(root / "first", tmp_path / "bad", edit)
    with pytest.raises(InteropError, match="does not fit model tiny") as err:
        import_into_model(_model(3), tmp_path / "bad", log=QUIET)
    assert needle in str(err.value) and "\n" not in str(err.value)


def _carry(t, wm, shard):
    """Tensors of modules flashtrain does not train, as a release with a drafter and a vision tower has."""
    extra = {"mtp.0.norm.weight": torch.arange(4.0).bfloat16(), "vision.patch.weight": torch.randn(3, 5),
             "image_start": torch.ones(CFG.dim).bfloat16(), "layers.1.ffn.gate.bias_vl": torch.zeros(8)}
    for name, value in extra.items():
        t[name], wm[name] = value, shard


def test_tensors_flashtrain_does_not_train_are_named_once_and_carried_through(exported, flashtrain, tmp_path):
    root, _, imported = exported
    _rewrite(root / "first", tmp_path / "pub", _carry)
    config = json.loads((tmp_path / "pub" / "config.json").read_text())
    config.update(n_mtp_layers=1, dspark_block_size=5, compress_ratios=config["compress_ratios"] + [0],
                  vision_n_layers=2, image_token_id=7)
    (tmp_path / "pub" / "config.json").write_text(json.dumps(config))
    said = []
    model = _model(4)
    import_into_model(model, tmp_path / "pub", log=said.append)
    assert len(said) == 1 and "4 tensors of modules flashtrain does not train" in said[0], said
    assert "mtp" in said[0] and "vision" in said[0] and "image_start" in said[0] and "bias_vl" in said[0]
    assert torch.equal(model.layers[1].attn.wq_a.weight, imported.layers[1].attn.wq_a.weight)
    # drafter=none (the CLI's): the drafter, which this model's dspark_* keys do not size, is carried
    import_checkpoint(tmp_path / "pub", tmp_path / "imp" / "checkpoints", CFG, log=QUIET, drafter=False)
    p = flashtrain("convert", "model=tiny", f"export={tmp_path / 'out'}", f"checkpoint={tmp_path / 'imp'}",
                   f"hydra.run.dir={tmp_path / 'exp'}", cache=False)
    assert p.returncode == 0, p.stderr[-3000:]
    source = {n: v for f in (tmp_path / "pub").glob("*.safetensors") for n, v in load_file(str(f)).items()}
    out = {n: v for f in (tmp_path / "out").glob("*.safetensors") for n, v in load_file(str(f)).items()}
    assert sorted(out) == sorted(source)
    for name, value in source.items():  # every tensor, carried or trained-and-untouched, byte for byte
        assert (value.dtype == out[name].dtype
                and torch.equal(value.view(torch.uint8), out[name].view(torch.uint8))), name
    exported_config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported_config == config


def test_an_imported_checkpoints_public_folder_is_not_taken_for_the_weights(exported, tmp_path):
    root, _, _ = exported
    ckpt = import_checkpoint(root / "first", tmp_path / "checkpoints", CFG, log=QUIET)
    with pytest.raises(InteropError, match="described but not held .* give the checkpoint itself"):
        import_into_model(_model(9), ckpt / "public", log=QUIET)


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
    assert "config.json index_topk=64 (absent: the public default) but the model has 32" in str(err.value)


# ------------------------------------------------------------------ the DSpark drafter (mtp.*)
def drafter_tensor(drafter, name: str) -> torch.Tensor:
    """The drafter tensor a public mtp.<i>.* name describes, by module attribute (model/dspark.py)."""
    _, i, *rest = name.split(".")
    key = ".".join(rest)
    heads = {"main_proj.weight": drafter.main_proj.weight, "main_norm.weight": drafter.main_norm.weight,
             "norm.weight": drafter.norm.weight, "markov_head.embed.weight": drafter.markov.w1.weight,
             "markov_head.head.weight": drafter.markov.w2.weight,
             "confidence_head.proj.weight": drafter.confidence.proj.weight}
    return heads[key] if key in heads else module_tensor(drafter, f"layers.{i}.{key}")


def _draft_logits(target, drafter, ids):
    """Draft logits (Markov bias added, the true previous token) and confidence logits [B, A, K(, V)]
    at three anchors of ids [B, N], from the target's taps."""
    from model.dspark import TapRecorder

    B, N = ids.shape
    anchors = torch.tensor([4, 9, 15])
    with TapRecorder(target, drafter.taps) as rec, torch.no_grad():
        target(ids)
        context = drafter.context(rec.take())
        pos = torch.arange(N).expand(B, N)
        a = anchors[None, :, None]
        visible = (pos[:, None] < a) & (pos[:, None] >= a - CFG.window)
        hidden = drafter.hidden(target.embed, context, visible, pos, ids[:, anchors], anchors.expand(B, -1))
        prev = ids[:, anchors[:, None] + torch.arange(drafter.block)]
        bias, markov = drafter.markov(prev)
        return drafter.base_logits(target.head, hidden) + bias, drafter.confidence(hidden, markov)


@pytest.fixture(scope="module")
def drafted(tmp_path_factory):
    """A tiny target with a tiny drafter exported, imported (convert import's checkpoint and drafter
    dir), and exported again from the import with the imported drafter."""
    from model.dspark import DSpark
    from trainer.checkpoint import model_state
    from trainer.dspark import load_drafter

    root = tmp_path_factory.mktemp("mtp")
    target = _model(0)
    torch.manual_seed(10)
    original = DSpark(CFG).eval()
    with torch.no_grad():  # trained-looking heads and selection biases (a fresh drafter has zeros)
        original.markov.w2.weight.normal_(0, 0.02)
        original.confidence.proj.weight.normal_(0, 0.02)
        for layer in original.layers:
            layer.moe.router.bias.normal_(0, 0.1)
    export_model(target, root / "first", drafter=original, log=QUIET)
    ckpt = import_checkpoint(root / "first", root / "imp" / "checkpoints", CFG, log=QUIET)
    imported = load_drafter(str(root / "imp" / "checkpoints" / "drafter"), CFG, "rl.drafter")
    export_state(model_state(ckpt), root / "second", CFG, origin=ckpt / "public", log=QUIET,
                 drafter=imported.state_dict())
    return root, target, original, imported


def _mtp(root: Path) -> dict[str, torch.Tensor]:
    return {n: v for f in root.glob("*.safetensors") for n, v in load_file(str(f)).items()
            if n.startswith("mtp.")}


def test_mtp_tensors_are_the_drafters_in_the_public_layout(drafted):
    root, _, original, imported = drafted
    config, tensors = read(root / "first")
    assert (config["n_mtp_layers"], config["dspark_block_size"], config["dspark_target_layer_ids"]) == (
        3, 5, [3, 4, 5])
    assert (config["dspark_noise_token_id"], config["dspark_markov_rank"], config["dspark_n_routed_experts"],
            config["dspark_n_activated_experts"]) == (VOCAB - 1, 16, 8, 2)
    assert config["compress_ratios"] == [0, 2, 2, 1, 1, 1, 0, 0, 0]  # the drafter's blocks: window only
    mtp = {n: v for n, v in tensors.items() if n.startswith("mtp.")}
    for name, value in mtp.items():
        assert torch.equal(value, drafter_tensor(imported, name).detach().double()), name
        source = drafter_tensor(original, name).detach().double()
        err = ((value - source).norm() / source.norm().clamp(min=1e-12)).item()
        assert err < (0.15 if ".experts." in name else 0.04), f"{name}: relative error {err:.3g}"
    n_public = sum(1 for k in original.state_dict() if not k.endswith(".load"))
    n_public += len(original.layers) * 3 * (CFG.dspark_routed_experts - 1)  # experts stacked per weight
    assert len(mtp) == n_public
    stored = _mtp(root / "first")
    assert stored["mtp.0.main_proj.weight"].dtype == torch.float8_e4m3fn
    assert stored["mtp.0.main_proj.weight"].shape == (CFG.dim, 3 * CFG.dim)
    assert stored["mtp.0.main_proj.scale"].shape == (CFG.dim // 32, 3 * CFG.dim // 32)
    assert stored["mtp.1.ffn.experts.0.w1.weight"].dtype == torch.float4_e2m1fn_x2
    for name in ("markov_head.embed", "markov_head.head", "confidence_head.proj", "norm"):
        assert stored[f"mtp.2.{name}.weight"].dtype == torch.bfloat16, name
    assert stored["mtp.2.markov_head.head.weight"].shape == (VOCAB, CFG.dspark_markov_rank)
    assert not any(k.startswith(("mtp.1.main_", "mtp.0.norm.", "mtp.0.markov")) or "hc_head" in k
                   for k in stored)


def test_mtp_export_import_export_is_byte_identical(drafted):
    root, _, _, _ = drafted
    first, second = _mtp(root / "first"), _mtp(root / "second")
    assert sorted(first) == sorted(second)
    for name, value in first.items():
        assert value.dtype == second[name].dtype and torch.equal(value.view(torch.uint8),
                                                                 second[name].view(torch.uint8)), name
    assert json.loads((root / "second" / "config.json").read_text()) == json.loads(
        (root / "first" / "config.json").read_text())


def test_without_a_drafter_an_imported_checkpoint_exports_its_origins_drafter_as_stored(drafted, tmp_path):
    """`drafter` unset: the import's public/ folder keeps the mtp.* tensors as the source stored them."""
    from trainer.checkpoint import model_state

    root, _, _, _ = drafted
    ckpt = root / "imp" / "checkpoints" / "step_00000000"
    export_state(model_state(ckpt), tmp_path / "auto", CFG, origin=ckpt / "public", log=QUIET)
    auto, first = _mtp(tmp_path / "auto"), _mtp(root / "first")
    assert sorted(auto) == sorted(first) and all(
        torch.equal(v.view(torch.uint8), first[n].view(torch.uint8)) for n, v in auto.items())
    assert (tmp_path / "auto" / "config.json").read_text() == (root / "first" / "config.json").read_text()
    export_state(model_state(ckpt), tmp_path / "none", CFG, origin=ckpt / "public", log=QUIET,
                 origin_drafter=False)
    assert not _mtp(tmp_path / "none")


def test_an_imported_drafters_draft_logits_equal_the_originals(drafted):
    """The imported drafter (its weights on the stored grids, so the layout holds them exactly) against
    the drafter imported from its export, for rl.drafter given a public directory."""
    from trainer.dspark import load_drafter

    root, target, original, imported = drafted
    again = load_drafter(str(root / "second"), CFG, "rl.drafter")
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    want, got = _draft_logits(target, imported, ids), _draft_logits(target, again, ids)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    before = _draft_logits(target, original, ids)[0]  # before quantisation: close, not equal
    assert 0 < ((want[0] - before).norm() / before.norm()).item() < 0.1


def _drop_markov(t, wm, _):
    del t["mtp.2.markov_head.head.weight"], wm["mtp.2.markov_head.head.weight"]


def _v4_names(t, wm, shard):
    """DeepSeek-V4-Flash's drafter: an hc_head output mix and markov_w1/w2."""
    for old, new in (("embed", "markov_w1"), ("head", "markov_w2")):
        t[f"mtp.2.markov_head.{new}.weight"] = t.pop(f"mtp.2.markov_head.{old}.weight")
        wm[f"mtp.2.markov_head.{new}.weight"] = wm.pop(f"mtp.2.markov_head.{old}.weight")
    t["mtp.2.hc_head_fn"], wm["mtp.2.hc_head_fn"] = torch.zeros(4, 4 * CFG.dim), shard


def _narrow_proj(t, wm, _):
    t["mtp.0.main_proj.weight"] = t["mtp.0.main_proj.weight"][:, :2 * CFG.dim].clone()


def _extra_block(t, wm, shard):
    t["mtp.3.attn_norm.weight"], wm["mtp.3.attn_norm.weight"] = torch.ones(CFG.dim).bfloat16(), shard


@pytest.mark.parametrize("edit, key, needles", [
    (_drop_markov, "mtp.2.norm.weight", ["missing tensor mtp.2.markov_head.head.weight"]),
    (_v4_names, "mtp.2.norm.weight", ["unexpected tensor mtp.2.hc_head_fn",
                                      "unexpected tensor mtp.2.markov_head.markov_w1.weight",
                                      "DeepSeek-V4-Flash's drafter layout"]),
    (_narrow_proj, "mtp.0.main_proj.weight",
     ["mtp.0.main_proj.weight: shape [128, 256], expected [128, 384]"]),
    (_extra_block, "mtp.2.norm.weight", ["unexpected tensor mtp.3.attn_norm.weight"]),
])
def test_a_malformed_drafter_names_the_tensor_in_one_line(drafted, tmp_path, edit, key, needles):
    root, _, _, _ = drafted
    _rewrite(root / "first", tmp_path / "bad", edit, key)
    with pytest.raises(InteropError, match="does not fit model tiny") as err:
        import_checkpoint(tmp_path / "bad", tmp_path / "imp", CFG, log=QUIET)
    assert all(n in str(err.value) for n in needles) and "\n" not in str(err.value), str(err.value)
    assert not (tmp_path / "imp").exists()


def test_a_drafter_config_that_differs_is_named(drafted, tmp_path):
    root, _, _, _ = drafted
    shutil.copytree(root / "first", tmp_path / "pub")
    config = json.loads((tmp_path / "pub" / "config.json").read_text())
    config.update(dspark_markov_rank=8, dspark_target_layer_ids=[4, 2, 3], compress_ratios=config[
        "compress_ratios"][:-1])
    del config["dspark_block_size"]
    (tmp_path / "pub" / "config.json").write_text(json.dumps(config))
    with pytest.raises(InteropError) as err:
        import_checkpoint(tmp_path / "pub", tmp_path / "imp", CFG, log=QUIET)
    msg = str(err.value)
    assert "config.json dspark_markov_rank=8 but the drafter has 16 (model.dspark_markov_rank)" in msg
    assert "config.json dspark_target_layer_ids=[2, 3, 4] but the drafter has [3, 4, 5]" in msg
    assert "dspark_block_size=0 (absent: the public default) but the drafter has 5" in msg
    assert "compress_ratios past n_layers=6 are [0, 0]" in msg and "\n" not in msg


def test_mtp_through_the_cli(drafted, flashtrain, tmp_path):
    """convert import writes the drafter's checkpoints dir; export with it gives the release back;
    drafter=none leaves it out."""
    root, _, _, _ = drafted
    p = flashtrain("convert", "model=tiny", f"model.vocab_size={VOCAB}", f"import={root / 'first'}",
                   f"hydra.run.dir={tmp_path / 'imp'}", cache=False)
    assert p.returncode == 0, p.stderr[-3000:]
    drafter = tmp_path / "imp" / "checkpoints" / "drafter"
    assert f"rl.drafter={drafter}" in p.stdout and (drafter / "step_00000000" / "manifest.json").is_file()
    export = ("convert", "model=tiny", f"model.vocab_size={VOCAB}", f"checkpoint={tmp_path / 'imp'}")
    for name, extra in (("with", f"drafter={drafter}"), ("none", "drafter=none")):
        p = flashtrain(*export, f"export={tmp_path / name}", extra, f"hydra.run.dir={tmp_path / name}_run",
                       cache=False)
        assert p.returncode == 0, p.stderr[-3000:]
    assert _digests(tmp_path / "with") == _digests(root / "first")  # encoded at the origin's scales
    config = json.loads((tmp_path / "none" / "config.json").read_text())
    assert not _mtp(tmp_path / "none") and config["n_mtp_layers"] == 0 and len(config["compress_ratios"]) == 6
    assert not any(k.startswith("dspark_") for k in config)
    p = flashtrain(*export, "drafter=/nonexistent", f"export={tmp_path / 'x'}",
                   f"hydra.run.dir={tmp_path / 'ex'}", cache=False)
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("flashtrain: error:")]
    assert p.returncode == 2 and len(errors) == 1 and "drafter=/nonexistent" in errors[0], p.stderr[-2000:]


# ------------------------------------------------------------------ the CLI and training
@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    for d in range(8):
        lines = [f"{a} + {b} = {a + b}."
                 for a, b in ((rng.randint(0, 99), rng.randint(0, 99)) for _ in range(150))]
        (root / f"doc{d}.txt").write_text("\n".join(lines))
    return ["data=files", f"data.path={root}", f"data.vocab_size={VOCAB}", "data.val_fraction=0.1",
            f"model.vocab_size={VOCAB}"]


def test_imported_checkpoint_then_cli_export_is_byte_identical(exported, flashtrain, tmp_path):
    root, _, imported = exported
    # what `convert import=` runs
    import_checkpoint(root / "first", tmp_path / "imp" / "checkpoints", CFG, log=QUIET)
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


def test_rl_and_distill_take_their_policy_from_model_init_from(exported, tmp_path):
    """rl/run.py's initial_policy (flashtrain distill's student goes through it too)."""
    from types import SimpleNamespace

    from rl.run import initial_policy

    root, _, _ = exported
    cfg = lambda init: SimpleNamespace(model=SimpleNamespace(init_from=init))  # noqa: E731
    assert initial_policy(cfg(str(root / "first"))) == str(root / "first")  # the trainers import it
    ckpt = import_checkpoint(root / "first", tmp_path / "checkpoints", CFG, log=QUIET)
    assert initial_policy(cfg(str(tmp_path))) == str(ckpt)  # a run dir: its newest checkpoint
    assert initial_policy(cfg(None)) is None  # the built-in SFT


# ------------------------------------------------------------------ the source's own encodings
def _other_form(t, wm, _):
    """The layer-1 shard rewritten as another quantiser may have written it: every block that its
    halved scale represents exactly stored at that scale (doubled codes), and the head in fp32."""
    from trainer.interop.codec import decode, encode

    for name in [n for n in t if n.endswith(".scale")]:
        weight = name.rsplit(".", 1)[0] + ".weight"
        enc = "fp4_expert" if ".experts." in name else "fp8_row" if ".engram.embed." in name else "fp8_block"
        values = decode(enc, {"": t[weight], "scale": t[name]})
        lower = (t[name].view(torch.uint8).int() - 1).clamp(min=1).to(torch.uint8)
        other = encode(enc, values, scale_hint=lower)
        t[weight], t[name] = other[""], other["scale"]


def test_weights_in_another_quantisers_form_import_and_reexport_byte_identical(exported, flashtrain,
                                                                               tmp_path):
    root, _, imported = exported
    _rewrite(root / "first", tmp_path / "pub", _other_form)
    top = next((tmp_path / "pub").glob("model-00001-*"))
    tensors = load_file(str(top))
    tensors["head.weight"] = tensors["head.weight"].float()  # a source that keeps its head in fp32
    save_file(tensors, str(top), metadata={"format": "pt"})
    layer1 = json.loads((root / "first" / "model.safetensors.index.json").read_text())["weight_map"][
        "layers.1.attn.wq_a.weight"]
    changed, original = load_file(str(tmp_path / "pub" / layer1)), load_file(str(root / "first" / layer1))
    assert sum(not torch.equal(changed[n].view(torch.uint8), original[n].view(torch.uint8))
               for n in changed) > 10
    model = _model(8)
    import_into_model(model, tmp_path / "pub", log=QUIET)  # the same values
    for name, value in imported.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    import_checkpoint(tmp_path / "pub", tmp_path / "imp" / "checkpoints", CFG, log=QUIET)
    p = flashtrain("convert", "model=tiny", f"export={tmp_path / 'out'}", f"checkpoint={tmp_path / 'imp'}",
                   f"hydra.run.dir={tmp_path / 'exp'}", cache=False)
    assert p.returncode == 0, p.stderr[-3000:]
    digests = _digests(tmp_path / "out")
    assert {k: v for k, v in digests.items() if k.endswith(".safetensors")} == {
        k: v for k, v in _digests(tmp_path / "pub").items() if k.endswith(".safetensors")}


def test_an_export_without_its_origin_says_how_to_go_on(exported, flashtrain, tmp_path):
    root, _, _ = exported
    shutil.copytree(root / "first", tmp_path / "pub")
    run = tmp_path / "run" / "checkpoints" / "step_00000001"
    import_checkpoint(tmp_path / "pub", tmp_path / "imp" / "checkpoints", CFG, log=QUIET)
    shutil.copytree(tmp_path / "imp" / "checkpoints" / "step_00000000", run)
    shutil.rmtree(run / "public")
    (run / "origin.json").write_text(json.dumps({"origin": str(tmp_path / "gone")}))
    write_manifest(run, 1)
    args = ("convert", "model=tiny", f"export={tmp_path / 'out'}", f"checkpoint={run}",
            f"hydra.run.dir={tmp_path / 'e'}")
    p = flashtrain(*args, cache=False)
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("flashtrain: error:")]
    assert p.returncode == 2 and len(errors) == 1 and "origin=none" in errors[0], p.stderr[-2000:]
    p = flashtrain(*args, f"origin={tmp_path / 'pub'}", cache=False)
    assert p.returncode == 0, p.stderr[-2000:]
    assert {k: v for k, v in _digests(tmp_path / "out").items() if k.endswith(".safetensors")} == {
        k: v for k, v in _digests(root / "first").items() if k.endswith(".safetensors")}
    # without an origin an imported checkpoint has no tokenizer: the run's tokenizer must be named
    p = flashtrain(*args, "origin=none", f"export={tmp_path / 'out2'}", cache=False)
    assert p.returncode == 2 and "tokenizer=" in p.stderr, p.stderr[-2000:]


# ------------------------------------------------------------------ config.json
# The reference ModelArgs' field names (inference/model.py): the public code builds ModelArgs(**config).
REFERENCE_FIELDS = {
    "max_batch_size", "max_seq_len", "temperature", "dtype", "expert_dtype", "vocab_size", "dim",
    "moe_inter_dim", "n_layers", "n_mtp_layers", "n_heads", "n_routed_experts", "n_shared_experts",
    "n_activated_experts", "score_func", "gate_temp", "norm_topk_prob", "route_scale", "swiglu_limit",
    "q_lora_rank", "head_dim", "rope_head_dim", "norm_eps", "o_groups", "o_lora_rank", "window_size",
    "compress_ratios", "kv_source_layers", "index_source_layers", "compress_rope_theta", "original_seq_len",
    "rope_theta", "rope_factor", "beta_fast", "beta_slow", "index_n_heads", "index_head_dim", "index_topk",
    "candidate_source_layer", "candidate_topk_blocks", "candidate_block_size", "hc_mult", "hc_sinkhorn_iters",
    "hc_eps", "engram_layer_ids", "engram_num_embeddings", "engram_max_ngram_size", "engram_vocab_size",
    "engram_n_heads", "engram_head_dim", "engram_pad_id", "engram_compressed_vocab_size",
}


def _primes_from(start: int, count: int) -> list[int]:
    """The `count` smallest primes >= start, by trial division (what the public code searches)."""
    found, n = [], start
    while len(found) < count:
        if n > 1 and all(n % d for d in range(2, int(n**0.5) + 1)):
            found.append(n)
        n += 1
    return found


def test_config_has_the_public_fields_and_meanings(exported):
    root, _, _ = exported
    config = json.loads((root / "first" / "config.json").read_text())
    assert set(config) <= REFERENCE_FIELDS, set(config) - REFERENCE_FIELDS
    # per layer, the rows of its 3 orders x 2 heads; the primes handed out from engram_vocab_size up
    primes = _primes_from(config["engram_vocab_size"], 12)
    assert primes[0] > CFG.engram_min_rows
    assert config["engram_num_embeddings"] == [sum(primes[:6]), sum(primes[6:])]
    assert (config["engram_max_ngram_size"] == 4 and config["engram_n_heads"] == 2
            and config["engram_head_dim"] == 32)
    assert config["engram_compressed_vocab_size"] == VOCAB  # the identity map of a model built without one
    assert config["norm_eps"] == CFG.norm_eps and config["original_seq_len"] == CFG.original_seq_len


def test_a_plan_the_public_config_cannot_state_is_refused():
    from conf.errors import ConfigError
    from trainer.interop.layout import public_config

    cfg = dataclasses.replace(CFG, n_layers=7, n_encoder_layers=3,
                              layer_modes=["swa", "full", "reuse", "full", "reindex", "full", "reindex"],
                              compress_ratios=[0, 2, 2, 1, 1, 1, 1])
    model = Transformer(cfg)
    with pytest.raises(ConfigError, match="each build a candidate pool"):
        public_config(cfg, model.plan, VOCAB, {})


# ------------------------------------------------------------------ exports of trained checkpoints
@pytest.mark.slow
def test_a_pretraining_checkpoint_exports_and_reimports_byte_identically(flashtrain, corpus, tmp_path):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    run = tmp_path / "run"
    p = flashtrain("pretrain", *FAST, *corpus, "trainer.max_steps=2", "trainer.save_every=2",
                   "trainer.torch_threads=1", f"hydra.run.dir={run}")
    assert p.returncode == 0, p.stderr[-3000:]
    p = flashtrain("convert", "model=tiny", f"model.vocab_size={VOCAB}", f"export={tmp_path / 'out'}",
                   f"checkpoint={run}", f"hydra.run.dir={tmp_path / 'e1'}", cache=False)
    assert p.returncode == 0, p.stderr[-3000:]
    out = tmp_path / "out"
    config = json.loads((out / "config.json").read_text())
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert config["engram_pad_id"] == tok.token_to_id("<|pad|>")
    hf = AutoTokenizer.from_pretrained(str(out))  # what the public code loads the tokenizer with
    assert len(hf) == tok.get_vocab_size() and hf.convert_tokens_to_ids("<|pad|>") == config["engram_pad_id"]
    p = flashtrain("convert", "model=tiny", f"model.vocab_size={VOCAB}", f"import={out}",
                   f"hydra.run.dir={tmp_path / 'imp'}", cache=False)
    assert p.returncode == 0, p.stderr[-3000:]
    p = flashtrain("convert", "model=tiny", f"model.vocab_size={VOCAB}", f"export={tmp_path / 'again'}",
                   f"checkpoint={tmp_path / 'imp'}", f"hydra.run.dir={tmp_path / 'e2'}", cache=False)
    assert p.returncode == 0, p.stderr[-3000:]
    assert _digests(tmp_path / "again") == _digests(out)

    # a run started from the public directory (lr 0: its weights stay the imported ones) exports
    # byte-identically too: its checkpoints name the directory as their origin
    cont = tmp_path / "cont"
    p = flashtrain("pretrain", *FAST, *corpus, f"model.init_from={out}", "trainer.max_steps=1", "optim.lr=0",
                   "model.bias_update_speed=0", "trainer.torch_threads=1", f"hydra.run.dir={cont}")
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"weights from {out}" in p.stdout, p.stdout[-2000:]
    ckpt = cont / "checkpoints" / "step_00000001"
    assert json.loads((ckpt / "origin.json").read_text()) == {"origin": str(out.resolve())}
    p = flashtrain("convert", "model=tiny", f"model.vocab_size={VOCAB}", f"export={tmp_path / 'cont_out'}",
                   f"checkpoint={cont}", f"hydra.run.dir={tmp_path / 'e3'}", cache=False)
    assert p.returncode == 0, p.stderr[-3000:]
    # the step added zero updates, which can turn a -0 weight into +0: bytes differ only there
    for shard in sorted(out.glob("*.safetensors")):
        before, after = load_file(str(shard)), load_file(str(tmp_path / "cont_out" / shard.name))
        for name, t in before.items():
            a, b = t.contiguous().view(torch.uint8), after[name].contiguous().view(torch.uint8)
            if t.dtype == torch.float4_e2m1fn_x2:  # nibbles
                a, b = torch.stack((a & 15, a >> 4)), torch.stack((b & 15, b >> 4))
                zero_signs = {(8, 0), (0, 8)}
            else:
                zero_signs = {(128, 0), (0, 128)}
            pairs = {(int(x), int(y)) for x, y in zip(a[a != b].tolist(), b[a != b].tolist())}
            assert pairs <= zero_signs, (name, sorted(pairs)[:5])


@pytest.mark.slow
def test_zero3_and_zero0_checkpoints_of_the_same_weights_export_alike(flashtrain, corpus, tmp_path):
    """ZeRO-3 keeps no whole weights in its model file; export gathers them from the optimiser shards.
    With lr 0 both runs hold their initial weights, which the seed fixes."""
    for stage in (0, 3):
        run = tmp_path / f"z{stage}"
        p = flashtrain("pretrain", *FAST, *corpus, "optim=adamw", "optim.lr=0", "model.bias_update_speed=0",
                       f"trainer.zero_stage={stage}", "trainer.max_steps=1", "trainer.torch_threads=1",
                       f"hydra.run.dir={run}")
        assert p.returncode == 0, p.stderr[-3000:]
        p = flashtrain("convert", "model=tiny", f"model.vocab_size={VOCAB}",
                       f"export={tmp_path / f'out{stage}'}",
                       f"checkpoint={run}", f"hydra.run.dir={tmp_path / f'e{stage}'}", cache=False)
        assert p.returncode == 0, p.stderr[-3000:]
    assert _digests(tmp_path / "out3") == _digests(tmp_path / "out0")


def test_vision_tensors_export_in_the_public_layout_and_round_trip_byte_for_byte(tmp_path):
    """A tiny model with a vision tower: its tower goes out under the public names (vision.*, aligner.*,
    image_start/end/newline, layers.N.ffn.gate.bias_vl), comes back into another model, and a second
    export with the first as origin writes those tensors byte-identical."""
    cfg = dataclasses.replace(CFG, vision_n_layers=1, image_token_id=3)
    torch.manual_seed(0)
    original = Transformer(cfg).eval()
    with torch.no_grad():
        for layer in original.layers:
            layer.moe.router.bias_vl.normal_(0, 0.1)
    export_model(original, tmp_path / "first", log=QUIET)
    first = {n: v for f in (tmp_path / "first").glob("*.safetensors") for n, v in load_file(str(f)).items()}
    vision = sorted(n for n in first if n.startswith(("vision.", "aligner.", "image_")) or "bias_vl" in n)
    block = "vision.blocks.0."
    names = {"vision.patch_embed.proj.weight", "vision.patch_embed.proj.bias", "vision.norm.weight",
             *(block + n for n in ("attn.wqkv.weight", "attn.wqkv.bias", "attn.wo.weight", "mlp.w1.weight",
                                   "mlp.w2.weight", "norm1.weight")),
             "aligner.w1.weight", "aligner.w2.bias", "image_start", "image_end", "image_newline",
             "layers.0.ffn.gate.bias_vl"}
    assert names <= set(vision)
    assert first["vision.blocks.0.attn.wqkv.weight"].shape == (3 * cfg.vision_dim, cfg.vision_dim)
    assert first["aligner.w1.weight"].shape == (cfg.dim, 9 * cfg.vision_dim)
    assert first["layers.0.ffn.gate.bias_vl"].dtype == torch.float32
    config = json.loads((tmp_path / "first" / "config.json").read_text())
    assert config["vision_n_layers"] == 1 and config["image_token_id"] == 3
    torch.testing.assert_close(first["vision.blocks.0.attn.wqkv.weight"].float(),
                               original.visual.vision.blocks[0].attn.wqkv.weight.bfloat16().float())

    torch.manual_seed(1)
    imported = Transformer(cfg).eval()
    import_into_model(imported, tmp_path / "first", log=QUIET)
    assert torch.equal(imported.layers[2].moe.router.bias_vl, original.layers[2].moe.router.bias_vl)
    assert torch.equal(imported.visual.image_newline, original.visual.image_newline.bfloat16().float())
    export_model(imported, tmp_path / "second", origin=tmp_path / "first", log=QUIET)
    second = {n: v for f in (tmp_path / "second").glob("*.safetensors") for n, v in load_file(str(f)).items()}
    for name in vision:
        assert first[name].dtype == second[name].dtype, name
        assert torch.equal(first[name].view(torch.uint8), second[name].view(torch.uint8)), name
    with pytest.raises(InteropError, match="vision_n_layers=1 but the model has 2"):
        other = Transformer(dataclasses.replace(cfg, vision_n_layers=2))
        import_into_model(other, tmp_path / "first", log=QUIET)
