"""The `flash` config is the published model: ARCHITECTURE.md §1 and §4 numbers from a meta-device build."""
import json

import torch

from conf.model import FlashModelConfig
from model.kv_layout import GlobalKVLayout
from model.plan import build_layer_plan
from tests.conftest import cli_env, run_cli


def test_inspect_flash_matches_spec(port_base, cli_zygote):
    p = run_cli(cli_zygote, ["inspect", "model=flash", "inspect.json=true"], cli_env(port_base()),
                timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads(p.stdout.strip().splitlines()[-1])
    assert abs(s["total_params"] / 552e9 - 1) < 0.02, s
    assert abs(s["engram_params"] / 196.1e9 - 1) < 0.01, s
    # the public tower: 32 blocks of 4 * 1024^2 + 3 * 1024 * 2816 weights (+ biases, norms), the patch
    # embedding 588 -> 1024, the projector 9216 -> 5120 -> 5120, three 5120-d delimiters
    blocks = 32 * (4 * 1024**2 + 4 * 1024 + 3 * 1024 * 2816 + 2 * 1024)
    tower = blocks + 588 * 1024 + 1024 + 1024 + 9216 * 5120 + 5120 + 5120 * 5120 + 5120 + 3 * 5120
    assert s["vision_params"] == tower, s
    assert abs(s["active_prefill_params"] / 8e9 - 1) < 0.05, s
    assert abs(s["active_decode_params"] / 16e9 - 1) < 0.05, s
    assert s["kv_bytes_per_token"] == 890
    assert s["build_seconds"] < 60


def test_kv_layout_bytes_follow_the_plan_and_formats():
    cfg = FlashModelConfig()
    layout = GlobalKVLayout.of(cfg, build_layer_plan(cfg))
    assert layout.sources == ((2, 2), (8, 2), (14, 2), (20, 1))
    buffers = layout.allocate(1000, device="meta")
    per_entry = {name: t.shape[-1] for name, t in buffers[20].items()}
    # 512 E2M1 values in 256 bytes + 32 E4M3 scales; 128 E2M1 in 64 bytes + 4 E8M0 scales
    assert per_entry == {"kv_codes": 256, "kv_scales": 32, "index_k_codes": 64, "index_k_scales": 4}
    assert buffers[2]["kv_codes"].shape[1] == 500 and buffers[20]["kv_codes"].shape[1] == 1000
    # a plan with one more m=2 owner costs half an entry (178 bytes) more per token
    modes = [s.mode for s in build_layer_plan(cfg).layers]
    modes[3] = "full"
    plan = build_layer_plan(FlashModelConfig(layer_modes=modes))
    assert GlobalKVLayout.of(cfg, plan).bytes_per_token() == 890 + 178


def test_flash_builds_on_meta_with_the_published_shapes():
    with torch.device("meta"):
        from model.transformer import Transformer

        model = Transformer(FlashModelConfig())
    attn = model.layers[20].attn
    assert tuple(attn.wq_a.weight.shape) == (1280, 5120)
    assert tuple(attn.wq_b.weight.shape) == (64 * 512, 1280)
    assert tuple(attn.wo_a.shape) == (8, 1024, 4096)
    assert tuple(attn.wo_b.weight.shape) == (5120, 8192)
    assert tuple(attn.index_query.wq_b.weight.shape) == (32 * 128, 1280)
    assert tuple(attn.index_key.wk.weight.shape) == (128, 512)
    assert attn.compressor.wgate is None and model.layers[2].attn.compressor.wgate is not None
    assert model.layers[21].attn.compressor is None and model.layers[24].attn.index_key is None
    moe = model.layers[0].moe
    assert tuple(moe.experts.w1.shape) == (384, 2304, 5120) and moe.router.topk == 6
    assert tuple(model.engrams["1"].proj.weight.shape) == (5 * 5120, 3 * 8 * 256)
    assert model.layers[0].attn_hc.fn.shape == (4 + 4 + 16, 4 * 5120)


def test_indexer_flops_count_the_scoring_once_and_the_kl_backward_at_the_selection():
    """Hand count, 8 positions, top-k 4, ratio 1: query t sees t entries (mean 4.5) and selects
    min(t, 4) (mean 3.25); a Reindex pool of 2 entries scores min(t, 2) (mean 1.875). One entry
    costs 2 * heads * dim = 2 * 2 * 3 = 12 FLOPs forward; the selection takes no gradient, the
    KL's backward at the selected entries costs twice the forward there."""
    from types import SimpleNamespace

    from model.accounting import attention_flops_per_token, indexer_train_flops_per_token

    cfg = SimpleNamespace(index_heads=2, index_dim=3, index_topk=4, pool_blocks=1, pool_block=2,
                          window=2, n_heads=5, kv_dim=7)
    layer = lambda mode: SimpleNamespace(mode=mode, compress_ratio=1)  # noqa: E731
    plan = lambda *modes: SimpleNamespace(layers=[layer(m) for m in modes])  # noqa: E731
    assert indexer_train_flops_per_token(cfg, plan("full"), 8) == 12 * (4.5 + 2 * 3.25)
    assert indexer_train_flops_per_token(cfg, plan("reindex"), 8) == 12 * (1.875 + 2 * 3.25)
    assert indexer_train_flops_per_token(cfg, plan("swa", "reuse"), 8) == 0
    # attention: window keys min(t, 2) (mean 1.875) plus the selected entries, 4 * heads * dim a key
    assert attention_flops_per_token(cfg, plan("swa"), 8) == 4 * 5 * 7 * 1.875
    assert attention_flops_per_token(cfg, plan("reuse"), 8) == 4 * 5 * 7 * (1.875 + 3.25)
