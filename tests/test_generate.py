"""The decode cache reproduces the training forward: prefill in chunks of any size, then one
token at a time, gives the logits of one forward over the whole sequence."""
import dataclasses
import random

import pytest
import torch

from conf.model import TinyModelConfig
from inference.cache import DecodeCache
from inference.generate import forward_new, generate, prefill_ced
from model.transformer import Transformer

# small window and top-k so the cache's window rows and the selection both matter at T=48
CFG = dataclasses.replace(TinyModelConfig(vocab_size=97), engram_min_rows=50, window=8, index_topk=4,
                          pool_block=2, pool_blocks=3)


@pytest.fixture(scope="module", params=["plain", "packed"])
def model(request):
    """plain: an unpacked cache; packed: FP4 / MXFP4 / FP8 storage, for a model trained with KV
    QAT (it computed exactly the stored values, so both must match the training forward)."""
    torch.manual_seed(0)
    cfg = CFG if request.param == "plain" else dataclasses.replace(CFG, kv_quant="qat")
    model = Transformer(cfg).double().eval()
    model.packed_cache = request.param == "packed"
    return model


def _ids(T, seed=0):
    return torch.randint(0, 97, (2, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("chunks", [[48], [1] * 48, [7, 13, 1, 1, 26], [5, 3, 40]])
def test_cached_forward_equals_the_whole_sequence(model, chunks):
    ids = _ids(48)
    with torch.no_grad():
        want = model(ids).logits  # [2, 48, V]
    cache = DecodeCache(2, packed=model.packed_cache)
    got, at = [], 0
    for n in chunks:
        got.append(forward_new(model, cache, ids[:, at:at + n]))
        at += n
    torch.testing.assert_close(torch.cat(got, dim=1), want, rtol=0, atol=1e-10)
    assert cache.length == 48
    assert all(w.read(torch.float64).shape[1] == CFG.window - 1 for w in cache.window.values())


def test_packed_cache_bytes_per_token_match_the_layout(model):
    """Global-KV bytes per token, measured on the engine's own buffers after 48 tokens (a multiple
    of every compress ratio), against the layout accounting (docs/ARCHITECTURE.md §4: 890 for `flash`)."""
    from model.kv_layout import GlobalKVLayout
    cache = DecodeCache(2, packed=True)
    forward_new(model, cache, _ids(48))
    assert cache.global_bytes_per_token() == GlobalKVLayout.of(model.cfg, model.plan).bytes_per_token()
    plain = DecodeCache(2, packed=False)
    forward_new(model, plain, _ids(48))
    assert plain.global_bytes_per_token() > 7 * cache.global_bytes_per_token()  # fp64 vs ~4.5 bits


def test_greedy_with_cache_equals_greedy_without(model):
    prompt = _ids(11, seed=1)[0].tolist()
    (gen,) = generate(model, [prompt], max_new_tokens=20, temperature=0, packed=model.packed_cache)
    seq = list(prompt)
    for _ in range(20):  # no cache: the whole sequence every step
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0, -1]
        seq.append(int(logits.argmax()))
    assert gen.tokens == seq[len(prompt):]
    assert len(gen.logprobs) == 20 and all(lp <= 0 for lp in gen.logprobs)


def test_sampling_is_seeded_and_stops(model):
    prompt = _ids(6, seed=2)[0].tolist()
    a = generate(model, [prompt, prompt], max_new_tokens=12, temperature=1.0, top_p=0.9, seed=5)
    b = generate(model, [prompt, prompt], max_new_tokens=12, temperature=1.0, top_p=0.9, seed=5)
    assert [g.tokens for g in a] == [g.tokens for g in b]
    first = a[0].tokens[0]
    (s,) = generate(model, [prompt], max_new_tokens=12, temperature=1.0, top_p=0.9, seed=5, stop={first})
    assert s.tokens == [first] and s.finish == "stop"
    with pytest.raises(ValueError, match="empty prompt"):
        generate(model, [[]], max_new_tokens=1)


@pytest.mark.slow
def test_generate_cli_from_a_checkpoint(flashtrain, tmp_path):
    from tests.conftest import FAST
    run = tmp_path / "train"
    p = flashtrain("pretrain", *FAST, "trainer.max_steps=2", "trainer.save_every=2", f"hydra.run.dir={run}")
    assert p.returncode == 0, p.stderr[-3000:]
    out = tmp_path / "gen"
    p = flashtrain("generate", "generate.prompt='def main():'", f"generate.checkpoint={run / 'checkpoints'}",
                   "generate.max_new_tokens=8", "generate.temperature=0", f"hydra.run.dir={out}")
    assert p.returncode == 0, p.stderr[-3000:]
    result = __import__("json").loads((out / "generation.json").read_text())
    assert result["prompt"] == "def main():" and 1 <= len(result["tokens"]) <= 8
    assert p.stdout.strip().startswith("def main():")
    for bad, needle in ((["generate.max_new_tokens=4"], "generate.prompt"),
                        (["generate.prompt=x", f"generate.checkpoint={tmp_path / 'nope'}"], "nope")):
        p = flashtrain("generate", *bad, f"hydra.run.dir={tmp_path / 'bad'}")
        assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]


def test_ced_prefill_is_exact_when_the_prompt_fits_the_replay(model):
    """N <= replay: the decoder layers see the whole prompt, so CED prefill (encoder over N,
    decoder KV from the encoder output, decoder over N) is the plain forward; decoding goes on
    from its cache. Token-layer passes: N x encoder + R x decoder, then n_layers per token."""
    ids = _ids(40)
    with torch.no_grad():
        want = model(ids).logits
        torch.testing.assert_close(model.forward_ced(ids, replay=128), want, rtol=0, atol=1e-10)
    cache = DecodeCache(2, packed=model.packed_cache)
    got = [prefill_ced(model, cache, ids[:, :30], replay=128)]
    got += [forward_new(model, cache, ids[:, p:p + 1]) for p in range(30, 40)]
    torch.testing.assert_close(torch.cat(got, dim=1), want, rtol=0, atol=1e-10)
    n_enc, n = model.plan.n_encoder_layers, len(model.layers)
    assert cache.token_layer_passes == 30 * n_enc + 30 * (n - n_enc) + 10 * n


def test_bounded_replay_matches_the_boundary_forward(model):
    """N > replay: the engine's cached CED prefill equals the model's boundary forward (the one
    training can run), and differs from the exact full forward (the approximation is real)."""
    ids, R = _ids(48), 16
    cache = DecodeCache(2, packed=model.packed_cache)
    got = prefill_ced(model, cache, ids, replay=R)  # [2, R, V]
    with torch.no_grad():
        boundary = model.forward_ced(ids, R)
        exact = model(ids).logits[:, -R:]
    torch.testing.assert_close(got, boundary, rtol=0, atol=1e-10)
    gap = (boundary - exact).abs().amax().item()
    assert 1e-6 < gap < 10, gap
    n_enc, n = model.plan.n_encoder_layers, len(model.layers)
    assert cache.token_layer_passes == 48 * n_enc + R * (n - n_enc) < 48 * n
    with pytest.raises(ValueError, match="must be empty"):
        prefill_ced(model, cache, ids[:, :4])


def test_prefix_cache_hit_skips_the_prefix_and_matches(model):
    """Agent loop: a request continues a finished one (its prompt + generation + new tool output).
    The hit restores the finished sequence's cache and runs only the new tokens: the uncached
    greedy result, with no prefix token run again."""
    from inference.prefix import PrefixCache
    prefix_cache = PrefixCache(max_bytes=10**9)
    first_prompt = _ids(21, seed=3)[0].tolist()
    (first,) = generate(model, [first_prompt], max_new_tokens=6, temperature=0, packed=model.packed_cache,
                        prefix_cache=prefix_cache)
    assert prefix_cache.misses == 1 and prefix_cache.nbytes() > 0
    tool = _ids(9, seed=4)[0].tolist()
    prompt = first_prompt + first.tokens[:-1] + [first.tokens[-1]] + tool
    (hit,) = generate(model, [prompt], max_new_tokens=5, temperature=0, packed=model.packed_cache,
                      prefix_cache=prefix_cache)
    (miss,) = generate(model, [prompt], max_new_tokens=5, temperature=0, packed=model.packed_cache)
    assert prefix_cache.hits == 1 and hit.tokens == miss.tokens
    P = len(first_prompt) + len(first.tokens) - 1  # the last sampled token was never fed
    n = len(model.layers)
    assert hit.token_layer_passes == (len(prompt) - P) * n + 4 * n  # the new tokens, then decode
    small = PrefixCache(max_bytes=1)
    generate(model, [first_prompt], max_new_tokens=2, temperature=0, prefix_cache=small)
    assert small.nbytes() == 0  # evicted: over its byte budget


def test_a_prefix_hit_beyond_the_replay_span_continues_the_cached_sequence_exactly(model):
    """A cached prefix of 141 tokens, at a window (32) whose reach through 6 layers (186 tokens)
    exceeds any replay: the hit's greedy tokens and log-probs are the exact forward's over the whole
    prompt (plain prefill, so the first call is exact too), which rebuilding the window rows by a
    bounded replay of 128 tokens only approximates; and no prefix token runs again."""
    from inference.prefix import PrefixCache
    torch.manual_seed(0)
    wide = Transformer(dataclasses.replace(model.cfg, window=32)).double().eval()
    cache = PrefixCache(max_bytes=10**9)
    first_prompt = _ids(135, seed=7)[0].tolist()
    kw = dict(temperature=0, packed=model.packed_cache, replay=None)
    (first,) = generate(wide, [first_prompt], max_new_tokens=7, prefix_cache=cache, **kw)
    prompt = first_prompt + first.tokens + _ids(5, seed=8)[0].tolist()
    (hit,) = generate(wide, [prompt], max_new_tokens=6, prefix_cache=cache, **kw)
    (miss,) = generate(wide, [prompt], max_new_tokens=6, **kw)
    assert cache.hits == 1 and hit.tokens == miss.tokens
    torch.testing.assert_close(torch.tensor(hit.logprobs), torch.tensor(miss.logprobs), rtol=0, atol=1e-10)
    n = len(wide.layers)
    assert hit.token_layer_passes == (len(prompt) - 141) * n + 5 * n  # the new tokens, then decode


@pytest.mark.parametrize("name,owners,want", [
    ("tiny", [(1, 2), (3, 1)], 79.5),
    ("small", [(1, 2), (4, 2), (7, 2), (8, 1)], 890),
    ("flash", [(2, 2), (8, 2), (14, 2), (20, 1)], 890),
])
def test_global_kv_bytes_per_token_in_the_engine_buffers(name, owners, want):
    """The engine's own storage per plan, filled for 1024 tokens. An entry is the latent in FP4
    (C/2 code bytes + C/16 E4M3 scales) plus index keys in MXFP4 (Di/2 + Di/32): 288 + 68 = 356
    bytes at C=512, Di=128, so 3 encoder sources at m=2 and the decoder's at m=1 give
    3 * 356/2 + 356 = 890 (`flash`, and `small` with the same widths); `tiny` (C=64, Di=32):
    53/2 + 53 = 79.5."""
    from conf.model import FlashModelConfig, SmallModelConfig, TinyModelConfig
    from model.plan import build_layer_plan
    cfg = {"tiny": TinyModelConfig, "small": SmallModelConfig, "flash": FlashModelConfig}[name]()
    specs = [s for s in build_layer_plan(cfg).layers if s.owns_kv]
    assert [(s.layer_id, s.compress_ratio) for s in specs] == owners
    cache, N = DecodeCache(1), 1024
    for s in specs:
        cache.gather(torch.randn(1, N // s.compress_ratio, cfg.kv_dim), s.layer_id, "kv")
        cache.gather(torch.randn(1, N // s.compress_ratio, cfg.index_dim), s.layer_id, "index_k")
    cache.length = N
    assert cache.global_bytes_per_token() == want


def test_slot_decoding_at_different_lengths_equals_the_whole_sequence(model):
    """Continuous batching: three sequences prefilled to different lengths (window rows, unfinished
    m-blocks and global entry counts all differ) decode together one token each per forward;
    every row's logits are those of one forward over its whole sequence. Then a slot is freed and
    refilled by a new sequence mid-run, with a page size small enough that pages are reused."""
    from inference.slots import SlotCache
    ids = _ids(48, seed=7)
    seqs = [ids[0, :40], ids[1, :33], ids[0, 5:46], ids[1, 2:29]]
    with torch.no_grad():
        want = [model(s[None]).logits[0] for s in seqs]  # [T, V] each
    slots = SlotCache(model, 3, packed=model.packed_cache, page=4)
    starts = {0: (0, 17), 1: (1, 9), 2: (2, 30)}  # slot -> (sequence, prompt length)
    for slot, (i, n) in starts.items():
        cache = DecodeCache(1, packed=model.packed_cache)
        forward_new(model, cache, seqs[i][None, :n])
        slots.insert(slot, cache)
    at = {slot: n for slot, (i, n) in starts.items()}
    seq_of = {slot: i for slot, (i, _) in starts.items()}
    refilled = False
    for _ in range(14):
        busy = sorted(at)
        feed = torch.stack([seqs[seq_of[s]][at[s]] for s in busy])[:, None]  # [B, 1]
        slots.begin(busy, feed)
        with torch.no_grad():
            logits = model(feed, shard=slots).logits[:, 0]
        slots.end(feed)
        for b, s in enumerate(busy):
            torch.testing.assert_close(logits[b], want[seq_of[s]][at[s]], rtol=0, atol=1e-10)
            at[s] += 1
        if not refilled and at[2] == 35:  # sequence 2 leaves; sequence 3 takes its slot
            slots.release(2)
            cache = DecodeCache(1, packed=model.packed_cache)
            forward_new(model, cache, seqs[3][None, :11])
            slots.insert(2, cache)
            at[2], seq_of[2], refilled = 11, 3, True
    assert refilled and at[2] > 11
    # a slot copied back out holds what a 1-sequence cache of the same tokens holds
    ref = DecodeCache(1, packed=model.packed_cache)
    forward_new(model, ref, seqs[0][None, :at[0]])
    got = slots.extract(0)
    assert got.length == ref.length and got.nbytes()["global"] == ref.nbytes()["global"]
    for key, store in ref.entries.items():
        torch.testing.assert_close(got.entries[key].read(torch.float64), store.read(torch.float64), rtol=0,
                                   atol=1e-12)


def test_slot_steps_of_several_tokens_with_rollback_equal_the_whole_sequence(model):
    """Speculative verification on the slot cache: each step feeds 1..4 tokens per row, of which
    only the first keep[b] are the sequence's (the rest are wrong drafts), and keeps those. Every
    logit computed from a right prefix is the whole-sequence forward's, so nothing a rejected
    token wrote (window rows, block rows, a compressed entry it completed, its id) is seen later;
    rows sit at different lengths and m-block phases, and a slot copied out holds what a
    1-sequence cache of its kept tokens holds."""
    from inference.slots import SlotCache
    ids = _ids(64, seed=11)
    seqs = [ids[0, :60], ids[1, :57], ids[0, 7:62]]
    with torch.no_grad():
        want = [model(s[None]).logits[0] for s in seqs]
    slots = SlotCache(model, 3, packed=model.packed_cache, page=4, lookahead=4)
    at = {0: 9, 1: 16, 2: 4}
    for s, n in at.items():
        cache = DecodeCache(1, packed=model.packed_cache)
        forward_new(model, cache, seqs[s][None, :n])
        slots.insert(s, cache)
    rng = random.Random(3)
    kept_short = 0
    for _ in range(14):
        busy = sorted(at)
        T = rng.randint(1, 4)
        keep = [rng.randint(1, T) for _ in busy]
        feed = torch.stack([seqs[s][at[s]:at[s] + T] for s in busy])  # [B, T]
        for b, n in enumerate(keep):  # a wrong token after the kept ones
            if n < T:
                feed[b, n] = (feed[b, n] + 1 + rng.randrange(96)) % 97
        slots.begin(busy, feed)
        with torch.no_grad():
            logits = model(feed, shard=slots).logits
        slots.end(feed, keep)
        for b, s in enumerate(busy):
            right = want[s][at[s]:at[s] + keep[b]]
            torch.testing.assert_close(logits[b, :keep[b]], right, rtol=0, atol=1e-10)
            at[s] += keep[b]
            kept_short += keep[b] < T
    assert kept_short >= 10 and slots.lengths == [at[0], at[1], at[2]]
    ref = DecodeCache(1, packed=model.packed_cache)
    forward_new(model, ref, seqs[1][None, :at[1]])
    got = slots.extract(1)
    assert got.length == ref.length
    for key, store in ref.entries.items():
        torch.testing.assert_close(got.entries[key].read(torch.float64), store.read(torch.float64), rtol=0,
                                   atol=1e-12)
    for layer, rows in ref.pending.items():
        torch.testing.assert_close(got.pending[layer], rows, rtol=0, atol=0)
    with pytest.raises(ValueError, match="lookahead 4"):
        slots.begin([0], torch.zeros(1, 5, dtype=torch.long))


def test_continuous_batching_gives_each_prompt_what_it_gets_alone(model):
    """Seven prompts of different lengths through 3 slots (so finished sequences hand their slot
    on), greedy and sampled: every prompt's tokens equal those of generating it alone, and a stop
    token ends a sequence early without disturbing the others. (Sampled tokens match across
    max_batch because prompt i draws from its own generator.)"""
    prompts = [_ids(n, seed=10 + n)[0].tolist() for n in (5, 19, 3, 27, 11, 8, 40)]
    kw = dict(max_new_tokens=9, packed=model.packed_cache)
    for temperature in (0.0, 1.0):
        batched = generate(model, prompts, temperature=temperature, seed=3, max_batch=3, **kw)
        one_slot = generate(model, prompts, temperature=temperature, seed=3, max_batch=1, **kw)
        assert [g.tokens for g in batched] == [g.tokens for g in one_slot]
        for a, b in zip(batched, one_slot):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-9)
            assert a.token_layer_passes == b.token_layer_passes
        if temperature == 0:
            alone = [generate(model, [p], temperature=0, **kw)[0] for p in prompts]
            assert [g.tokens for g in batched] == [g.tokens for g in alone]
    stop = {batched[1].tokens[2]}
    with_stop = generate(model, prompts, temperature=1.0, seed=3, max_batch=3, stop=stop, **kw)
    for a, b in zip(with_stop, batched):
        cut = next((k + 1 for k, t in enumerate(b.tokens) if t in stop), len(b.tokens))
        assert (a.tokens == b.tokens[:cut]
                and a.finish == ("stop" if cut < len(b.tokens) or b.tokens[-1] in stop else "length"))
    with pytest.raises(ValueError, match="max_batch"):
        generate(model, prompts, max_new_tokens=1, max_batch=0)


def test_decode_state_kept_across_calls_gives_what_fresh_calls_give(model):
    """DecodeEngines (a rollout worker's, across policy versions): calls with one setting reuse one
    slot cache, sampling rows and decode step, and each gives what a call with its own state gives,
    also after a call that raised mid-decode left slots taken; another setting gets its own."""
    from inference.generate import DecodeEngines

    kw = dict(max_new_tokens=6, temperature=1.0, max_batch=2, packed=model.packed_cache)
    calls = [[_ids(n, seed=40 + n + 7 * c)[0].tolist() for n in (5, 19, 27)] for c in range(2)]
    engines = DecodeEngines(model)
    for c, prompts in enumerate(calls):
        kept = generate(model, prompts, seed=c, engines=engines, **kw)
        fresh = generate(model, prompts, seed=c, **kw)
        assert [g.tokens for g in kept] == [g.tokens for g in fresh]
        for a, b in zip(kept, fresh):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-9)
    assert len(engines) == 1
    ((slots, _, step),) = engines._kept.values()
    assert step.counts["eager"] >= 2 * 5  # one step object ran every call's decode steps

    class Stop(Exception):
        pass

    def failing(busy, steps=[0]):  # noqa: B006 - counts this stand-in's calls
        steps[0] += 1
        if steps[0] == 3:
            raise Stop
        return step(busy)

    key = next(iter(engines._kept))
    engines._kept[key] = (slots, engines._kept[key][1], failing)
    with pytest.raises(Stop):
        generate(model, calls[1], seed=5, engines=engines, **kw)
    assert any(slots.lengths)  # the raised call left its slots taken: the next call takes them over
    engines._kept[key] = (slots, engines._kept[key][1], step)
    after = generate(model, calls[0], seed=5, engines=engines, **kw)
    assert [g.tokens for g in after] == [g.tokens for g in generate(model, calls[0], seed=5, **kw)]

    generate(model, calls[0][:1], seed=0, engines=engines, **{**kw, "temperature": 0.0, "max_new_tokens": 2})
    assert len(engines) == 2
    other = Transformer(CFG).double().eval()
    with pytest.raises(ValueError, match="another model"):
        generate(other, calls[0], engines=engines, **kw)


def test_a_repeated_prompt_is_prefilled_once(model, monkeypatch):
    """An RL group's samples of one prompt: the prompt's copies share one prefill (a copy that waits
    for a slot takes the kept one) and sample exactly what copies prefilled one by one do, each from
    its own stream."""
    from inference import generate as generate_module

    a, b = _ids(13, seed=1)[0].tolist(), _ids(6, seed=2)[0].tolist()
    prompts = [a, b, a, a, b]
    calls = []
    real = generate_module._prefill

    def counted(model, prompt, *args):
        calls.append(tuple(prompt))
        return real(model, prompt, *args)

    class Unshared(generate_module.SharedPrefills):
        def __init__(self, prompts, prefill, enabled=True):
            super().__init__(prompts, prefill, enabled=False)

    monkeypatch.setattr(generate_module, "_prefill", counted)
    kw = dict(max_new_tokens=9, temperature=1.0, seed=4, max_batch=2, packed=model.packed_cache)
    shared = generate(model, prompts, **kw)
    assert calls == [tuple(a), tuple(b)]
    monkeypatch.setattr(generate_module, "SharedPrefills", Unshared)
    calls[:] = []
    alone = generate(model, prompts, **kw)
    assert len(calls) == 5
    assert [g.tokens for g in shared] == [g.tokens for g in alone]
    for s, u in zip(shared, alone):
        torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(u.logprobs), rtol=0, atol=0)
    assert shared[0].tokens != shared[2].tokens  # each copy its own draws
    # the copies that reused a prefill count only their decode passes
    assert [s.token_layer_passes == u.token_layer_passes for s, u in zip(shared, alone)] == [
        True, True, False, False, False]
    assert all(s.token_layer_passes < u.token_layer_passes for s, u in zip(shared[2:], alone[2:]))


def test_rollout_log_probs_are_the_training_forwards(model):
    """What RL trains against: the engine's log-prob of each token it sampled (temperature 1, top-p
    1) equals the policy's training forward over prompt + response (rl/policy.py), when the cache
    stores what that forward computes (packed only for a model trained with KV QAT, as
    rl/workers.py picks) and the prompt fits the replay. A packed cache under a model trained
    without QAT, or a prompt longer than the replay, gives measurably different log-probs."""
    from rl.policy import behaviour_logprobs, response_logprobs

    def gap(prompts, packed, replay):
        gens = generate(model, prompts, 12, temperature=1.0, packed=packed, replay=replay, seed=3)
        samples = [{"prompt": p, "response": g.tokens, "behaviour": g.logprobs}
                   for p, g in zip(prompts, gens)]
        with torch.no_grad():
            logp, mask = response_logprobs(model, samples, pad_id=0)
        return float(((logp - behaviour_logprobs(samples, logp)).abs() * mask).max())

    short = [_ids(20, seed=s)[0].tolist() for s in (1, 2)]
    long = [_ids(48, seed=s)[0].tolist() for s in (4, 5)]
    assert gap(short, model.packed_cache, 128) < 1e-5
    assert gap(long, model.packed_cache, 128) < 1e-5
    assert gap(long, model.packed_cache, 16) > 1e-6  # CED's boundary: the rollout is not the forward
    if not model.packed_cache:
        assert gap(short, True, 128) > 1e-6  # a quantised cache under an unquantised forward


def test_sample_rows_draws_each_rows_distribution():
    """The engine's batched sampler: every row inverts its own CDF at a counter-based uniform draw.
    A chi-square test per row over many counters (a row with a top-p nucleus never draws outside
    it), a draw depends on its row's seed and counter only (not on the batch around it), and
    greedy is the argmax."""
    from inference.generate import sample_rows, sampling_logprobs
    from tests.test_dspark import _chi_square_p

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, generator=g)
    n = 20_000
    seeds = torch.tensor([5, 6, 2**62 + 7])
    rows = torch.arange(3).repeat_interleave(n)
    counters = torch.arange(n).repeat(3)
    for temperature, top_p in ((1.0, 1.0), (0.7, 0.8)):
        tokens, logp = sample_rows(logits[rows], temperature, top_p, seeds[rows], counters)
        want = sampling_logprobs(logits, temperature, top_p).exp()  # [3, V]
        torch.testing.assert_close(logp, want[rows, tokens].log(), rtol=0, atol=1e-6)
        for r in range(3):
            counts = torch.bincount(tokens[rows == r], minlength=6).double()
            keep = want[r] > 0
            assert counts[~keep].sum() == 0 and (top_p == 1.0 or 2 <= keep.sum() < 6), keep
            assert _chi_square_p(counts[keep], want[r][keep].double()) > 1e-3, (temperature, r, counts)
    alone, _ = sample_rows(logits[1:2], 1.0, 1.0, seeds[1:2], torch.tensor([17]))
    batched, _ = sample_rows(logits, 1.0, 1.0, seeds, torch.tensor([3, 17, 4]))
    assert alone[0] == batched[1]
    greedy, lp = sample_rows(logits, 0.0, 1.0, seeds, torch.tensor([0, 0, 0]))
    assert greedy.tolist() == logits.argmax(-1).tolist()
    torch.testing.assert_close(lp, logits.log_softmax(-1).max(-1).values)


def test_read_widths_come_in_few_buckets():
    """A step reads the global entries of `capacity(longest + 1)` tokens: never fewer than needed, a
    multiple of the quantum (whole pages of the largest ratio), at most 25% (or one quantum) more,
    and 4 widths per doubling of the length, so a captured step serves many lengths."""
    from inference.slots import capacity
    widths = [capacity(n, 128) for n in range(1, 20_000)]
    for n, w in enumerate(widths, start=1):
        assert w >= n and w % 128 == 0 and w <= max(1.25 * n, n + 128), (n, w)
    assert widths == sorted(widths)
    assert len({w for n, w in enumerate(widths, start=1) if 4096 < n <= 8192}) == 4


def test_decode_step_with_padding_rows_equals_the_whole_sequence(model):
    """The engine's step (inference/graphs.py, eager on a CPU): 3 busy slots of 5 are padded to a
    batch of 4 with a free slot, whose rows write only where no busy slot reads; every busy row's
    logits are those of one forward over its whole sequence, also for a sequence that later takes
    the slot the padding ran on."""
    from inference.graphs import DecodeStep, batch_bucket
    from inference.slots import SlotCache

    ids = _ids(48, seed=9)
    seqs = {0: ids[0, :44], 2: ids[1, :40], 4: ids[0, 3:47], 1: ids[1, 5:37]}
    with torch.no_grad():
        want = {s: model(q[None]).logits[0] for s, q in seqs.items()}
    slots = SlotCache(model, 5, packed=model.packed_cache, page=4)
    at = {0: 13, 2: 21, 4: 6}
    feed = torch.zeros(5, dtype=torch.long)
    got = {}

    def post(logits, rows):
        got["logits"] = logits
        return (logits,)

    def prefill(s):
        cache = DecodeCache(1, packed=model.packed_cache)
        forward_new(model, cache, seqs[s][None, :at[s]])
        slots.insert(s, cache)

    for s in at:
        prefill(s)
    step = DecodeStep(model, slots, lambda rows: feed[rows][:, None], post)
    assert batch_bucket(3, 5) == 4 and not step.graphs_on
    for n in range(16):
        if n == 8:  # slot 1, the padding row so far, takes a sequence
            at[1] = 9
            prefill(1)
        busy = sorted(at)
        for s in busy:
            feed[s] = seqs[s][at[s]]
        (logits,) = step(busy)
        for b, s in enumerate(busy):
            torch.testing.assert_close(logits[b], want[s][at[s]], rtol=0, atol=1e-10)
            at[s] += 1
    assert step.counts["eager"] == 16


def test_stop_tokens_read_late_are_cut_as_if_read_at_once(model, monkeypatch):
    """Stop flags that reach the host steps after the step that drew the token (as behind CUDA
    graph replays; here the host sees them only every fifth step), and polling every 16 steps: what
    a generation keeps (tokens, log-probs, finish, work) is what looking after every token keeps."""
    from inference import generate as generate_module
    prompts = [_ids(n, seed=20 + n)[0].tolist() for n in (4, 13, 7)]
    kw = dict(max_new_tokens=10, temperature=1.0, seed=2, max_batch=2, packed=model.packed_cache)
    free = generate(model, prompts, **kw)
    stop = {free[0].tokens[3], free[2].tokens[1], 1000}  # 1000: past the vocabulary, never drawn
    at_once = generate(model, prompts, stop=stop, check_every=1, **kw)
    polled = generate(model, prompts, stop=stop, check_every=16, **kw)
    real, calls = generate_module._EndedWatch.take, [0]

    def late(self):
        calls[0] += 1
        return real(self) if calls[0] % 5 == 0 else []

    monkeypatch.setattr(generate_module._EndedWatch, "take", late)
    flagged_late = generate(model, prompts, stop=stop, **kw)
    assert any(g.finish == "stop" for g in at_once) and calls[0] > 5
    for run in (polled, flagged_late):
        for a, b in zip(run, at_once):
            assert (a.tokens, a.logprobs, a.finish, a.token_layer_passes) == (b.tokens, b.logprobs, b.finish,
                                                                              b.token_layer_passes)


def test_a_step_the_device_never_finishes_raises_at_the_deadline_naming_it():
    """The host's wait for the step two back polls with a deadline: a step whose event never
    completes (a hung device) raises a TimeoutError naming the wait, instead of blocking forever."""
    import time

    from inference.generate import _EndedWatch

    class NeverDone:
        def query(self):
            return False

    watch = _EndedWatch(torch.zeros(4, dtype=torch.bool), hung_s=0.2)
    began = time.monotonic()
    with pytest.raises(TimeoutError, match="decode step queued 2 steps back has not finished.*hung"):
        watch._wait(NeverDone())
    assert 0.2 <= time.monotonic() - began < 5


def test_a_sequence_that_drew_a_stop_token_leaves_without_a_poll(model):
    """The device flags a drawn stop token and the host reads the flags behind the steps (on the CPU
    at once): a sequence leaves right after the step that drew it, so four prompts decoding together
    run as many steps as the longest needs, not until a poll (the host used to look every 16 steps);
    and each keeps what looking after every token keeps."""
    from inference.generate import DecodeEngines
    prompts = [_ids(n, seed=40 + n)[0].tolist() for n in (4, 13, 7, 10)]
    kw = dict(max_new_tokens=30, temperature=1.0, seed=3, max_batch=4, packed=model.packed_cache)
    free = generate(model, prompts, **kw)
    stop = {free[0].tokens[3], free[1].tokens[5], free[2].tokens[2], free[3].tokens[4]}
    engines = DecodeEngines(model)
    flagged = generate(model, prompts, stop=stop, engines=engines, **kw)
    at_once = generate(model, prompts, stop=stop, check_every=1, **kw)
    assert all(g.finish == "stop" for g in flagged)
    for a, b in zip(flagged, at_once):
        assert (a.tokens, a.logprobs, a.token_layer_passes) == (b.tokens, b.logprobs, b.token_layer_passes)
    ((_, _, step),) = engines._kept.values()
    assert step.counts["eager"] == max(len(g.tokens) for g in flagged) - 1 < 16  # the first token: prefill


@pytest.mark.slow
def test_a_compiled_decode_step_gives_the_eager_steps_tokens_and_compiles_once():
    """The decode step's forward through torch.compile (dynamo's "eager" backend on a CPU: what is
    checked is dynamo's tracing of the model and of the slot cache's hooks, their per-step index
    tensors shared across layers and their writes into the cache) gives the eager step's greedy
    tokens and log-probs exactly, at a batch of two and of one; a second call with the kept decode
    state compiles nothing new. The experts run grouped, as on a GPU (their per-expert
    loop reads the routing counts on the host: a graph break and a recompile every step)."""
    from torch._dynamo.utils import counters

    from inference.generate import DecodeEngines
    from model.moe import RoutedExperts

    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(CFG, window=16, pool_block=4)).eval()
    for module in model.modules():
        if isinstance(module, RoutedExperts):
            module.grouped = True
    prompts = [_ids(n, seed=70 + n)[0].tolist() for n in (5, 41, 19)]
    kw = dict(max_new_tokens=8, temperature=0.0, max_batch=2)
    eager = generate(model, prompts, **kw)
    engines = DecodeEngines(model)
    compiled = generate(model, prompts, compile="eager", engines=engines, **kw)
    graphs = counters["stats"]["unique_graphs"]
    again = generate(model, prompts, compile="eager", engines=engines, **kw)
    assert graphs > 0 and counters["stats"]["unique_graphs"] == graphs
    for run in (compiled, again):
        assert [g.tokens for g in run] == [g.tokens for g in eager]
        assert [g.logprobs for g in run] == [g.logprobs for g in eager]


@pytest.mark.gpu
def test_inductor_compiled_decode_captured_in_graphs_equals_the_eager_forward_on_gpu():
    """The step's forward compiled by inductor, then captured and replayed (kernels on, bf16): the
    greedy tokens of the eager-forward graphs, log-probs within 1/16 nats (inductor keeps fp32
    between the ops it fuses where the eager forward rounds each op's output to bf16, so the two
    hidden states part by a bf16 rounding in every layer), and the steps replayed with no capture
    failing."""
    from inference.generate import DecodeEngines
    from model.ops import OPS, KernelPolicy

    torch.manual_seed(0)
    cfg = dataclasses.replace(CFG, window=32, index_topk=16, pool_block=4, pool_blocks=4)
    with torch.device("cuda"):
        model = KernelPolicy(OPS).apply(Transformer(cfg)).to(torch.bfloat16).eval()
    prompts = [_ids(n, seed=80 + n)[0].tolist() for n in (5, 70, 33, 140, 9)]
    kw = dict(max_new_tokens=32, temperature=0.0, max_batch=4, graphs=True)
    plain = generate(model, prompts, **kw)
    engines = DecodeEngines(model)
    for _ in range(2):  # the second call replays what the first compiled and captured
        compiled = generate(model, prompts, compile="inductor", engines=engines, **kw)
    assert [g.tokens for g in compiled] == [g.tokens for g in plain]
    for a, b in zip(compiled, plain):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1 / 16)
    ((_, _, step),) = engines._kept.values()
    assert step.counts["replayed"] > 0 and not step.failed, (step.counts, step.failed)


@pytest.mark.gpu
def test_cuda_graph_decode_equals_eager_on_gpu():
    """The decode step replayed from CUDA graphs (kernels on, bf16) gives eager's greedy tokens and
    log-probs, through batch buckets that shrink as sequences finish and read widths that grow;
    and the step is in fact replayed, not run eagerly every time."""
    from inference.generate import _Rows
    from inference.graphs import DecodeStep
    from inference.slots import SlotCache
    from model.ops import OPS, KernelPolicy

    torch.manual_seed(0)
    cfg = dataclasses.replace(CFG, window=32, index_topk=16, pool_block=4, pool_blocks=4)
    with torch.device("cuda"):
        model = KernelPolicy(OPS).apply(Transformer(cfg)).to(torch.bfloat16).eval()
    prompts = [_ids(n, seed=30 + n)[0].tolist() for n in (5, 70, 33, 140, 9, 100, 61)]
    kw = dict(max_new_tokens=40, temperature=0.0, max_batch=4)
    eager = generate(model, prompts, graphs=False, **kw)
    graphed = generate(model, prompts, graphs=True, **kw)
    assert [g.tokens for g in graphed] == [g.tokens for g in eager]
    for a, b in zip(graphed, eager):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)

    runs = {}
    for graphs in (False, True):
        slots = SlotCache(model, 4)
        state = _Rows(4, 80, 0.0, 1.0, "cuda")
        for s, p in enumerate(prompts[:3]):
            cache = DecodeCache(1)
            logits = prefill_ced(model, cache, torch.tensor([p], device="cuda"))[:, -1]
            state.start(s, s, logits.float())
            slots.insert(s, cache)
        step = DecodeStep(model, slots, state.feed, state.post, graphs=graphs)
        for _ in range(60):
            step([0, 1, 2])
        runs[graphs] = (state.tokens[:3].tolist(), step.counts, step.failed)
    assert runs[True][0] == runs[False][0]
    assert not runs[True][2] and runs[True][1]["replayed"] > 40, runs[True][1:]


@pytest.mark.gpu
def test_stop_flags_read_behind_graph_replays_keep_what_looking_after_every_token_keeps_on_gpu():
    """With CUDA graphs the stop flags reach the host a step or two late, behind the replays: each
    generation still keeps (tokens, log-probs, finish) what an eager run looking after every token
    keeps, and the steps were replayed. The host runs at most two steps ahead of the device, so a
    call takes at most three more steps per prompt than one that reads every token at once (a host
    free to run ahead reads the flags tens of steps late)."""
    from inference.generate import DecodeEngines
    from model.ops import OPS, KernelPolicy

    torch.manual_seed(0)
    cfg = dataclasses.replace(CFG, window=32, index_topk=16, pool_block=4, pool_blocks=4)
    with torch.device("cuda"):
        model = KernelPolicy(OPS).apply(Transformer(cfg)).to(torch.bfloat16).eval()
    prompts = [_ids(n, seed=60 + n)[0].tolist() for n in (5, 70, 33, 9, 21, 48)]
    kw = dict(max_new_tokens=24, temperature=0.0, max_batch=4)
    free = generate(model, prompts, graphs=False, **kw)
    stop = {free[0].tokens[6], free[2].tokens[3], free[4].tokens[9]}
    engines = DecodeEngines(model)
    for _ in range(3):  # the later calls replay what the first ones captured
        flagged = generate(model, prompts, stop=stop, graphs=True, engines=engines, **kw)
    polled = generate(model, prompts, stop=stop, graphs=False, check_every=1, **kw)
    assert any(g.finish == "stop" for g in polled)
    assert [(g.tokens, g.finish) for g in flagged] == [(g.tokens, g.finish) for g in polled]
    for a, b in zip(flagged, polled):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)
    ((_, _, step),) = engines._kept.values()
    assert step.counts["replayed"] > 0 and not step.failed, (step.counts, step.failed)
    before = sum(step.counts.values())
    generate(model, prompts, stop=stop, graphs=True, engines=engines, **kw)
    flagged_steps = sum(step.counts.values()) - before
    at_once = DecodeEngines(model)
    generate(model, prompts, stop=stop, graphs=True, check_every=1, engines=at_once, **kw)
    ((_, _, step_at_once),) = at_once._kept.values()
    assert flagged_steps <= sum(step_at_once.counts.values()) + 3 * len(prompts), (
        flagged_steps, step_at_once.counts)


@pytest.mark.gpu
def test_decode_state_kept_across_calls_replays_the_earlier_calls_graphs_on_gpu():
    """A second call with kept decode state (DecodeEngines) replays the graphs the first captured:
    no step runs eagerly or is captured again, and the tokens equal a fresh call's."""
    from inference.generate import DecodeEngines
    from model.ops import OPS, KernelPolicy

    torch.manual_seed(0)
    cfg = dataclasses.replace(CFG, window=32, index_topk=16, pool_block=4, pool_blocks=4)
    with torch.device("cuda"):
        model = KernelPolicy(OPS).apply(Transformer(cfg)).to(torch.bfloat16).eval()
    prompts = [_ids(n, seed=50 + n)[0].tolist() for n in (5, 70, 33, 9)]
    kw = dict(max_new_tokens=24, temperature=0.0, max_batch=4, graphs=True)
    engines = DecodeEngines(model)
    generate(model, prompts, engines=engines, **kw)
    generate(model, prompts, engines=engines, **kw)  # every shape seen is captured here
    ((_, _, step),) = engines._kept.values()
    before = dict(step.counts)
    kept = generate(model, prompts, engines=engines, **kw)
    assert step.counts["eager"] == before["eager"] and step.counts["captured"] == before["captured"]
    assert step.counts["replayed"] > before["replayed"], (before, step.counts)
    assert [g.tokens for g in kept] == [g.tokens for g in generate(model, prompts, **kw)]
