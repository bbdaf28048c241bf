"""CSA2 reference tests: sparse == dense, the layer plan, Reuse/Reindex plumbing, the pool."""
import dataclasses

import pytest
import torch

from conf.model import FlashModelConfig, TinyModelConfig
from model.csa import dense_attention, sparse_attention
from model.indexer import candidate_pool, select_topk
from model.plan import build_layer_plan
from model.runtime import AttentionRuntime, document_starts
from model.transformer import Transformer


def tiny(**kw):
    return dataclasses.replace(TinyModelConfig(vocab_size=97), **kw)


# ---------------------------------------------------------------- plan
def test_flash_layer_plan_matches_spec():
    plan = build_layer_plan(FlashModelConfig())
    modes = [s.mode for s in plan.layers]
    assert modes[:2] == ["swa", "swa"]
    assert [i for i, m in enumerate(modes) if m == "full"] == [2, 8, 14, 20]
    assert [i for i, m in enumerate(modes) if m == "reindex"] == [24, 28, 32, 36]
    assert plan.kv_sources == [2, 8, 14, 20]
    assert plan.index_sources == [2, 8, 14, 20, 24, 28, 32, 36]
    assert plan.pool_builders == [20]
    assert [s.compress_ratio for s in plan.layers] == [0, 0] + [2] * 18 + [1] * 20
    assert all(s.kv_source == 20 for s in plan.layers[20:])
    assert plan[13].index_source == 8 and plan[27].index_source == 24 and plan[39].index_source == 36
    assert [s.layer_id for s in plan.layers if s.engram] == [1, 14]


def test_tiny_plan_has_every_mode():
    plan = build_layer_plan(tiny())
    assert [s.mode for s in plan.layers] == ["swa", "full", "reuse", "full", "reuse", "reindex"]
    assert [s.compress_ratio for s in plan.layers] == [0, 2, 2, 1, 1, 1]
    assert plan.pool_builders == [3] and plan[5].kv_source == 3 and plan[4].index_source == 3


def test_explicit_plan_and_bad_plans():
    plan = build_layer_plan(tiny(n_layers=8, layer_modes=["swa", "full", "reuse", "full", "reindex", "reuse",
                                                          "full", "reuse"],
                                 compress_ratios=[0, 2, 2, 1, 1, 1, 2, 2]))
    assert plan.kv_sources == [1, 3, 6] and plan.pool_builders == [3]
    with pytest.raises(ValueError, match="before any full layer"):
        build_layer_plan(tiny(n_layers=8, layer_modes=["swa", "reuse"] + ["full"] * 6,
                              compress_ratios=[0] + [2] * 7))
    with pytest.raises(ValueError, match="compress ratio"):
        build_layer_plan(tiny(n_layers=8, layer_modes=["swa", "full", "reuse"] + ["full"] * 5,
                              compress_ratios=[0, 2, 1] + [2] * 5))


# ---------------------------------------------------------------- sparse == dense
def _random_case(B=2, T=40, H=3, C=16, m=2, k=6, window=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, C, generator=g, dtype=torch.float64)
    win = torch.randn(B, T, C, generator=g, dtype=torch.float64)
    S = T // m
    glob = torch.randn(B, S, C, generator=g, dtype=torch.float64)
    doc_ids = torch.zeros(B, T, dtype=torch.long)
    doc_ids[-1, 17:] = 1  # the last row packs two documents
    rt = AttentionRuntime(B, T, torch.device("cpu"), doc_ids)
    scores = torch.randn(B, T, S, generator=g).masked_fill(~rt.visible(m), float("-inf"))
    idx = select_topk(scores, k)
    sink = torch.randn(H, generator=g)
    return q, win, glob, idx, rt.doc_start, sink, window


def test_sparse_attention_equals_dense_masked_attention():
    q, win, glob, idx, doc_start, sink, window = _random_case()
    assert (idx == -1).any() and (idx >= 0).any()  # both padding and real entries are exercised
    for t in (q, win, glob):
        t.requires_grad_(True)
    out_s, p_s = sparse_attention(q, win, glob, idx, doc_start, sink, 0.25, window)
    grads_s = torch.autograd.grad(out_s.square().sum(), (q, win, glob))
    out_d, p_d = dense_attention(q, win, glob, idx, doc_start, sink, 0.25, window)
    grads_d = torch.autograd.grad(out_d.square().sum(), (q, win, glob))
    torch.testing.assert_close(out_s, out_d, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(p_s, p_d, rtol=1e-6, atol=1e-6)
    for gs, gd in zip(grads_s, grads_d):
        torch.testing.assert_close(gs, gd, rtol=1e-6, atol=1e-6)


def test_compiled_sparse_attention_has_eager_gradients():
    """trainer.compile with model.kernels=false traces sparse_attention. Its window keys overlap
    (query t reads rows t-W+1 .. t); an unfold's gradient under inductor on a CPU (torch 2.13)
    came out wrong by more than the gradient's own norm, so the keys are gathered by index."""
    q, win, glob, idx, doc_start, sink, _ = _random_case(T=64, window=16)
    q, win, glob = (t.float().requires_grad_(True) for t in (q, win, glob))

    def grads(fn):
        out, p = fn(q, win, glob, idx, doc_start, sink, 0.25, 16)
        return (out, p) + torch.autograd.grad(out.square().sum() + p.sum(), (q, win, glob))

    want = grads(sparse_attention)
    torch._dynamo.reset()
    try:
        got = grads(torch.compile(sparse_attention))
    finally:
        torch._dynamo.reset()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_attention_is_one_softmax_over_window_selection_and_sink():
    """Hand-built check of the formula on one query: window keys, selected keys and the sink
    share the normaliser."""
    q, win, glob, idx, doc_start, sink, window = _random_case(B=1, T=30, H=2, C=4, k=3, window=5)
    out, _ = sparse_attention(q, win, glob, idx, doc_start, sink, 0.5, window)
    t = 29
    keys = ([win[0, s] for s in range(t - window + 1, t + 1)]
            + [glob[0, j] for j in idx[0, t].tolist() if j >= 0])
    K = torch.stack(keys)  # [n, C]
    for h in range(2):
        logits = torch.cat((K @ q[0, t, h] * 0.5, sink[h].double().view(1)))
        p = logits.softmax(0)[:-1]
        torch.testing.assert_close(out[0, t, h], p @ K)


def test_no_attention_across_documents():
    q, win, glob, idx, doc_start, sink, window = _random_case()
    out, _ = sparse_attention(q, win, glob, idx, doc_start, sink, 0.25, window)
    # changing everything of document 0 in row 1 must not move document 1's outputs
    win2, glob2 = win.clone(), glob.clone()
    win2[1, :17] += 5.0
    glob2[1, :9] += 5.0  # entries 0..8 cover tokens 0..17 (entry 8 straddles the boundary)
    out2, _ = sparse_attention(q, win2, glob2, idx, doc_start, sink, 0.25, window)
    torch.testing.assert_close(out[1, 17:], out2[1, 17:])
    assert not torch.allclose(out[1, :17], out2[1, :17])


def test_document_starts():
    doc = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, 2, 2, 2]])
    assert document_starts(doc).tolist() == [[0, 0, 2, 2, 2, 5], [0, 1, 1, 3, 3, 3]]


# ---------------------------------------------------------------- indexer and pool
def test_select_topk_sorted_padded_and_causal():
    rt = AttentionRuntime(1, 12, torch.device("cpu"))
    scores = torch.randn(1, 12, 6).masked_fill(~rt.visible(2), float("-inf"))
    idx = select_topk(scores, 4)
    assert idx.shape == (1, 12, 4)
    for t in range(12):
        row = idx[0, t]
        real = row[row >= 0]
        assert len(real) == min(4, (t + 1) // 2)
        assert (real < (t + 1) // 2).all()  # visibility (t+1)//m
        assert real.tolist() == sorted(real.tolist())
        assert (row[len(real):] == -1).all()  # padding after the real entries


def _kl_row_by_row(p_sel, idx, iq, iw, keys):
    """indexer_kl written out one query at a time, in fp64: KL(normalised attention mass ||
    softmax of the index scores) over the selected ids, queries without mass skipped, / B*T."""
    from model.indexer import index_scores_at

    scores = index_scores_at(iq, iw, keys, idx)
    total = scores.new_zeros((), dtype=torch.float64)
    B, T, _ = idx.shape
    for b in range(B):
        for t in range(T):
            p = p_sel[b, t].double()
            if p.sum() == 0:
                continue
            ok = idx[b, t] >= 0
            target = p[ok] / p.sum()
            log_q = torch.log_softmax(scores[b, t][ok].double(), -1)
            keep = target > 0
            total = total + (target[keep] * (target[keep].log() - log_q[keep])).sum()
    return total / (B * T)


def test_indexer_kl_matches_a_row_by_row_kl():
    """Rows with no attention mass add nothing, -1 ids are left out, and the loss and the
    indexer inputs' gradients match the per-query fp64 formula."""
    from model.attention import indexer_kl

    g = torch.Generator().manual_seed(5)
    B, T, k, S, Hi, Di = 2, 6, 5, 9, 3, 4
    idx = torch.randint(0, S, (B, T, k), generator=g)
    idx[0, 1, 3:] = -1
    idx[1, 4] = -1  # nothing selected
    p_sel = torch.rand(B, T, k, generator=g).masked_fill(idx < 0, 0.0)
    p_sel[0, 2] = 0.0  # selected entries, but no mass on them
    p_sel[1, 0, 1] = 0.0  # one selected entry without mass
    inputs = [torch.randn(B, T, Hi, Di, generator=g), torch.rand(B, T, Hi, generator=g),
              torch.randn(B, S, Di, generator=g)]
    got_in = [x.clone().requires_grad_() for x in inputs]
    want_in = [x.double().requires_grad_() for x in inputs]
    got = indexer_kl(p_sel, idx, *got_in)
    want = _kl_row_by_row(p_sel, idx, *want_in)
    got.backward()
    want.backward()
    assert want > 0
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)
    for a, b in zip(got_in, want_in):
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-4, atol=1e-6)


def test_indexer_kl_without_mass_is_zero_and_still_connected():
    from model.attention import indexer_kl

    iq = torch.randn(1, 3, 2, 4, requires_grad=True)
    iw = torch.rand(1, 3, 2, requires_grad=True)
    keys = torch.randn(1, 5, 4, requires_grad=True)
    idx = torch.tensor([[[0, 1], [2, -1], [-1, -1]]])
    loss = indexer_kl(torch.zeros(1, 3, 2), idx, iq, iw, keys)
    loss.backward()
    assert loss.item() == 0.0
    for x in (iq, iw, keys):
        assert x.grad is not None and torch.isfinite(x.grad).all() and not x.grad.any()


def test_candidate_pool_keeps_newest_block_and_top_blocks():
    T = 64
    rt = AttentionRuntime(1, T, torch.device("cpu"))
    scores = torch.full((1, T, T), -5.0).masked_fill(~rt.visible(1), float("-inf"))
    scores[0, :, 3] = 10.0  # block 0 is the best
    scores[0, :, 20] = 9.0  # block 2 second
    pool = candidate_pool(scores.masked_fill(~rt.visible(1), float("-inf")), rt.newest_visible(1), 8, 2)
    t = 63  # newest block 7 forced, then the best block 0
    assert sorted(set(pool[0, t].tolist())) == list(range(0, 8)) + list(range(56, 64))
    t = 30  # newest block 3 forced + block 0 (block 2 is third)
    assert sorted(p for p in pool[0, t].tolist() if p >= 0) == list(range(0, 8)) + list(range(24, 31))
    assert (pool[0, 30] > 30).sum() == 0


def _run_with_runtime(model, x, doc_ids=None):
    captured = {}
    orig = AttentionRuntime.__init__

    def init(self, *a, **kw):
        orig(self, *a, **kw)
        captured["rt"] = self

    AttentionRuntime.__init__ = init
    try:
        model(x, doc_ids=doc_ids)
    finally:
        AttentionRuntime.__init__ = orig
    return captured["rt"]


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    cfg = tiny(engram_layers=[], index_topk=8, pool_blocks=3, pool_block=4, window=16)
    return Transformer(cfg).eval()


def test_reuse_reads_source_indices_and_only_full_layers_allocate_kv(tiny_model):
    x = torch.randint(0, 97, (2, 64), generator=torch.Generator().manual_seed(1))
    seen = {}
    hooks = []
    for layer in tiny_model.layers:
        def hook(mod, args, out, layer_id=layer.spec.layer_id):
            seen[layer_id] = {"topk": dict(args[1].topk), "kv": set(args[1].kv)}
        hooks.append(layer.attn.register_forward_hook(hook))
    rt = _run_with_runtime(tiny_model, x)
    for h in hooks:
        h.remove()
    plan = tiny_model.plan
    assert set(rt.kv) == set(plan.kv_sources) == set(rt.index_k)
    assert set(rt.topk) == set(plan.index_sources)
    for spec in plan.layers:
        if spec.mode in ("reuse", "reindex"):
            before = seen[spec.layer_id - 1]["kv"] if spec.layer_id else set()
            assert seen[spec.layer_id]["kv"] == before  # wrote no KV of its own
        if spec.mode == "reuse":
            # the indices it attended with are its source's, object for object
            assert seen[spec.layer_id]["topk"][spec.index_source] is rt.topk[spec.index_source]
            assert spec.layer_id not in rt.topk


def test_only_layers_with_an_indexer_loss_ask_for_selected_probabilities():
    """The kernel's p_sum epilogue runs only where indexer_kl reads it: layers with their own indexer
    query (Full, Reindex), in training with labels. Reuse and SWA layers never ask."""
    torch.manual_seed(0)
    model = Transformer(tiny(engram_layers=[], index_topk=8, pool_blocks=3, pool_block=4, window=16))
    asked = {}
    for layer in model.layers:
        def attend(*args, _inner=layer.attn.attend, _id=layer.spec.layer_id, want_probs=True):
            asked.setdefault(_id, []).append(want_probs)
            return _inner(*args, want_probs=want_probs)
        layer.attn.attend = attend
    x = torch.randint(0, 97, (2, 65), generator=torch.Generator().manual_seed(1))
    model.train()
    out = model(x[:, :-1], labels=x[:, 1:])
    assert out.indexer_loss > 0
    for spec in model.plan.layers:
        assert asked[spec.layer_id] == [spec.mode in ("full", "reindex")], (spec.layer_id, spec.mode)
    asked.clear()
    model.eval()
    with torch.no_grad():
        model(x[:, :-1], labels=x[:, 1:])
    assert all(v == [False] for v in asked.values())


def test_reindex_selects_only_inside_the_pool(tiny_model):
    x = torch.randint(0, 97, (2, 64), generator=torch.Generator().manual_seed(2))
    rt = _run_with_runtime(tiny_model, x)
    (builder,) = tiny_model.plan.pool_builders
    pool = rt.pool[builder]
    reindex = [s.layer_id for s in tiny_model.plan.layers if s.mode == "reindex"]
    assert reindex and pool.shape[-1] == 12
    for layer in reindex:
        idx = rt.topk[layer]
        inside = (idx.unsqueeze(-1) == pool.unsqueeze(-2)).any(-1)
        assert (inside | (idx < 0)).all()
    # queries late in the sequence have more visible entries than the pool holds
    visible = rt.visible(1)[0, -1].sum().item()
    assert visible > 12


def test_reindex_scores_densely_when_the_pool_keeps_every_block(monkeypatch):
    """16 blocks of 4 cover all 64 entries: every block survives, so Reindex scores every visible
    entry densely instead of gathering the pool's keys; it must select what the gathered pool
    selects (two documents, so the pool and the dense mask both drop the other document)."""
    from model.attention import CSA2Attention

    torch.manual_seed(0)
    model = Transformer(tiny(engram_layers=[], index_topk=8, pool_blocks=16, pool_block=4, window=16)).eval()
    x = torch.randint(0, 97, (2, 64), generator=torch.Generator().manual_seed(4))
    doc = torch.zeros(2, 64, dtype=torch.long)
    doc[1, 40:] = 1
    reindex = [s.layer_id for s in model.plan.layers if s.mode == "reindex"]
    dense_calls = []
    real = CSA2Attention.pool_is_every_entry

    def spy(self, n):
        dense_calls.append(real(self, n))
        return dense_calls[-1]

    monkeypatch.setattr(CSA2Attention, "pool_is_every_entry", spy)
    fast = _run_with_runtime(model, x, doc)
    assert reindex and dense_calls and all(dense_calls)
    monkeypatch.setattr(CSA2Attention, "pool_is_every_entry", lambda self, n: False)
    gathered = _run_with_runtime(model, x, doc)
    for layer in reindex:
        torch.testing.assert_close(fast.topk[layer], gathered.topk[layer], rtol=0, atol=0)
        assert (fast.topk[layer] >= 0).any()
    assert not fast.pool and gathered.pool  # no pool is built when it would hold every entry


@pytest.mark.parametrize("indexer_mode", ["sparse", "dense"])
def test_pool_recall_and_warmup_loss_without_a_built_pool(monkeypatch, indexer_mode):
    """With no pool built (it would hold every entry), the pool recall and the dense warm-up's
    Reindex KL read every visible entry: the same values as with the gathered pool."""
    from model.attention import CSA2Attention

    torch.manual_seed(0)
    model = Transformer(tiny(engram_layers=[], index_topk=8, pool_blocks=16, pool_block=4, window=16,
                             indexer_mode=indexer_mode)).train()
    ids = torch.randint(0, 97, (2, 65), generator=torch.Generator().manual_seed(6))

    def run():
        return model(ids[:, :-1], labels=ids[:, 1:], collect_recall=True)

    fast = run()
    monkeypatch.setattr(CSA2Attention, "pool_is_every_entry", lambda self, n: False)
    gathered = run()
    assert fast.pool_recall is not None and fast.indexer_loss > 0
    torch.testing.assert_close(fast.pool_recall, gathered.pool_recall, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(fast.indexer_loss, gathered.indexer_loss, rtol=1e-6, atol=1e-7)


def test_position_dropped_from_pool_is_unreachable(tiny_model):
    """Give one early position the highest index score a Reindex layer could assign, but keep it
    out of layer 20's (here: the decoder Full layer's) pool: the Reindex layer never selects it."""
    model = tiny_model
    (builder,) = model.plan.pool_builders
    reindex = next(s.layer_id for s in model.plan.layers if s.mode == "reindex")
    x = torch.randint(0, 97, (1, 64), generator=torch.Generator().manual_seed(3))
    rt = _run_with_runtime(model, x)
    last_pool = set(rt.pool[builder][0, -1].tolist())
    target = next(p for p in range(64) if p not in last_pool)  # dropped for the last query
    # boost the Reindex score of `target` so that it would win wherever it is a candidate
    from model.attention import CSA2Attention

    layers = [m for m in model.modules() if isinstance(m, CSA2Attention)]
    orig_scores_at = layers[0].scores_at

    def scores_at(q, w, k, cand):
        s = orig_scores_at(q, w, k, cand)
        return s.masked_fill(cand == target, 1e9)  # would win if it were a candidate

    for layer in layers:
        layer.scores_at = scores_at
    try:
        rt2 = _run_with_runtime(model, x)
    finally:
        for layer in layers:
            layer.scores_at = orig_scores_at
    dropped = ~(rt2.pool[builder][0] == target).any(-1) & rt2.visible(1)[0, :, target]
    assert dropped.any()
    assert not (rt2.topk[reindex][0][dropped] == target).any()
    kept = (rt2.pool[builder][0] == target).any(-1)
    if kept.any():  # where it is in the pool, the boost makes it selected
        assert (rt2.topk[reindex][0][kept] == target).any(-1).all()


# ---------------------------------------------------------------- KV QAT
def test_qat_stores_exactly_what_the_cache_packs_and_passes_gradients():
    from model.quant import pack_kv_fp4, pack_mxfp4, unpack_kv_fp4, unpack_mxfp4

    torch.manual_seed(0)
    model = Transformer(tiny(engram_layers=[], kv_quant="qat", kv_dim=64, index_dim=32))
    x = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(4))
    rt = _run_with_runtime(model, x)
    for layer in model.plan.kv_sources:
        kv, ik = rt.kv[layer].detach(), rt.index_k[layer].detach()
        assert torch.equal(unpack_kv_fp4(*pack_kv_fp4(kv)), kv)  # already on the FP4 grid
        assert torch.equal(unpack_mxfp4(*pack_mxfp4(ik)), ik)
    out = model(x[:, :-1], labels=x[:, 1:])
    out.loss.backward()
    for layer in model.plan.kv_sources:
        g = model.layers[layer].attn.compressor.wkv.weight.grad
        assert g is not None and g.abs().sum() > 0  # the straight-through estimator lets it through
    off = Transformer(tiny(engram_layers=[], kv_quant="off", kv_dim=64, index_dim=32))
    off.load_state_dict(model.state_dict())
    rt_off = _run_with_runtime(off, x)
    layer = model.plan.kv_sources[0]
    assert not torch.equal(rt_off.kv[layer], rt.kv[layer])  # qat really changes the stored values


def test_gather_rows_and_blocked_scores_match_plain_indexing(monkeypatch):
    """The fast gather (index_select) and the query-blocked indexer scores against advanced
    indexing and one-shot einsums, values and gradients."""
    import model.indexer as indexer
    from model.numerics import gather_rows
    g = torch.Generator().manual_seed(3)
    B, T, S, H, D, P = 2, 7, 11, 3, 5, 4
    k = torch.randn(B, S, D, generator=g, requires_grad=True)
    q = torch.randn(B, T, H, D, generator=g, requires_grad=True)
    w = torch.randn(B, T, H, generator=g)
    cand = torch.randint(-1, S, (B, T, P), generator=g)
    plain = k[torch.arange(B)[:, None, None], cand.clamp(min=0)]
    torch.testing.assert_close(gather_rows(k, cand.clamp(min=0)), plain, rtol=0, atol=0)

    def reference():
        logits = torch.einsum("bthd,btpd->btph", q, plain).relu()
        at = torch.einsum("btph,bth->btp", logits, w).masked_fill(cand < 0, float("-inf"))
        full = torch.einsum("bths,bth->bts", torch.einsum("bthd,bsd->bths", q, k).relu(), w)
        return at, full

    at_ref, full_ref = reference()
    gq_ref, gk_ref = torch.autograd.grad(at_ref.masked_fill(cand < 0, 0).sum() + full_ref.sum(), (q, k))
    monkeypatch.setattr(indexer, "SCORE_BLOCK_ELEMENTS", 2 * B * H * S)  # blocks of 2 and 3 queries (uneven)
    at = indexer.index_scores_at(q, w, k, cand)
    full = indexer.index_scores(q, w, k)
    torch.testing.assert_close(at, at_ref)
    torch.testing.assert_close(full, full_ref)
    gq, gk = torch.autograd.grad(at.masked_fill(cand < 0, 0).sum() + full.sum(), (q, k))
    torch.testing.assert_close(gq, gq_ref)
    torch.testing.assert_close(gk, gk_ref)


def test_topk_ties_go_to_the_lowest_ids_whatever_the_width():
    """Training scores every entry of the sequence, decoding only the entries so far: the same
    query must pick the same entries, so ties (ReLU zeros) are broken by position, not by
    torch.topk's internals, and extra invisible columns change nothing."""
    from model.indexer import select_topk, topk_ids
    scores = torch.tensor([[[0.0, 2.0, 0.0, 0.0, 1.0, 0.0]]])
    ids, vals = topk_ids(scores, 4)
    assert ids.tolist() == [[[0, 1, 2, 4]]] and vals.tolist() == [[[0.0, 2.0, 0.0, 1.0]]]
    g = torch.Generator().manual_seed(0)
    narrow = torch.randint(0, 3, (2, 5, 40), generator=g).float()  # many ties
    wide = torch.cat((narrow, torch.full((2, 5, 60), float("-inf"))), dim=-1)
    assert torch.equal(select_topk(narrow, 16), select_topk(wide, 16))
    few = narrow[..., :10].clone()
    few[..., 3:] = float("-inf")  # fewer visible entries than k: the rest is -1
    assert ((select_topk(few, 8)[..., 3:] == -1).all()
            and (select_topk(few, 8)[..., :3] == torch.arange(3)).all())


@pytest.mark.gpu
@pytest.mark.parametrize("rows,S,k,sorted_,distinct", [
    (2 * 1024, 4096, 512, False, 0.05),  # a training forward's rows
    (1, 70000, 512, False, 0.002),  # one decoding query at a long context
    (64, 16384, 512, False, 0.01),
    (2 * 1024, 128, 8, True, 0.0),  # the candidate pool's block scores (the public code sorts these)
], ids=["training", "decode-long", "wide", "pool-blocks"])
def test_gpu_torch_topk_breaks_ties_like_topk_ids(rows, S, k, sorted_, distinct):
    """On a GPU, the public code's selection (torch.topk, ids re-sorted) takes the lowest ids among
    scores tied at the k-th place, which is flashtrain's rule: the two select the same entries on
    the public code's own device. Scores as ReLU makes them: mostly exact zeros, few positives,
    -inf past a causal edge; the pool case ties positive values too."""
    from model.indexer import topk_ids
    g = torch.Generator(device="cuda").manual_seed(0)
    if distinct:
        scores = torch.rand(rows, S, device="cuda", generator=g)
        scores = torch.where(torch.rand(rows, S, device="cuda", generator=g) < distinct, scores, 0.0)
    else:
        scores = torch.randint(0, 3, (rows, S), device="cuda", generator=g).float()
    edge = torch.randint(k // 2, S + 1, (rows, 1), device="cuda", generator=g)
    scores = scores.masked_fill(torch.arange(S, device="cuda") >= edge, float("-inf"))
    want = scores.topk(k, dim=-1, sorted=sorted_).indices.sort(dim=-1).values
    assert torch.equal(topk_ids(scores, k)[0], want)


# ---------------------------------------------------------------- grouped output projection
def _projection_case(device, dtype):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 4, 48, device=device, dtype=dtype, requires_grad=True)  # [B, T, G, I]
    w = torch.randn(4, 24, 48, device=device, dtype=dtype, requires_grad=True)  # [G, O, I]
    dy = torch.randn(2, 5, 4, 24, device=device, dtype=dtype)
    return x, w, dy


def _projection_and_grads(fn, x, w, dy):
    x.grad = w.grad = None
    y = fn(x, w)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def test_grouped_projection_equals_einsum_with_gradients_in_place():
    from model.attention import grouped_projection

    x, w, dy = _projection_case("cpu", torch.float64)
    assert torch.autograd.gradcheck(grouped_projection, (x[:1, :2], w))
    got = _projection_and_grads(grouped_projection, x, w, dy)
    want = _projection_and_grads(lambda a, b: torch.einsum("btgi,goi->btgo", a, b), x, w, dy)
    for g, e in zip(got, want):
        assert torch.allclose(g, e, rtol=1e-12, atol=1e-12)
    assert got[1].is_contiguous()  # dx in x's layout: what the caller's kernel reads without a copy
    with pytest.raises(TypeError, match="grouped_projection"):
        grouped_projection(x.detach(), w.detach().float())
    with torch.autocast("cpu", dtype=torch.bfloat16):  # cast like a matmul under autocast
        assert grouped_projection(x.detach().float(), w.detach().float()).dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_projection_on_gpu_under_autocast():
    from model.attention import grouped_projection

    x, w, dy = _projection_case("cuda", torch.float32)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = _projection_and_grads(grouped_projection, x, w, dy.bfloat16())
        want = _projection_and_grads(lambda a, b: torch.einsum("btgi,goi->btgo", a, b), x, w, dy.bfloat16())
    for g, e in zip(got, want):
        assert g.dtype == e.dtype and torch.allclose(g.float(), e.float(), rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------- RoPE / YaRN
def _theta_freqs(dim, theta):
    return [theta ** (-2 * i / dim) for i in range(dim // 2)]


# dim 16, beta_fast 32, beta_slow 1. YaRN's correction dim for beta is 16 ln(L / (2 pi beta)) / (2 ln theta);
# the ramp runs from low = floor(corr(32)) (clamped at 0) to high = ceil(corr(1)) (clamped at dim - 1).
YARN_CASES = [
    # theta 160000, L 4096: corr 2.01 -> low 2, corr 4.33 -> high 5
    (160_000.0, 16.0, 4096, [0, 0, 0, 1 / 3, 2 / 3, 1, 1, 1]),
    # the same ramp at factor 1: the blend leaves the values (up to rounding), and is applied all the same
    (160_000.0, 1.0, 4096, [0, 0, 0, 1 / 3, 2 / 3, 1, 1, 1]),
    # theta 10000, L 65536: corr 5.03 -> low 5, corr 8.04 -> high 9 (dim - 1 = 15 does not clamp it;
    # a clamp at dim/2 - 1 = 7 would give a ramp of 0.5, 1 at pairs 6, 7)
    (10_000.0, 4.0, 65536, [0, 0, 0, 0, 0, 0, 0.25, 0.5]),
]


@pytest.mark.parametrize("theta, factor, original, ramp", YARN_CASES,
                         ids=["factor16", "factor1", "wide-ramp"])
def test_yarn_frequencies_follow_the_inference_formula(theta, factor, original, ramp):
    """Pair i keeps theta^(-2i/dim) where ramp is 0 and is divided by `factor` where it is 1."""
    from model.rope import yarn_frequencies

    got = yarn_frequencies(16, theta, factor, original, 32, 1)
    assert got.dtype == torch.float32
    want = [f / factor * r + f * (1 - r) for f, r in zip(_theta_freqs(16, theta), ramp)]
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=0)
    # bit for bit what DeepSeek's inference code computes: fp32 throughout, in its order of operations
    base = 1.0 / (theta ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    smooth = 1 - torch.tensor(ramp, dtype=torch.float32)
    assert torch.equal(got, base / factor * (1 - smooth) + base * smooth)


def test_yarn_off_without_an_original_length_and_angles_in_fp32():
    from model.rope import Rotary, yarn_frequencies

    got = yarn_frequencies(16, 160_000.0, 16.0, 0, 32, 1)
    assert torch.equal(got, 1.0 / (160_000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)))
    rot = Rotary(16, 160_000.0, 16.0, 4096)
    pos = torch.tensor([[0, 1, 4095, 70_001]])
    angles = rot.angles(pos)
    assert angles.dtype == torch.float32
    assert torch.equal(angles, pos.float().unsqueeze(-1) * rot.inv_freq)


@pytest.mark.parametrize("max_seq_len, original", [(4096, 4096), (2048, 4096), (8192, 4096), (4096, 0)],
                         ids=["max=original", "max<original", "max>original", "original=0"])
def test_yarn_on_every_compressed_layer_whenever_original_seq_len_is_set(max_seq_len, original):
    """YaRN does not depend on max_seq_len: compressed layers take it whenever original_seq_len > 0;
    SWA-only layers never (plain rope_theta)."""
    from model.attention import CSA2Attention

    cfg = tiny(engram_layers=[], max_seq_len=max_seq_len, original_seq_len=original)
    assert (cfg.rope_dim, cfg.rope_theta_compressed, cfg.rope_factor) == (16, 160_000.0, 16.0)
    yarn = [f / 16.0 * r + f * (1 - r) for f, r in zip(_theta_freqs(16, 160_000.0), YARN_CASES[0][3])]
    modes = set()
    for spec in build_layer_plan(cfg).layers:
        got = CSA2Attention(cfg, spec).rotary.inv_freq.double()
        if spec.mode == "swa":
            want = _theta_freqs(16, cfg.rope_theta)
        else:
            want = yarn if original else _theta_freqs(16, 160_000.0)
        modes.add(spec.mode)
        torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=0)
    assert {"swa", "full"} <= modes


# ---------------------------------------------------------------- index keys
def _rotate(t: torch.Tensor, angles: torch.Tensor, R: int) -> torch.Tensor:
    """Pairs (2i, 2i+1) of t's last R dims turned by angles[..., i]."""
    cos, sin = angles.cos(), angles.sin()
    even, odd = t[..., -R:][..., 0::2], t[..., -R:][..., 1::2]
    pairs = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return torch.cat((t[..., :-R], pairs.flatten(-2)), dim=-1)


@pytest.mark.parametrize("qat", [False, True], ids=["no-qat", "qat"])
def test_index_keys_come_from_the_latent_before_rope_and_fp4(qat):
    """rt.index_k = MXFP4(RoPE(k_norm(wk(latent)))) with the compressor's latent before its own
    RoPE and FP4 rounding, entry j rotated at position j*m; rt.kv is that latent rotated (and
    rounded). The index keys take no gradient into the compressor (the indexer learns only from
    its own loss)."""
    from model.attention import CSA2Attention
    from model.quant import fake_quant_kv_fp4, fake_quant_mxfp4

    torch.manual_seed(0)
    cfg = tiny(engram_layers=[], kv_quant="qat" if qat else "off")
    spec = next(s for s in build_layer_plan(cfg).layers if s.owns_kv and s.compress_ratio == 2)
    attn = CSA2Attention(cfg, spec)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(mean=1.0 if p.dim() == 1 else 0.0, std=0.2)  # norm weights away from 1 too
    B, T, R, m = 2, 40, cfg.rope_dim, 2
    x = torch.randn(B, T, cfg.dim)
    rt = AttentionRuntime(B, T, x.device)
    attn.write_global_kv(x, rt)

    latent = attn.compressor(x).detach().double()  # [B, S, C], before RoPE
    S = T // m
    assert latent.shape == (B, S, cfg.kv_dim)
    angles = (torch.arange(S) * m).float().unsqueeze(-1) * attn.rotary.inv_freq  # fp32, as the model
    angles = angles.double()
    k = latent @ attn.index_key.wk.weight.double().T
    k = (k * torch.rsqrt(k.square().mean(-1, keepdim=True) + cfg.norm_eps)
         * attn.index_key.k_norm.weight.double())
    k = _rotate(k, angles, R).float()
    kv = _rotate(latent, angles, R).float()
    if qat:
        k, kv = fake_quant_mxfp4(k), fake_quant_kv_fp4(kv)
    got = rt.index_k[spec.layer_id]
    torch.testing.assert_close(got.detach(), k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rt.kv[spec.layer_id].detach(), kv, rtol=1e-5, atol=1e-5)

    # keys taken from the stored (rotated, rounded) latent instead would be far off
    stored = rt.kv[spec.layer_id].detach().double()
    k_stored = stored @ attn.index_key.wk.weight.double().T
    k_stored = k_stored * torch.rsqrt(k_stored.square().mean(-1, keepdim=True) + cfg.norm_eps)
    k_stored = _rotate(k_stored * attn.index_key.k_norm.weight.double(), angles, R).float()
    assert (k_stored - k).abs().max() > 1e-2

    assert got.requires_grad
    g_wk, g_comp = torch.autograd.grad(got.sum(), [attn.index_key.wk.weight, attn.compressor.wkv.weight],
                                       allow_unused=True)
    assert g_wk is not None and g_comp is None


def test_the_pooling_compressor_runs_in_fp32_under_autocast():
    """m > 1: projections, softmax and pooling in fp32 (the public model's promoted weights); only
    the pooled entry is rounded, once, before its norm."""
    from model.attention import Compressor

    torch.manual_seed(0)
    comp = Compressor(dim=64, kv_dim=32, ratio=2, eps=1e-6)
    x = torch.randn(2, 8, 64).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = comp(x)
    xs = x.float().view(2, 4, 2, 64)
    kv, gate = xs @ comp.wkv.weight.T, (xs @ comp.wgate.weight.T).softmax(dim=2)
    pooled = (kv * gate).sum(2).bfloat16()
    want = torch.nn.functional.rms_norm(pooled, (32,), comp.norm.weight.bfloat16(), 1e-6)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # what autocast alone would have computed
        kv16, gate16 = comp.wkv(xs), comp.wgate(xs).float().softmax(dim=2)
    assert not torch.equal((kv16.float() * gate16).sum(2).bfloat16(), pooled)
