"""The decode cache reproduces the training forward: prefill in chunks of any size, then one
token at a time, gives the logits of one forward over the whole sequence."""
import dataclasses

import pytest
import torch

from conf.model import TinyModelConfig
from model.transformer import Transformer
from rl.engine.cache import DecodeCache
from rl.engine.generate import forward_new, generate

# small window and top-k so the cache's window rows and the selection both matter at T=48
CFG = dataclasses.replace(TinyModelConfig(vocab_size=97), engram_min_rows=50, window=8, index_topk=4,
                          pool_block=2, pool_blocks=3)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Transformer(CFG).double().eval()


def _ids(T, seed=0):
    return torch.randint(0, 97, (2, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("chunks", [[48], [1] * 48, [7, 13, 1, 1, 26], [5, 3, 40]])
def test_cached_forward_equals_the_whole_sequence(model, chunks):
    ids = _ids(48)
    with torch.no_grad():
        want = model(ids).logits  # [2, 48, V]
    cache = DecodeCache(2)
    got, at = [], 0
    for n in chunks:
        got.append(forward_new(model, cache, ids[:, at:at + n]))
        at += n
    torch.testing.assert_close(torch.cat(got, dim=1), want, rtol=0, atol=1e-10)
    assert cache.length == 48
    assert all(w.shape[1] == CFG.window - 1 for w in cache.window.values())


def test_greedy_with_cache_equals_greedy_without(model):
    prompt = _ids(11, seed=1)[0].tolist()
    (gen,) = generate(model, [prompt], max_new_tokens=20, temperature=0)
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
