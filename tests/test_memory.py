"""Memory and speed features give the same numbers: chunked LM loss, activation checkpointing,
per-block torch.compile."""
import dataclasses

import pytest
import torch

from conf.errors import ConfigError
from conf.model import TinyModelConfig
from model.chunking import apply_chunking
from model.transformer import Transformer
from trainer.parallelize import checkpoint_blocks, compile_blocks, recompute_modules

CFG = dataclasses.replace(TinyModelConfig(vocab_size=97), engram_min_rows=50)


def _loss_and_grads(model, x, y, doc):
    model.zero_grad()
    out = model(x, labels=y, doc_ids=doc)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_loss_and_grads(plain, other, grad_atol=1e-7):
    """Both models' loss on the batch within 1e-6, and every parameter's gradient (the same set,
    including compressors read by later layers) within rtol 1e-5 and grad_atol."""
    a, ga = _loss_and_grads(plain, *_batch())
    b, gb = _loss_and_grads(other, *_batch())
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert ga.keys() == gb.keys()
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=1e-5, atol=grad_atol, msg=name)


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 97, (2, 65), generator=g)
    y = ids[:, 1:].clone()
    y[0, :5] = -100
    doc = torch.zeros(2, 64, dtype=torch.long)
    doc[1, 30:] = 1
    return ids[:, :-1], y, doc


def test_chunked_loss_equals_full_loss():
    torch.manual_seed(0)
    full = Transformer(CFG)
    chunked = apply_chunking(Transformer(CFG), loss_chunk_tokens=24)  # 128 tokens in 6 uneven chunks
    chunked.load_state_dict(full.state_dict())
    a, ga = _loss_and_grads(full, *_batch())
    b, gb = _loss_and_grads(chunked, *_batch())
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert ga.keys() == gb.keys()
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=1e-5, atol=1e-7, msg=name)


def test_activation_checkpointing_keeps_loss_and_gradients():
    torch.manual_seed(0)
    plain = Transformer(CFG)
    ckpt = Transformer(CFG)
    ckpt.load_state_dict(plain.state_dict())
    assert checkpoint_blocks(ckpt) == CFG.n_layers
    _assert_same_loss_and_grads(plain, ckpt)


def test_checkpointing_the_first_blocks_only_keeps_loss_and_gradients():
    """trainer.checkpointed_layers: the first block recomputes in the backward, the second keeps its
    activations; same loss and gradients as no checkpointing."""
    torch.manual_seed(0)
    plain, part = Transformer(CFG), Transformer(CFG)
    part.load_state_dict(plain.state_dict())
    assert CFG.n_layers >= 2 and checkpoint_blocks(part, 1) == 1
    # the checkpointed block's forward is wrapped, the rest are the modules' own
    assert "forward" in vars(part.layers[0]) and all("forward" not in vars(b) for b in part.layers[1:])
    _assert_same_loss_and_grads(plain, part)
    assert checkpoint_blocks(Transformer(CFG), 0) == 0
    over = CFG.n_layers + 1
    with pytest.raises(ConfigError, match=f"layers={over}: expected 0 to the model's {CFG.n_layers} "):
        checkpoint_blocks(Transformer(CFG), over)


def _train_flops(model) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        _loss_and_grads(model, *_batch())
    return counter.get_total_flops()


def test_recomputing_the_moe_activation_keeps_loss_and_gradients_and_runs_no_matmul_twice():
    """trainer.recompute_modules=[moe_act], after one block checkpointed whole: every other block's
    expert stack recomputes its SwiGLU in the backward (the SwiGLU runs twice as often) but no matmul
    (a training step's FLOPs are those of the plain model; checkpointing a block adds its forward's)."""
    torch.manual_seed(0)
    plain, recomputed = Transformer(CFG), Transformer(CFG)
    recomputed.load_state_dict(plain.state_dict())
    assert checkpoint_blocks(recomputed, 1) == 1
    assert recompute_modules(recomputed, ["moe_act"], start=1) == CFG.n_layers - 1
    _assert_same_loss_and_grads(plain, recomputed)

    def swiglu_calls(model):
        calls = []
        op = type(model.layers[0].moe.experts).swiglu

        def counted(*args, **kwargs):
            calls.append(1)
            return op(*args, **kwargs)
        for block in model.layers:
            block.moe.experts.swiglu = counted
        _loss_and_grads(model, *_batch())
        return len(calls)
    assert swiglu_calls(recomputed) > swiglu_calls(plain)
    whole = Transformer(CFG)
    checkpoint_blocks(whole, 1)
    flops = _train_flops(plain)
    assert _train_flops(recomputed) == _train_flops(whole) > flops
    only_act = Transformer(CFG)
    recompute_modules(only_act, ["moe_act"])
    assert _train_flops(only_act) == flops
    with pytest.raises(ConfigError,
                       match=r"recompute_modules: unknown \['moe'\]; expected some of \['moe_act'\]"):
        recompute_modules(Transformer(CFG), ["moe"])


@pytest.mark.slow
@pytest.mark.extended  # ~25 s of CPU compilation each; the gpu tier compiles the kernel model
@pytest.mark.parametrize("checkpointed, recompute", [(0, []), (2, []), (2, ["moe_act"])],
                         ids=["all", "after-2", "after-2-moe_act"])
def test_compiled_blocks_keep_loss_and_gradients(checkpointed, recompute):
    """trainer.compile, alone and after trainer.checkpointed_layers (the blocks after the checkpointed
    ones compiled), and with trainer.recompute_modules in the compiled blocks. aot_eager traces with
    dynamo and AOT autograd as inductor does, minus the code generation (minutes on 2 cores): what
    this checks is that capture changes nothing."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    plain = Transformer(CFG)
    compiled = Transformer(CFG)
    compiled.load_state_dict(plain.state_dict())
    counters.clear()
    dynamo = torch._dynamo.config
    process_wide = (dynamo.suppress_errors, dynamo.recompile_limit, dynamo.accumulated_recompile_limit)
    try:
        assert checkpoint_blocks(compiled, checkpointed) == checkpointed
        recompute_modules(compiled, recompute, start=checkpointed)
        compiled_blocks = compile_blocks(compiled, backend="aot_eager", start=checkpointed)
        assert compiled_blocks == CFG.n_layers - checkpointed
        for _ in range(2):  # the second pass runs the cached graphs
            _assert_same_loss_and_grads(plain, compiled, grad_atol=1e-6)
        assert counters["stats"]["unique_graphs"] > 0  # dynamo captured graphs, not all frames fell back
        # the blocks' settings (errors suppressed, higher recompile limits) did not leak into the process
        assert (dynamo.suppress_errors, dynamo.recompile_limit,
                dynamo.accumulated_recompile_limit) == process_wide
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("impl, indexer_mode",
                         [("sparse", "sparse"), ("dense", "sparse"), ("sparse", "dense")])
def test_query_chunked_attention_equals_whole_sequence(impl, indexer_mode):
    """Query chunks (uneven: 64 = 24 + 24 + 16) give the same losses, gradients, recall, top-k and
    pool. A small window, top-k and pool make every chunk boundary matter: window rows cross it,
    and the selection is a strict subset of the visible entries."""
    cfg = dataclasses.replace(CFG, window=8, index_topk=4, pool_block=2, pool_blocks=3, attn_impl=impl,
                              indexer_mode=indexer_mode)
    torch.manual_seed(0)
    whole = Transformer(cfg)
    chunked = apply_chunking(Transformer(cfg), attn_chunk_tokens=24)
    chunked.load_state_dict(whole.state_dict())
    a, b = whole(*_batch()[:1], doc_ids=_batch()[2], keep_runtime=True), chunked(
        *_batch()[:1], doc_ids=_batch()[2], keep_runtime=True)
    torch.testing.assert_close(a.logits, b.logits, rtol=1e-5, atol=1e-5)
    assert a.runtime.topk.keys() == b.runtime.topk.keys() and a.runtime.pool.keys() == b.runtime.pool.keys()
    assert a.runtime.pool  # the decoder's pool exists, so Reindex layers ran
    for layer in a.runtime.topk:
        assert torch.equal(a.runtime.topk[layer], b.runtime.topk[layer])
    for layer in a.runtime.pool:
        assert torch.equal(a.runtime.pool[layer], b.runtime.pool[layer])

    ra, ga = _loss_and_grads(whole, *_batch())
    rb, gb = _loss_and_grads(chunked, *_batch())
    torch.testing.assert_close(ra, rb, rtol=1e-6, atol=1e-6)
    assert ga.keys() == gb.keys() and any(".index_query." in n for n in ga)
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():
        oa = whole(*_batch(), collect_recall=True)
        ob = chunked(*_batch(), collect_recall=True)
    assert oa.indexer_loss > 0
    for key in ("indexer_loss", "topk_recall", "pool_recall"):
        torch.testing.assert_close(getattr(oa, key), getattr(ob, key), rtol=1e-5, atol=1e-6, msg=key)
    assert 0 < oa.topk_recall < 1  # the selection drops some attention mass: not a trivial comparison


def test_chunking_applied_again_replaces_the_sizes():
    """apply_chunking is a policy over the plain model: a second application replaces the first
    (bench/system/generate.py shrinks the query chunks per batch and puts them back), and 0 restores the
    plain forward, the class's own methods."""
    cfg = dataclasses.replace(CFG, window=8)
    torch.manual_seed(0)
    model = Transformer(cfg)
    plain = model(*_batch()[:1], doc_ids=_batch()[2]).logits
    apply_chunking(model, attn_chunk_tokens=24, loss_chunk_tokens=24)
    apply_chunking(model, attn_chunk_tokens=16, loss_chunk_tokens=16)
    assert model.head_loss.chunk == 16 and not hasattr(model.head_loss.op, "op")  # not wrapped twice
    assert all(layer.attn.attend_queries.__func__.keywords == {"chunk": 16} for layer in model.layers)
    torch.testing.assert_close(model(*_batch()[:1], doc_ids=_batch()[2]).logits, plain, rtol=1e-5, atol=1e-5)
    apply_chunking(model)
    assert "head_loss" not in vars(model)
    assert not any("attend_queries" in vars(layer.attn) for layer in model.layers)


def test_recomputation_leaves_no_state_behind():
    """With activation checkpointing the backward re-runs every block. Those re-runs must not
    add losses to the runtime or replace the forward's tensors (they would hold the recomputed
    graphs alive, in a reference cycle with the runtime). A pool smaller than the context, so
    the decoder builds one (a pool that would hold every entry is not built)."""
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(CFG, pool_block=2, pool_blocks=3))
    checkpoint_blocks(model)
    x, y, doc = _batch()
    out = model(x, doc_ids=doc, keep_runtime=True)
    rt = out.runtime
    before = {name: dict(getattr(rt, name)) for name in ("kv", "index_k", "topk", "pool")}
    n_aux = len(rt.aux_losses)
    out.logits.gather(-1, y.clamp(min=0).unsqueeze(-1)).sum().backward()
    assert n_aux == CFG.n_layers and len(rt.aux_losses) == n_aux
    for name, entries in before.items():
        assert entries and all(getattr(rt, name)[k] is v for k, v in entries.items()), name


def test_saved_activations_are_counted_once_by_the_module_that_saved_them():
    """bench/system/activation_breakdown.py: x [5, 4] -> Linear(4, 8) -> ReLU -> Linear(8, 2). The first
    linear saves its input for its weight's gradient (5 x 4 fp32 = 80 bytes); ReLU saves its output
    (5 x 8 x 4 = 160), which the second linear saves again as its input (the same storage: counted once,
    against ReLU); the weights (and their transposes) are parameters, not activations."""
    from torch import nn

    from bench.system.activation_breakdown import per_block, saved_bytes_by_module

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(5, 4)
    assert saved_bytes_by_module(model, lambda: model(x).sum()) == {"0": 80, "1": 160}
    # per block: summed over layers.N, the rest by name
    assert per_block({"layers.0.attn": 3, "layers.11.attn": 4, "layers.2": 1, "head": 5, "": 2}) == (
        {"attn": 7, "(block)": 1}, {"head": 5, "(model)": 2})
