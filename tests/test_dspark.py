"""The DSpark drafter (model/dspark.py) and speculative decoding (inference/speculative.py): shapes,
what the drafter may see, that training moves it toward the target, and that speculative decoding
leaves the target's output unchanged (greedy: the same tokens; sampled: the same distribution)."""
import copy
import dataclasses
import json
import math
import random

import pytest
import torch

from conf.model import TinyModelConfig
from model.dspark import DSpark, TapRecorder
from model.transformer import Transformer
from tests.conftest import FAST

CFG = dataclasses.replace(TinyModelConfig(vocab_size=97), engram_min_rows=50, window=8, index_topk=4,
                          pool_block=2, pool_blocks=3)


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    model = Transformer(CFG).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _forward(target, drafter, ids):
    with TapRecorder(target, drafter.taps) as rec, torch.no_grad():
        logits = target(ids).logits
        return logits, rec.take()


def test_shapes_and_taps(target):
    torch.manual_seed(1)
    d = DSpark(CFG)
    assert d.taps == [3, 4, 5] and d.block == 5 and d.noise_id == 96
    assert len(d.layers) == 3 and all(layer.spec.mode == "swa" for layer in d.layers)
    assert d.layers[0].moe.router.weight.shape == (CFG.dspark_routed_experts, CFG.dim)
    ids = torch.randint(0, 97, (2, 20))
    logits, taps = _forward(target, d, ids)
    assert taps.shape == (2, 20, 3 * CFG.dim)
    out = d.draft_loss(target, taps, ids, logits)
    assert out.accept.shape == out.top1.shape == (5,) and out.kl > 0
    # the last anchor (position 18) has one next token: only draft position 0 counts there
    assert out.positions.tolist() == [2 * 18, 2 * 17, 2 * 16, 2 * 15, 2 * 14]


def test_taps_are_the_streams_entering_each_tap_layer_in_layer_order(target):
    """What the public code's dspark_target_layer_ids read: the streams entering a layer, after its
    Engram, averaged over the mHC streams; concatenated in layer order however the config lists them.
    Under the fused schedule (a block receives the streams before the last MoE update) the same."""
    from model.fused_mhc import apply_fused_schedule
    from model.kernels.mhc import reference_mhc_mix, reference_mhc_step

    cfg = dataclasses.replace(CFG, dspark_taps=[3, 0, 2])  # tiny: Engrams at layers 1 and 2
    d = DSpark(cfg)
    assert d.taps == [0, 2, 3]
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(7))
    block_out = {}
    hooks = [target.layers[i].register_forward_hook(lambda m, a, out, i=i: block_out.__setitem__(i, out[0]))
             for i in (1, 2)]
    try:
        with TapRecorder(target, d.taps) as rec, torch.no_grad():
            out = target(ids, keep_runtime=True)
            taps = rec.take().unflatten(-1, (3, CFG.dim))
    finally:
        for h in hooks:
            h.remove()
    rt = out.runtime
    with torch.no_grad():
        after_engram = target.engrams["2"](block_out[1], target.lookup_map[ids], rt.ngram_start, rt.positions,
                                           None)
    assert torch.equal(taps[..., 0, :], target.embed(ids))  # layer 0's input: the embedding in every stream
    assert torch.equal(taps[..., 1, :], after_engram.mean(2))
    assert not torch.allclose(taps[..., 1, :], block_out[1].mean(2))  # the Engram's memory is in it
    assert torch.equal(taps[..., 2, :], block_out[2].mean(2))  # no Engram at 3: layer 2's output

    fused = copy.deepcopy(target)
    for block in fused.layers:
        block.fused_mhc, block.fused_mix = reference_mhc_step, reference_mhc_mix
    apply_fused_schedule(fused)
    with TapRecorder(fused, d.taps) as rec, torch.no_grad():
        fused(ids)
        torch.testing.assert_close(rec.take().unflatten(-1, (3, CFG.dim)), taps)


def test_a_draft_sees_only_the_past_window(target):
    """Hidden states at an anchor depend on context rows in [p - window, p) and on nothing later."""
    torch.manual_seed(2)
    d = DSpark(CFG).double()
    D, N, W = CFG.dim, 24, CFG.window
    ctx = torch.randn(1, N, D, dtype=torch.float64)
    pos = torch.arange(N)[None]
    p = torch.tensor([[15]])
    visible = (pos[:, None] < p[..., None]) & (pos[:, None] >= p[..., None] - W)
    anchor = torch.tensor([[7]])
    embed = copy.deepcopy(target.embed).double()
    base = d.hidden(embed, ctx, visible, pos, anchor, p)
    for j, moves in ((16, False), (15, False), (6, False), (14, True), (7, True)):
        edited = ctx.clone()
        edited[0, j] += 1.0
        out = d.hidden(embed, edited, visible, pos, anchor, p)
        assert (not torch.equal(out, base)) == moves, j


def test_training_moves_the_drafter_toward_the_target(target):
    torch.manual_seed(3)
    d = DSpark(CFG)
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(4))
    logits, taps = _forward(target, d, ids)
    opt = torch.optim.Adam(d.parameters(), lr=3e-3)
    first = d.draft_loss(target, taps, ids, logits)
    for _ in range(10):
        out = d.draft_loss(target, taps, ids, logits)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    last = d.draft_loss(target, taps, ids, logits)
    assert last.kl < 0.6 * first.kl
    assert last.accept.mean() > first.accept.mean() and last.top1.mean() > first.top1.mean()
    assert last.confidence < first.confidence  # the confidence head learns the acceptance


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_the_dspark_stage_trains_on_tiny_and_resumes(flashtrain, corpus, tmp_path):
    common = [*FAST, *corpus, "trainer.torch_threads=1"]
    pre = tmp_path / "pre"
    p = flashtrain("pretrain", *common, "trainer.max_steps=2", f"hydra.run.dir={pre}")
    assert p.returncode == 0, p.stderr[-3000:]
    run = tmp_path / "ds"
    ds = [*common, f"dspark.target={pre}", "trainer.save_every=2", f"hydra.run.dir={run}"]
    p = flashtrain("dspark", *ds, "trainer.max_steps=2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "drafter of 3 blocks, 5 draft positions, taps [3, 4, 5]" in p.stdout, p.stdout[-3000:]
    rows = _rows(run)
    train = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train] == [1, 2]
    assert all(0 <= r[f"accept_pos{i}"] <= 1 and 0 <= r[f"top1_pos{i}"] <= 1 for r in train for i in range(5))
    val = [r for r in rows if "val_accept_len" in r]
    assert val and 0 <= val[-1]["val_accept_len"] <= 5
    # the checkpoint is the drafter's alone, and loads into a plain DSpark
    from trainer.checkpoint import model_state, resolve_checkpoint
    state = model_state(resolve_checkpoint(run / "checkpoints"))
    assert "markov.w1.weight" in state and not any(k.startswith(("embed.", "head.")) for k in state)
    p = flashtrain("dspark", *ds, "trainer.max_steps=3")  # the same run dir: continues from step 2
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resuming from" in p.stdout and "step_00000002" in p.stdout, p.stdout[-3000:]
    assert [r["step"] for r in _rows(run) if "loss" in r] == [1, 2, 3]
    p = flashtrain("dspark", *common, f"hydra.run.dir={tmp_path / 'bad'}")
    err = p.stderr.strip()
    assert p.returncode == 2 and "dspark.target" in err and "\n" not in err, p.stderr[-2000:]


# ---------------------------------------------------------------- speculative decoding

@pytest.fixture(scope="module", params=["plain", "packed"])
def engine_target(request):
    """fp64, as tests/test_generate.py's engine tests: a verification forward over k + 1 tokens and k + 1
    one-token forwards then agree to rounding far below any argmax gap. packed: a KV-QAT model over
    the FP4 / MXFP4 / FP8 cache."""
    torch.manual_seed(0)
    cfg = CFG if request.param == "plain" else dataclasses.replace(CFG, kv_quant="qat")
    model = Transformer(cfg).double().eval()
    model.packed_cache = request.param == "packed"
    return model


def _prompts():
    ids = [torch.randint(0, 97, (11,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(2)]
    return ids + [[5, 6, 7]]


def test_greedy_equality_speculative_against_plain(engine_target, monkeypatch):
    """Speculative greedy decoding gives generate's tokens and log-probs: with the drafter as it is
    (mostly rejected), at batch 1 and for prompts of different lengths decoding together; and with
    an oracle drafter that is right for some rows only (always, never, or up to a random position:
    accepted runs of every length, so slots roll back by every amount, and a row that finishes
    hands its slot to the next prompt). Each row keeps its own accepted drafts: with a row in the
    batch that rejects every draft, the smallest accepted count is 0 at every step, yet the others
    accept theirs and take fewer target forwards."""
    from inference import speculative
    from inference.generate import generate
    from inference.speculative import SpeculativeStats, generate_speculative

    model, packed = engine_target, engine_target.packed_cache
    prompts = [torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (11, 7, 3)]
    want = generate(model, prompts, 10, temperature=0, packed=packed)
    torch.manual_seed(5)
    drafter = DSpark(model.cfg).double()
    got = generate_speculative(model, drafter, prompts, 10, temperature=0, packed=packed, draft_length=3)
    assert [g.tokens for g in got] == [w.tokens for w in want]
    (alone,) = generate_speculative(model, drafter, prompts[2:], 10, temperature=0, packed=packed,
                                    draft_length=5)
    assert alone.tokens == want[2].tokens

    rng = random.Random(0)
    real = speculative.propose
    forwards = [0, 0, 0]  # target forwards each prompt took part in

    def prompt_of(position: int, anchor: int) -> int:
        """The prompt whose greedy continuation has this anchor at this position (unique here)."""
        (i,) = [i for i, p in enumerate(prompts) if 0 <= position - len(p) < len(want[i].tokens)
                and want[i].tokens[position - len(p)] == anchor]
        return i

    def oracle(drafter, target, context, context_pos, anchor, position, temperature, top_p, uniforms):
        drafts, q, conf = real(drafter, target, context, context_pos, anchor, position, temperature, top_p,
                               uniforms)
        for b in range(anchor.shape[0]):
            i = prompt_of(int(position[b]), int(anchor[b]))
            forwards[i] += 1
            row = want[i].tokens
            j = int(position[b]) - len(prompts[i])  # the anchor is token j of the continuation
            wrong = (drafter.block, 0, rng.randint(0, drafter.block))[i]  # drafts before this are right
            for d in range(drafter.block):
                t = row[j + 1 + d] if j + 1 + d < len(row) else 0
                drafts[b, d] = t if d < wrong else (t + 1) % 97
        return drafts, q, torch.full_like(conf, 0.9)

    monkeypatch.setattr(speculative, "propose", oracle)
    for max_batch in (3, 2, 1):
        stats, forwards[:] = SpeculativeStats(), [0, 0, 0]
        got = generate_speculative(model, drafter, prompts, 10, temperature=0, packed=packed, stats=stats,
                                   max_batch=max_batch)
        assert [g.tokens for g in got] == [w.tokens for w in want]
        for g, w in zip(got, want):
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), rtol=0, atol=1e-9)
        # prompt 1 needs all 9 of its steps; prompt 0 (always right) verifies 5 drafts at a time
        assert forwards[1] == 9 and forwards[0] == 2, (max_batch, forwards)
        assert stats.accepted >= 8 + forwards[2], (max_batch, stats.as_dict())



def test_speculative_decoding_from_a_prefix_cache(engine_target, monkeypatch):
    """With a prefix cache, a prompt that extends a finished sequence starts from its cached prefix:
    the same greedy tokens as plain decoding without one (the prefixes fit the replay, so exactly),
    and the drafter proposes what it proposes without the cache, its context rebuilt from the
    replayed prefix and the rest of the prompt."""
    from inference import speculative
    from inference.generate import generate
    from inference.prefix import PrefixCache
    from inference.speculative import generate_speculative

    model, packed = engine_target, engine_target.packed_cache
    prompts = [torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (9, 4)]
    torch.manual_seed(5)
    drafter = DSpark(model.cfg).double()
    cache = PrefixCache(1 << 30)
    first = generate_speculative(model, drafter, prompts, 6, temperature=0, packed=packed, draft_length=3,
                                 prefix_cache=cache)
    assert (cache.hits, cache.misses, len(cache._lru)) == (0, 2, 2)
    longer = [p + g.tokens + [5, 6] for p, g in zip(prompts, first)]
    want = generate(model, longer, 6, temperature=0, packed=packed)

    real, drafts = speculative.propose, []

    def recorded(*args):
        out = real(*args)
        drafts.append(out[0].clone())
        return out

    monkeypatch.setattr(speculative, "propose", recorded)
    plain = generate_speculative(model, drafter, longer, 6, temperature=0, packed=packed, draft_length=3,
                                 max_batch=1)
    plain_drafts, drafts[:] = list(drafts), []
    got = generate_speculative(model, drafter, longer, 6, temperature=0, packed=packed, draft_length=3,
                               max_batch=1, prefix_cache=cache)
    assert cache.hits == 2
    assert [g.tokens for g in got] == [g.tokens for g in plain] == [w.tokens for w in want]
    assert len(drafts) == len(plain_drafts) and all(torch.equal(a, b) for a, b in zip(drafts, plain_drafts))


def test_speculative_copies_of_a_prompt_share_its_prefill(engine_target, monkeypatch):
    """A repeated prompt is prefilled once (with its drafter context) and each copy decodes as it
    would alone: greedy copies give generate's tokens."""
    from inference import speculative
    from inference.generate import generate
    from inference.speculative import generate_speculative

    model, packed = engine_target, engine_target.packed_cache
    a = torch.randint(0, 97, (10,), generator=torch.Generator().manual_seed(3)).tolist()
    prompts = [a, [4, 5, 6], a]
    calls, real = [], speculative._prefill

    def counted(model, prompt, *args, **kwargs):
        calls.append(tuple(prompt))
        return real(model, prompt, *args, **kwargs)

    monkeypatch.setattr(speculative, "_prefill", counted)
    torch.manual_seed(5)
    drafter = DSpark(model.cfg).double()
    got = generate_speculative(model, drafter, prompts, 6, temperature=0, packed=packed, draft_length=3,
                               max_batch=2)
    assert calls == [tuple(a), (4, 5, 6)]
    want = generate(model, prompts, 6, temperature=0, packed=packed)
    assert [g.tokens for g in got] == [w.tokens for w in want]


def test_a_sampled_prompt_draws_the_same_tokens_in_any_batch(engine_target):
    """Sampled speculative decoding with a fixed draft length: each row draws its drafts, acceptance
    tests and next tokens from its own counter-based stream (every row's in one op), so a prompt's
    tokens do not depend on what it is batched with (fp64 target, so no rounding differs)."""
    from inference.speculative import SpeculativeStats, generate_speculative

    torch.manual_seed(2)
    drafter = DSpark(engine_target.cfg).double()
    prompts, packed = _prompts(), engine_target.packed_cache
    runs = {}
    for max_batch in (3, 1):
        stats = SpeculativeStats()
        gens = generate_speculative(engine_target, drafter, prompts, 8, temperature=1.0, seed=9,
                                    packed=packed, draft_length=2, max_batch=max_batch, stats=stats)
        runs[max_batch] = [g.tokens for g in gens]
        assert stats.drafted > 0
    assert runs[3] == runs[1]
    other_seed = generate_speculative(engine_target, drafter, prompts, 8, temperature=1.0, seed=10,
                                      packed=packed, draft_length=2)
    assert [g.tokens for g in other_seed] != runs[3]  # the draws do come from the seed

def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square (Wilson-Hilferty's normal approximation of its distribution)."""
    expected = probs * counts.sum()
    stat = float(((counts - expected) ** 2 / expected).sum())
    df = counts.numel() - 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def _speculative_pairs(P, Q, n, rule, seed=0):
    """The first two tokens after token 0 of a Markov chain with transition table P, sampled
    speculatively with a draft chain Q (2 drafts a round, a second round when the first emits one
    token): [n] pair ids x1 * V + x2."""
    V = P.shape[0]
    g = torch.Generator().manual_seed(seed)

    def round_from(x0):
        d1 = torch.multinomial(Q[x0], 1, generator=g)[:, 0]
        d2 = torch.multinomial(Q[d1], 1, generator=g)[:, 0]
        drafts = torch.stack((d1, d2), 1)
        p = torch.stack((P[x0], P[d1], P[d2]), 1)  # the target at the anchor and after each draft
        q = torch.stack((Q[x0], Q[d1]), 1)
        uniforms = torch.rand(n, 3, generator=g, dtype=torch.float64)  # two tests, then the next token
        return drafts, rule(p, q, drafts, uniforms)

    drafts, (acc, nxt) = round_from(torch.zeros(n, dtype=torch.long))
    x1 = torch.where(acc > 0, drafts[:, 0], nxt)
    drafts2, (acc2, nxt2) = round_from(x1)
    second = torch.where(acc2 > 0, drafts2[:, 0], nxt2)  # the next round's first token
    x2 = torch.where(acc > 1, drafts[:, 1], torch.where(acc == 1, nxt, second))
    return x1 * V + x2


def test_a_statistical_test_of_the_speculative_sampler():
    """Samples through the accept/reject rule follow the target chain's joint law of two tokens (a
    chi-square test over V^2 cells, fixed seeds), and the test has the power to reject rules that are
    wrong: taking every draft, or resampling a rejection from the target instead of the residual."""
    from inference.speculative import accept_drafts

    V, n = 5, 12_000
    g = torch.Generator().manual_seed(7)
    P = torch.rand(V, V, generator=g).pow(3).double()
    P = P / P.sum(1, keepdim=True)
    Q = (0.5 * torch.rand(V, V, generator=g).double() + 0.5 * P.roll(1, 1))
    Q = Q / Q.sum(1, keepdim=True)
    joint = (P[0][:, None] * P).flatten()  # P(x1) P(x2 | x1)

    def counts(rule):
        return torch.bincount(_speculative_pairs(P, Q, n, rule), minlength=V * V).double()

    assert _chi_square_p(counts(accept_drafts), joint) > 1e-3

    def take_every_draft(p, q, drafts, uniforms):
        return torch.full((drafts.shape[0],), drafts.shape[1]), torch.multinomial(p[:, -1], 1)[:, 0]

    def resample_from_target(p, q, drafts, uniforms):
        n_acc, _ = accept_drafts(p, q, drafts, uniforms)
        redraw = torch.multinomial(p[torch.arange(len(n_acc)), n_acc], 1)[:, 0]
        return n_acc, redraw

    for wrong in (take_every_draft, resample_from_target):
        assert _chi_square_p(counts(wrong), joint) < 1e-6, wrong.__name__


@pytest.mark.extended
def test_speculative_sampling_through_the_engine_follows_the_target(monkeypatch):
    """The whole engine, sampled, with per-row acceptance: 1000 rows of one prompt decode 3 tokens
    each in batches of 64 (rows accept different numbers of drafts in one step, and enter and leave
    slots at different times); the joint law of the 3 tokens is the target's (temperature 0.1,
    top-p 0.9: a few tokens per position, so a chi-square over the enumerated joint has power).
    Drafts at the first step are drawn from q = (p + uniform on p's support) / 2, so they are often
    but not always accepted; later drafts from uniform q. The same run with a rule that takes every
    draft is rejected."""
    from inference import speculative
    from inference.generate import invert_cdf, sampling_logprobs
    from inference.speculative import SpeculativeStats, generate_speculative

    torch.manual_seed(0)
    model = Transformer(CFG).double().eval()
    T, top_p, prompt, n, V = 0.1, 0.9, [5, 6, 7], 1000, CFG.vocab_size

    def law(ids):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        return sampling_logprobs(logits, T, top_p).exp()

    p1 = law(prompt)
    p2 = {a: law(prompt + [a]) for a in p1.nonzero()[:, 0].tolist()}
    joint = {}
    for a, pa in p2.items():
        for b in pa.nonzero()[:, 0].tolist():
            pc = law(prompt + [a, b])
            for c in pc.nonzero()[:, 0].tolist():
                joint[(a, b, c)] = float(p1[a] * pa[b] * pc[c])
    drafter = DSpark(CFG).double()

    def propose(drafter, target, context, context_pos, anchor, position, temperature, top_p, uniforms):
        B, K = anchor.shape[0], drafter.block
        q = torch.full((B, K, V), 1.0 / V, dtype=torch.float64)
        for b in range(B):
            if int(position[b]) == len(prompt):  # the anchor is the first token
                p = p2[int(anchor[b])]
                q[b, 0] = 0.5 * p + 0.5 * (p > 0).double() / int((p > 0).sum())
        drafts = torch.stack([invert_cdf(q[:, i], uniforms[:, i]) for i in range(K)], 1)
        return drafts, q, torch.full((B, K), 0.9)

    monkeypatch.setattr(speculative, "propose", propose)

    def p_value():
        stats = SpeculativeStats()
        gens = generate_speculative(model, drafter, [prompt] * n, 3, temperature=T, top_p=top_p, seed=4,
                                    draft_length=1, packed=False, stats=stats)
        seen = [tuple(g.tokens) for g in gens]
        big = sorted(c for c, pr in joint.items() if pr * n >= 5)  # the rest pooled into one cell
        counts = torch.tensor([float(sum(x == c for x in seen)) for c in big] + [0.0])
        counts[-1] = n - counts[:-1].sum()
        probs = torch.tensor([joint[c] for c in big] + [0.0], dtype=torch.float64)
        probs[-1] = 1 - probs[:-1].sum()
        return _chi_square_p(counts.double(), probs), stats

    p, stats = p_value()
    assert p > 1e-3, (p, stats.as_dict())
    assert 0.2 < stats.accepted / stats.drafted < 0.95, stats.as_dict()  # drafts both kept and rejected

    def take_every_draft(p, q, drafts, uniforms):
        k = drafts.shape[1]
        return torch.full((drafts.shape[0],), k), torch.multinomial(p[:, k], 1)[:, 0]

    monkeypatch.setattr(speculative, "accept_drafts", take_every_draft)
    assert p_value()[0] < 1e-6


@pytest.mark.slow
def test_speculative_rollouts_record_the_policys_log_probs(engine_target):
    """What RL trains against with rl.drafter set: each sampled token's recorded log-prob is the
    policy's training forward's (rl/policy.py), as for the plain engine (tests/test_generate.py)."""
    from inference.speculative import SpeculativeStats, generate_speculative
    from rl.policy import behaviour_logprobs, response_logprobs

    torch.manual_seed(6)
    drafter = DSpark(engine_target.cfg).double()
    prompts = _prompts()
    stats = SpeculativeStats()
    gens = generate_speculative(engine_target, drafter, prompts, 8, temperature=1.0, seed=3,
                                packed=engine_target.packed_cache, draft_length=2, stats=stats)
    assert [len(g.tokens) for g in gens] == [8, 8, 8] and stats.verifications > 0
    samples = [{"prompt": p, "response": g.tokens, "behaviour": g.logprobs} for p, g in zip(prompts, gens)]
    with torch.no_grad():
        logp, mask = response_logprobs(engine_target, samples, pad_id=0)
    assert float(((logp - behaviour_logprobs(samples, logp)).abs() * mask).max()) < 1e-5


def test_the_draft_length_follows_the_confidences_and_the_batch():
    from inference.speculative import choose_draft_length

    sure, unsure = torch.full((1, 5), 0.95), torch.full((1, 5), 0.05)
    assert choose_draft_length(sure, capacity=256, draft_cost=0.1) == 5
    assert choose_draft_length(unsure, capacity=256, draft_cost=0.1) == 0
    # confident up to position 2, then not: verify the first two once extra tokens cost something
    confident_two = torch.tensor([[0.95, 0.95, 0.02, 0.9, 0.9]])
    assert choose_draft_length(confident_two, capacity=16, draft_cost=0.1) == 2
    # a load past the roofline knee makes every extra draft cost a forward's worth: a draft must then
    # be accepted more often than not to pay
    assert choose_draft_length(torch.full((64, 5), 0.5), capacity=64, draft_cost=0.1) == 0
    assert choose_draft_length(torch.full((64, 5), 0.8), capacity=64, draft_cost=0.1) == 2
    # each row keeps its own accepted drafts: one unsure row does not hold the others back (had the
    # batch kept its smallest count, nothing would be gained by drafting at all)
    one_unsure = torch.full((64, 5), 0.95)
    one_unsure[0] = 0.05
    assert choose_draft_length(one_unsure, capacity=1024, draft_cost=0.1) >= 4


@pytest.mark.slow
def test_the_dspark_stage_trains_on_the_targets_own_samples(flashtrain, corpus, tmp_path):
    common = [*FAST, *corpus, "trainer.torch_threads=1", "data.seq_len=64", "trainer.micro_batch_size=2"]
    pre = tmp_path / "pre"
    p = flashtrain("pretrain", *common, "trainer.max_steps=1", f"hydra.run.dir={pre}")
    assert p.returncode == 0, p.stderr[-3000:]
    run = tmp_path / "ds"
    p = flashtrain("dspark", *common, f"dspark.target={pre}", "dspark.source=samples", "dspark.samples=4",
                   "dspark.sample_prompt_tokens=8", "trainer.max_steps=2", f"hydra.run.dir={run}")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "4 target samples of 65 tokens" in p.stdout, p.stdout[-3000:]
    assert [r["step"] for r in _rows(run) if "loss" in r] == [1, 2]
