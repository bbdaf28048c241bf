"""model.kernels=true: the whole model with Triton sparse attention and indexer scoring gives
the reference model's losses and gradients (CPU: Triton's interpreter, fp32)."""
import dataclasses

import pytest
import torch

from conf.model import IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START, TEXT, TinyModelConfig
from model.chunking import apply_chunking
from model.ops import OPS, KernelPolicy
from model.transformer import Transformer
from model.vision import ImageBatch

# norm_eps far from hc_eps and near the streams' mean square (~4e-4 at init): the fused mHC steps
# must normalise with norm_eps, as HyperConnection.project does, or the logits differ by ~2x
CFG = dataclasses.replace(TinyModelConfig(vocab_size=97), engram_min_rows=50, window=16, index_topk=8,
                          pool_block=2, pool_blocks=4, attn_impl="sparse", norm_eps=1e-3)


def _batch(device="cpu"):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 97, (2, 33), generator=g)
    doc = torch.zeros(2, 32, dtype=torch.long)
    doc[1, 20:] = 1
    return ids[:, :-1].to(device), ids[:, 1:].to(device), doc.to(device)


def _with_kernels(model: Transformer) -> Transformer:
    """What model.kernels=true builds: every fused op's kernel swapped in (model/ops.py)."""
    return KernelPolicy(OPS).apply(model)


def _run(model, x, y, doc):
    model.zero_grad()
    out = model(x, labels=y, doc_ids=doc)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _one_program_tiles(monkeypatch):
    """Large tiles for the interpreter, whose cost follows the number of programs and loop steps;
    the small tiles each kernel also runs have their own tests. Sparse attention takes the latent
    (C = 64) in one chunk a program; the stream mixes (tests/test_kernels_stream_mix.py) and the
    fused mHC steps (tests/test_kernels_mhc.py) one program a call (64 tokens x dim 128): here they
    were a third and a quarter of the interpreter's time."""
    import model.kernels.mhc as mhc
    import model.kernels.sparse_attention as sa
    import model.kernels.stream_mix as sm

    monkeypatch.setattr(sa, "_FIXED", dict(sa._FIXED, BLOCK_C=64, BLOCK_CV=64))
    for name, size in (("_MIX_T", 64), ("_MIX_D", 128), ("_RED_T", 64), ("_RED_D", 128)):
        monkeypatch.setattr(sm, name, size)
    resolved = mhc.MHCKernelConfig.resolved

    def one_tile(self, dtype, narrow_io=False):
        return dataclasses.replace(resolved(self, dtype, narrow_io), fwd_block_t=64, bwd_block_t=64,
                                   fwd_block_d=128, bwd_block_d=128)

    monkeypatch.setattr(mhc.MHCKernelConfig, "resolved", one_tile)


def _assert_same_losses_and_grads(a, ga, b, gb):
    for key in ("lm_loss", "balance_loss", "indexer_loss"):
        torch.testing.assert_close(getattr(b, key), getattr(a, key), rtol=1e-4, atol=1e-5, msg=key)
    assert a.indexer_loss > 0 and ga.keys() == gb.keys()
    for name in ga:
        torch.testing.assert_close(gb[name], ga[name], rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.slow
# the one-chunk variant (the RoPE folded into one pass) is the same model comparison on another
# code path: it runs in the extended tier and on the GPU, to keep the default suite in its budget
@pytest.mark.parametrize("chunk", [16, pytest.param(0, marks=pytest.mark.extended)],
                         ids=["query-chunks", "one-chunk-rope-folded"])
def test_kernels_match_the_reference_model(monkeypatch, chunk):
    """Query chunks of 16 (two per sequence) so the window crosses a chunk boundary too, or one
    chunk, where the attention call applies q's RoPE and undoes out's (q_angles); loss
    chunks of 24 tokens (the fused head + loss, and the reference's checkpointed chunks)."""
    _one_program_tiles(monkeypatch)
    torch.manual_seed(0)
    ref = apply_chunking(Transformer(CFG), chunk, 24)
    ker = apply_chunking(_with_kernels(Transformer(CFG)), chunk, 24)
    ker.load_state_dict(ref.state_dict())
    a, ga = _run(ref, *_batch())
    b, gb = _run(ker, *_batch())
    _assert_same_losses_and_grads(a, ga, b, gb)


def _image_text_batch():
    """Two rows of 32: row 0 an image of 6 x 5 patches (2 x 2 tokens, span 8) at 3, row 1 the same
    size at 9 and one of 2 x 2 patches (1 x 1 token, span 4) at 24; the rest text, labels -100 on
    the spans (as data/images.py and data/sft.py lay them out), two documents in row 1."""
    g = torch.Generator().manual_seed(1)
    span = {(2, 2): [IMAGE_START, IMAGE, IMAGE, IMAGE_NEW_LINE, IMAGE, IMAGE, IMAGE_NEW_LINE, IMAGE_END],
            (1, 1): [IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END]}
    types = torch.full((2, 32), TEXT)
    grids, rows, starts = [], [], []
    for row, start, tokens, grid in ((0, 3, (2, 2), (6, 5)), (1, 9, (2, 2), (6, 5)), (1, 24, (1, 1), (2, 2))):
        types[row, start:start + len(span[tokens])] = torch.tensor(span[tokens])
        grids.append(grid)
        rows.append(row)
        starts.append(start)
    ids = torch.randint(0, 97, (2, 33), generator=g)
    x = torch.where(types >= 0, 0, ids[:, :-1])
    y = torch.where(types >= 0, -100, ids[:, 1:])
    doc = torch.zeros(2, 32, dtype=torch.long)
    doc[1, 20:] = 1
    patches = [torch.randn(h * w, 3, 7, 7, generator=g) for h, w in grids]
    return x, y, doc, types, ImageBatch(patches, grids, rows, starts)


def _image_text_models_agree(device: str) -> None:
    torch.manual_seed(0)
    cfg = dataclasses.replace(CFG, vision_n_layers=2)
    with torch.device(device):
        ref = apply_chunking(Transformer(cfg), 16, 24)
        ker = apply_chunking(_with_kernels(Transformer(cfg)), 16, 24)
    ker.load_state_dict(ref.state_dict())
    x, y, doc, types, images = _image_text_batch()
    x, y, doc, types, images = x.to(device), y.to(device), doc.to(device), types.to(device), images.to(device)
    # the spans' own selection bias differs from the text one, so routing by the wrong bias shows;
    # both are distinct per expert, so no token ties between two experts within rounding
    experts = torch.arange(cfg.n_routed_experts, dtype=torch.float32, device=device)
    for model in (ref, ker):
        for block in model.layers:
            block.moe.router.bias.copy_(1e-3 * experts)
            block.moe.router.bias_vl.copy_(0.1 * experts.flip(0))

    def run(model):
        model.zero_grad()
        out = model(x, labels=y, doc_ids=doc, token_types=types, images=images)
        out.loss.backward()
        return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    a, ga = run(ref)
    b, gb = run(ker)
    _assert_same_losses_and_grads(a, ga, b, gb)
    assert any(n.startswith("visual.vision.") for n in ga) and ga["visual.image_newline"].abs().sum() > 0
    routers = [(r.load_vl.clone(), r.load.clone()) for r in ref.routers()]
    assert all(torch.equal(lv, kr.load_vl) and torch.equal(lt, kr.load)
               for (lv, lt), kr in zip(routers, ker.routers()))
    assert routers[0][0].sum() == int((types >= 0).sum()) * cfg.n_activated_experts


@pytest.mark.slow
@pytest.mark.extended  # ~30 s in the interpreter; its GPU twin below runs in the gpu tier
def test_kernels_match_the_reference_model_on_an_image_text_batch(monkeypatch):
    """model.kernels on and off give the same losses and gradients with image spans in the batch:
    the vision tower's norms take the RMSNorm kernel, span tokens route with bias_vl through the
    fused experts, the fused mHC schedule's Engram layers start n-grams after a span and add no
    memory on it, and the fused head + loss ignores the spans' -100 labels (CPU: Triton's
    interpreter, fp32). Query chunks of 16, loss chunks of 24."""
    _one_program_tiles(monkeypatch)
    _image_text_models_agree("cpu")


@pytest.mark.gpu
def test_kernels_match_the_reference_model_on_an_image_text_batch_on_gpu():
    """The same on CUDA with the kernels' own tiles, fp32."""
    _image_text_models_agree("cuda")


@pytest.mark.parametrize("ops", [OPS, ("rms_norm",)], ids=["all", "rms_norm-only"])
def test_kernels_need_a_gpu_or_the_interpreter(monkeypatch, ops):
    """One clear error before the first kernel launches, whichever op that is, and whether or not
    the kernel modules were first imported under the interpreter (this test alone imports them
    without it)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = KernelPolicy(ops).apply(Transformer(CFG))
    x, y, doc = _batch()
    with pytest.raises(RuntimeError, match="needs a CUDA device .* the input is on cpu"):
        model(x, labels=y, doc_ids=doc)


@pytest.mark.gpu
@pytest.mark.parametrize("fp32_residual", [True, False], ids=["fp32-streams", "bf16-streams"])
def test_kernels_match_the_reference_model_on_gpu(fp32_residual):
    """bf16 autocast on CUDA, as training runs: losses within bf16 tolerance, and the kernels'
    gradient no further from the fp32 reference model's than bf16 noise puts the reference
    model itself under autocast (the two are of the same size, ~5e-2 relative L2; in fp32 without
    autocast the kernels agree with the reference to ~1e-6). With bf16 streams
    (model.fp32_residual=false) both models hold the streams in bf16; the target stays the fp32 model."""
    torch.manual_seed(0)
    cfg = dataclasses.replace(CFG, window=128, index_topk=64, pool_block=8, pool_blocks=8,
                              fp32_residual=fp32_residual)
    with torch.device("cuda"):
        ref = Transformer(cfg)
        ker = _with_kernels(Transformer(cfg))
    ker.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 97, (2, 1025), generator=g).cuda()

    def run(model, autocast: bool):
        model.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = model(ids[:, :-1], labels=ids[:, 1:])
        out.loss.backward()
        # one gradient vector: single small tensors (sinks, biases) and experts whose routing
        # flips under bf16 noise are too noisy one by one
        return out, torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])

    _, exact = run(ref, autocast=False)
    out_ref, grad_ref = run(ref, autocast=True)
    out_ker, grad_ker = run(ker, autocast=True)
    for key in ("lm_loss", "indexer_loss"):
        a, b = getattr(out_ref, key).float(), getattr(out_ker, key).float()
        assert abs(a - b) <= 2e-2 * abs(a) + 1e-4, (key, a.item(), b.item())
    err_ref = ((grad_ref - exact).norm() / exact.norm()).item()
    err_ker = ((grad_ker - exact).norm() / exact.norm()).item()
    print(f"fp32_residual={fp32_residual}: gradient relative L2 from fp32, reference {err_ref:.4f}, kernels "
          f"{err_ker:.4f}")
    assert err_ker < 1.5 * err_ref, (err_ker, err_ref)


@pytest.mark.gpu
def test_compiled_kernel_model_matches_eager_on_gpu():
    """trainer.compile (inductor) around the Triton kernels, fp32 so the only difference is
    inductor's fused arithmetic: losses and gradients equal eager's to fp32 rounding."""
    from trainer.parallelize import compile_blocks

    torch.manual_seed(0)
    cfg = dataclasses.replace(CFG, window=128, index_topk=64, pool_block=8, pool_blocks=8)
    with torch.device("cuda"):
        eager = _with_kernels(Transformer(cfg))
        compiled = _with_kernels(Transformer(cfg))
    # Routing is a discontinuity that rounding may cross: with these weights one token of layer 5
    # ties exactly between its 2nd and 3rd expert, so the expert it gets (and the gradients) would
    # follow the rounding of whichever kernel configs inductor's timing picks. Distinct selection
    # biases, the same in both models, break such ties by far more than any rounding.
    for block in eager.layers:
        block.moe.router.bias.copy_(1e-3 * torch.arange(cfg.n_routed_experts, device="cuda"))
    compiled.load_state_dict(eager.state_dict())
    compile_blocks(compiled)
    ids = torch.randint(0, 97, (2, 1025), generator=torch.Generator().manual_seed(0)).cuda()
    try:
        for _ in range(2):
            grads = []
            for model in (eager, compiled):
                model.zero_grad()
                out = model(ids[:, :-1], labels=ids[:, 1:])
                out.loss.backward()
                grads.append((out.loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()
                                                           if p.grad is not None])))
            (la, ga), (lb, gb) = grads
            torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)
            assert ((ga - gb).norm() / ga.norm()).item() < 1e-4
    finally:
        torch._dynamo.reset()
