"""Tests for model/engram.py. Expected values come from the spec's numbers, trial division, the public
reference's definitions evaluated by hand (numpy's generator, plain Python ints) and written down as
literals, and a plain Python loop over the hash formula, never from the code under test."""

from __future__ import annotations

import dataclasses
import math
import random
import time

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from conf.model import FlashModelConfig, TinyModelConfig
from model.engram import (
    Engram,
    build_compression_map,
    engram_hash_multipliers,
    engram_table_params,
    engram_table_primes,
)
from model.transformer import Transformer

TINY = TinyModelConfig(vocab_size=1000)  # layers 1 and 2, orders 2-4, 2 heads, rows above 1000

# numpy.random.default_rng(10007 * layer).integers(0, (2**63 - 1) // vocab // 2, size=4) * 2 + 1,
# evaluated once in a scratch shell (bounds 4611686018427387 and 46539438283891)
MULT = {
    (1, 1000): [7593627661414631, 479593001838623, 3563315849468963, 7331553243427023],
    (2, 1000): [7581278190532785, 3676095719277115, 2244174728982399, 7077601700902431],
    (1, 99092): [76632096046245, 4839876093313, 35959672319349, 73987337458391],
    (2, 99092): [76507469730479, 37097805264573, 22647385550623, 71424551940645],
}


def is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, math.isqrt(n) + 1))


def primes_after(lo: int, count: int) -> list[int]:
    out, n = [], lo
    while len(out) < count:
        n += 1
        if is_prime(n):
            out.append(n)
    return out


def reference_addresses(ids: list[int], starts: list[int], mult: list[int], primes: list[int],
                        orders: list[int], heads: int, pad: int) -> list[list[int]]:
    """The hash formula position by position: XOR_{i < n} ids[t - i] * mult[i], the same value for
    every head of order n, mod the head's prime, plus its offset."""
    out = []
    for t in range(len(ids)):
        row, offset = [], 0
        for o, n in enumerate(orders):
            x = 0
            for i in range(n):
                x ^= (ids[t - i] if t - i >= starts[t] else pad) * mult[i]
            for k in range(heads):
                prime = primes[o * heads + k]
                row.append(offset + x % prime)
                offset += prime
        out.append(row)
    return out


# --------------------------------------------------------------------------- table sizes
def test_full_scale_prime_totals():
    cfg = FlashModelConfig()
    start = time.perf_counter()
    primes = engram_table_primes(cfg)
    assert time.perf_counter() - start < 1.0
    assert list(primes) == [1, 14]
    assert sum(primes[1]) == 384_006_168
    assert sum(primes[14]) == 384_016_682
    flat = primes[1] + primes[14]
    assert len(flat) == 48 and len(set(flat)) == 48
    assert flat == primes_after(16_000_000, 48)  # consecutive primes above the minimum, in order
    assert engram_table_params(cfg) == (384_006_168 + 384_016_682) * 256


def test_tiny_primes_are_consecutive():
    cfg = TINY
    primes = engram_table_primes(cfg)
    per_layer = len(cfg.engram_orders) * cfg.engram_heads
    expected = primes_after(cfg.engram_min_rows, 2 * per_layer)
    first, second = cfg.engram_layers
    assert primes == {first: expected[:per_layer], second: expected[per_layer:]}


# --------------------------------------------------------------------------- hashing
@pytest.mark.parametrize("layer,vocab", list(MULT))
def test_multipliers_golden(layer: int, vocab: int):
    mult = engram_hash_multipliers(layer, 4, vocab)
    assert mult.dtype == torch.long and mult.tolist() == MULT[layer, vocab]
    cfg = dataclasses.replace(TINY, engram_min_rows=10)
    engram = Engram(cfg, layer, compressed_vocab=vocab)
    assert engram.multipliers.tolist() == MULT[layer, vocab]
    assert "multipliers" in engram.state_dict()  # a checkpoint carries its hashing
    assert engram_hash_multipliers(layer, 2, vocab).tolist() == MULT[layer, vocab][:2]  # a prefix of the draw
    # the bound: the largest id times any multiplier fits int64
    assert all(m % 2 == 1 and (vocab - 1) * m < 2**63 for m in MULT[layer, vocab])


def test_multipliers_default_to_vocab_size():
    assert Engram(dataclasses.replace(TINY, engram_min_rows=10), 2).multipliers.tolist() == MULT[2, 1000]
    with pytest.raises(ValueError, match="compressed_vocab"):
        Engram(TinyModelConfig(), 1)  # vocab_size unset and no compressed_vocab: nothing to draw from


# Tiny's layers 1 and 2 with rows above 10: primes 11 13 17 19 23 29 | 31 37 41 43 47 53 in (order, head)
# order; ids of a 1000-id compressed vocab (MULT above). Worked out with plain Python ints, XOR and %.
GOLDEN_IDS = [5, 17, 999, 0, 42, 7]
GOLDEN = {
    # layer, pad, doc_start -> addresses [T, orders * heads]
    (1, 2, (0, 0, 0, 0, 0, 0)): [[4, 13, 28, 52, 79, 109], [2, 17, 31, 54, 71, 95], [6, 22, 36, 49, 61, 101],
                                 [7, 17, 37, 41, 63, 99], [9, 13, 37, 55, 63, 94], [10, 19, 28, 42, 64, 100]],
    (2, 2, (0, 0, 0, 0, 0, 0)): [[26, 44, 101, 143, 191, 242], [11, 49, 85, 144, 194, 206],
                                 [1, 64, 76, 116, 163, 249], [17, 31, 88, 123, 173, 247],
                                 [1, 56, 77, 143, 167, 236], [30, 51, 90, 111, 192, 215]],
    # a second document from position 3: its first three positions see pads, like a sequence start
    (1, 2, (0, 0, 0, 3, 3, 3)): [[4, 13, 28, 52, 79, 109], [2, 17, 31, 54, 71, 95], [6, 22, 36, 49, 61, 101],
                                 [4, 18, 26, 59, 74, 100], [9, 13, 33, 46, 63, 92], [10, 19, 28, 42, 77, 86]],
    # another pad id changes exactly the positions whose n-grams reach before the start
    (1, 9, (0, 0, 0, 0, 0, 0)): [[10, 13, 32, 51, 64, 101], [2, 17, 24, 42, 71, 84], [6, 22, 36, 49, 69, 97],
                                 [7, 17, 37, 41, 63, 99], [9, 13, 37, 55, 63, 94], [10, 19, 28, 42, 64, 100]],
}


@pytest.mark.parametrize("key", list(GOLDEN), ids=["layer1", "layer2", "doc-boundary", "pad9"])
def test_addresses_golden(key):
    layer, pad, starts = key
    cfg = dataclasses.replace(TINY, engram_min_rows=10)
    engram = Engram(cfg, layer, pad_id=pad, compressed_vocab=1000)
    doc_start = torch.tensor([starts]) if any(starts) else None
    got = engram.addresses(torch.tensor([GOLDEN_IDS]), doc_start)
    assert got.tolist() == [GOLDEN[key]]


def test_addresses_match_reference_hash():
    cfg, pad = TINY, 7
    engram = Engram(cfg, cfg.engram_layers[1], pad_id=pad)
    mult = engram.multipliers.tolist()
    assert mult == MULT[2, 1000]
    per_layer = len(cfg.engram_orders) * cfg.engram_heads
    primes = primes_after(cfg.engram_min_rows, 2 * per_layer)[per_layer:]  # the second Engram layer

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (2, 9), generator=gen)
    ids[0, 4] = 999  # the largest id: products near 2^63
    doc_start = torch.tensor([[0] * 9, [0, 0, 0, 0, 4, 5, 5, 5, 5]])  # row 1: docs [0,4) [4,5) [5,9)
    got = engram.addresses(ids, doc_start)
    assert got.shape == (2, 9, per_layer) and got.dtype == torch.long
    for b in range(2):
        want = reference_addresses(ids[b].tolist(), doc_start[b].tolist(), mult, primes,
                                   cfg.engram_orders, cfg.engram_heads, pad)
        assert got[b].tolist() == want
    assert torch.equal(engram.addresses(ids[:1]), got[:1])  # doc_start=None: one document


def test_addresses_deterministic_and_in_range():
    cfg = TINY
    ids = torch.randint(0, 1000, (3, 50), generator=torch.Generator().manual_seed(1))
    a, b = Engram(cfg, 1), Engram(cfg, 1)
    assert torch.equal(a.multipliers, b.multipliers)
    assert torch.equal(a.addresses(ids), b.addresses(ids))
    assert not torch.equal(a.multipliers, Engram(cfg, cfg.engram_layers[1]).multipliers)  # drawn per layer

    primes = engram_table_primes(cfg)[1]
    addr = a.addresses(ids)  # [3, 50, O*H]
    offset = 0
    for k, prime in enumerate(primes):
        rel = addr[..., k] - offset
        assert rel.min() >= 0 and rel.max() < prime
        offset += prime
    assert offset == a.table.num_params // cfg.engram_dim


def test_transformer_draws_from_the_map_size():
    """The model's Engrams draw their multipliers for the number of lookup ids of its map."""
    cfg = dataclasses.replace(TINY, vocab_size=2000, engram_min_rows=10)
    lookup = torch.arange(2000) // 2  # 1000 lookup ids
    model = Transformer(cfg, lookup_map=lookup, lookup_pad_id=3)
    assert [model.engrams[str(i)].multipliers.tolist() for i in (1, 2)] == [MULT[1, 1000], MULT[2, 1000]]
    assert model.engrams["1"].pad_id == 3
    identity = Transformer(dataclasses.replace(cfg, vocab_size=1000))  # no map: the identity, 1000 ids
    assert identity.engrams["2"].multipliers.tolist() == MULT[2, 1000]


def test_pad_before_sequence_start():
    cfg, pad = TINY, 11
    engram = Engram(cfg, 1, pad_id=pad)
    ids = torch.tensor([[5, 9, 2, 8, 3]])
    padded = torch.cat([torch.full((1, 3), pad), ids], dim=1)  # explicit pad ids in front
    assert torch.equal(engram.addresses(ids), engram.addresses(padded)[:, 3:])


def test_pad_across_document_boundary():
    cfg, pad = TINY, 11
    engram = Engram(cfg, 1, pad_id=pad)
    doc_a, doc_b = torch.tensor([[4, 4, 6, 1]]), torch.tensor([[5, 9, 2, 8, 3]])
    packed = torch.cat([doc_a, doc_b], dim=1)
    doc_start = torch.tensor([[0, 0, 0, 0, 4, 4, 4, 4, 4]])
    got = engram.addresses(packed, doc_start)
    assert torch.equal(got[:, 4:], engram.addresses(doc_b))
    assert torch.equal(got[:, :4], engram.addresses(doc_a))
    assert not torch.equal(engram.addresses(packed)[:, 4:], got[:, 4:])  # without doc_start it differs


# --------------------------------------------------------------------------- gate and gradients
def _gate_engram(key_scale: list[float], value: torch.Tensor) -> Engram:
    """Tiny's Engram whose fused projection gives every token keys key_scale[s] * (+1, -1, ...) and
    the value `value`."""
    engram = Engram(TINY, 1)
    S, D, E = TINY.hc_mult, TINY.dim, engram.proj.in_features
    u = torch.tensor([1.0, -1.0]).repeat(D // 2)
    with torch.no_grad():
        engram.table.weight.fill_(1.0)  # every lookup row is ones, so proj input = ones(E)
        w = torch.zeros(S + 1, D, E)
        for s, a in enumerate(key_scale):
            w[s] = (a * u / E)[:, None]
        w[S] = (value / E)[:, None]
        engram.proj.weight.copy_(w.reshape((S + 1) * D, E))
    return engram


def test_gate_formula_hand_computed():
    """d_s = sum(h w_h w_k k) rstd(h) rstd(k) / sqrt(D) per stream with its own weights, and
    gate = sigmoid(copysign(sqrt(max(|d|, 1e-6)), d)), by hand for a +-1 pattern u (RMS 1)."""
    S, D, eps = TINY.hc_mult, TINY.dim, TINY.norm_eps
    u = torch.tensor([1.0, -1.0]).repeat(D // 2)
    v = torch.linspace(-1, 1, D)
    key_scale = [2.0, 2.0, 0.0, 1.0]  # stream 2 has a zero key: d = 0 exactly
    engram = _gate_engram(key_scale, v)
    w_h, w_k = [1.0, 0.5, 1.0, -1.0], [1.0, 0.5, 1.0, 1.0]  # streams 0 and 1 differ only here
    with torch.no_grad():
        engram.hidden_norm_weight.copy_(torch.tensor(w_h)[:, None].expand(S, D))
        engram.key_norm_weight.copy_(torch.tensor(w_k)[:, None].expand(S, D))
    agree_3_of_4 = torch.where(torch.arange(D) < D // 4, -u, u)
    h_scales = [3.0, 3.0, 7.0, 1.0]
    h_dirs = [u, u, u, agree_3_of_4]
    h = torch.stack([c * x for c, x in zip(h_scales, h_dirs)])[None, None].repeat(1, 2, 1, 1)  # [1, 2, S, D]

    agree = [D, D, D, D // 2]  # sum over D of sign(h) * sign(key)
    d = [w_h[s] * w_k[s] * h_scales[s] * key_scale[s] * agree[s]
         / math.sqrt(h_scales[s] ** 2 + eps) / math.sqrt(key_scale[s] ** 2 + eps) / math.sqrt(D)
         for s in range(S)]
    assert d[2] == 0.0 and d[3] < 0 and d[1] == pytest.approx(d[0] / 4)
    sig = lambda x: 1 / (1 + math.exp(-x))
    gates = [sig(math.copysign(math.sqrt(max(abs(x), 1e-6)), x)) for x in d]
    assert gates[2] == pytest.approx(0.5 + 1e-3 / 4, rel=1e-7)  # d = +0 leans open, unlike sign(d) = 0
    out = engram(h, torch.zeros(1, 2, dtype=torch.long))
    want = h + torch.tensor(gates)[None, None, :, None] * v
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(out[..., 0, :], out[..., 1, :])  # same h and key, other weights: other gate

    with torch.no_grad():  # only the product of the two weights counts
        engram.hidden_norm_weight[1].fill_(0.25)
        engram.key_norm_weight[1].fill_(1.0)
    torch.testing.assert_close(engram(h, torch.zeros(1, 2, dtype=torch.long)), out, rtol=0, atol=1e-6)


def test_gate_output_is_rounded_once():
    """bf16 streams: h + gate * value is formed in fp32 and rounded once. Zero keys make every gate
    sigmoid(1e-3) ~ 0.50025, so gate * 2^-7 = 2^-8 (1 + 5e-4): just past half of bf16's step 2^-7 at
    1.0, so 1 + it rounds up to 1 + 2^-7. Rounding the product to bf16 first (2^-8) would make the
    sum a tie and round it to 1."""
    engram = _gate_engram([0.0] * TINY.hc_mult, torch.full((TINY.dim,), 2.0**-7))
    h = torch.ones(1, 1, TINY.hc_mult, TINY.dim, dtype=torch.bfloat16)
    out = engram(h, torch.zeros(1, 1, dtype=torch.long))
    assert out.dtype == torch.bfloat16 and out.eq(1.0 + 2.0**-7).all()


@pytest.mark.parametrize("sparse", [False, True])
def test_gradient_reaches_only_looked_up_rows(sparse: bool):
    cfg = TINY
    engram = Engram(cfg, 1, sparse_grad=sparse)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 30, (2, 6), generator=gen)
    h = torch.randn(2, 6, cfg.hc_mult, cfg.dim, generator=gen)
    (engram(h, ids) * torch.randn(2, 6, cfg.hc_mult, cfg.dim, generator=gen)).sum().backward()
    grad = engram.table.weight.grad
    assert grad.is_sparse == sparse
    grad = grad.to_dense()
    touched = set(engram.addresses(ids).flatten().tolist())
    assert set(grad.abs().sum(1).nonzero().flatten().tolist()) == touched
    assert engram.proj.weight.grad is not None
    for w in (engram.hidden_norm_weight, engram.key_norm_weight):
        assert w.grad.shape == (cfg.hc_mult, cfg.dim) and (w.grad != 0).all(1).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_host_table_with_gpu_model():
    cfg = TINY
    engram = Engram(cfg, 1).cuda()
    engram.table.cpu()  # the table stays in host memory
    ids = torch.randint(0, 30, (2, 6), device="cuda")
    out = engram(torch.randn(2, 6, cfg.hc_mult, cfg.dim, device="cuda"), ids)
    assert out.is_cuda
    out.sum().backward()
    assert engram.table.weight.grad.device.type == "cpu"


# --------------------------------------------------------------------------- construction
def test_meta_build_flash_size():
    cfg = FlashModelConfig()
    start = time.perf_counter()
    with torch.device("meta"):
        engram = Engram(cfg, 14)
    assert time.perf_counter() - start < 0.5
    assert engram.table.weight.is_meta and engram.table.weight.shape == (384_016_682, 256)
    assert engram.proj.weight.shape == ((4 + 1) * 5120, 3 * 8 * 256)
    assert engram.table.num_params == 384_016_682 * 256


def test_meta_then_materialise_matches_direct_build():
    cfg = TINY
    with torch.device("meta"):
        engram = Engram(cfg, cfg.engram_layers[1], pad_id=2, compressed_vocab=99092)
    engram.to_empty(device="cpu")
    engram.reset_parameters()
    direct = Engram(cfg, cfg.engram_layers[1], pad_id=2, compressed_vocab=99092)
    assert engram.multipliers.tolist() == MULT[2, 99092]
    for name in ("multipliers", "primes", "offsets"):
        assert torch.equal(getattr(engram, name), getattr(direct, name)), name
    for w in (engram.hidden_norm_weight, engram.key_norm_weight):
        assert w.dtype == torch.float32 and w.shape == (cfg.hc_mult, cfg.dim) and w.eq(1).all()
    ids = torch.randint(0, 100, (1, 10))
    assert torch.equal(engram.addresses(ids), direct.addresses(ids))
    assert engram.table.weight.std().item() == pytest.approx(cfg.init_std, rel=0.1)


# --------------------------------------------------------------------------- compression map
WORDS = ["hello", "world", "café", "cafe", "naïve", "résumé", "über", "model", "token", "data",
         "crème", "brûlée", "señor", "jalapeño", "façade", "élan", "zürich", "garçon", "memory", "table",
         "prime", "hash", "stream", "gate", "value", "key", "layer", "order"]


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    """A byte-level BPE trained on ~50 KB of mixed-case, accented, oddly spaced text."""
    rng = random.Random(0)
    seps = [" ", " ", " ", "  ", "\n", "\t", ". "]
    lines = []
    for _ in range(600):
        words = [rng.choice([w, w.capitalize(), w.upper()]) for w in rng.choices(WORDS, k=12)]
        lines.append("".join(rng.choice(seps) + w for w in words))
    assert 40_000 < sum(len(line) for line in lines) < 70_000
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<pad>", "<PAD>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(lines, trainer)
    return tok


def test_compression_map_byte_level_bpe(bpe: Tokenizer):
    V = bpe.get_vocab_size(with_added_tokens=True)
    assert V == 600
    surface = {bpe.decode([i]): i for i in range(V) if "\ufffd" not in bpe.decode([i])}
    cmap, k = build_compression_map(bpe)
    assert cmap.shape == (V,) and cmap.dtype == torch.long
    assert k == len(set(cmap.tolist())) < V
    seen = -1
    for x in cmap.tolist():  # dense, in order of first occurrence
        assert x <= seen + 1
        seen = max(seen, x)

    def same(*texts: str) -> bool:
        return len({cmap[surface[t]].item() for t in texts}) == 1

    assert same(" hello", " Hello", " HELLO", "hello")  # the ends are stripped
    assert same(" café", " cafe", " Café", " CAFÉ", " CAFE")
    assert same(" naïve", " Naïve", " NAÏVE")
    assert same(" ", "\n", "\t")  # whitespace only: one space, kept
    assert not same(" ", " hello")

    partial = [i for i in range(V) if "\ufffd" in bpe.decode([i])]
    assert len(partial) >= 128  # at least the lone bytes 0x80-0xFF
    own = cmap[partial].tolist()
    assert len(set(own)) == len(own)  # keyed by their (distinct) raw token strings, not by "\ufffd"

    pad, PAD = bpe.token_to_id("<pad>"), bpe.token_to_id("<PAD>")
    assert cmap[pad] == cmap[PAD]  # special tokens are normalized like any text


def test_merged_tokens_hash_identically(bpe: Tokenizer):
    cmap, k = build_compression_map(bpe)
    a = torch.tensor([bpe.encode(" Hello world. Café über").ids])
    b = torch.tensor([bpe.encode(" hello WORLD. cafe Über").ids])
    assert a.shape == b.shape and not torch.equal(a, b)
    engram = Engram(TINY, 1, pad_id=int(cmap[bpe.token_to_id("<pad>")]), compressed_vocab=k)
    assert torch.equal(engram.addresses(cmap[a]), engram.addresses(cmap[b]))


def test_compression_map_hand_made_vocab():
    """A word-level vocab (tokens decode to themselves), keys by hand from the reference's rules."""
    vocab = [" Hello", " hello", "Hello", " ＨＥＬＬＯ", " ﬁne", " fine", " Café", " cafe", " cafe\u0301",
             "a b", "a  b", "a\tb", "a\n\nb", "x\ufffd", "X\ufffd", "\u0301", "\u0300", "<unk>"]
    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    tok.add_special_tokens(["<pad>", "<PAD>"])
    cmap, k = build_compression_map(tok, vocab_size=len(vocab) + 2 + 4)
    # hello x4, fine x2, cafe x3, "a b" x4, raw "x\ufffd", raw "X\ufffd", lone marks normalize to "" and
    # keep their text, unk, <pad> = <PAD>, padded ids -> 0
    want = [0, 0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 3, 3, 4, 5, 6, 7, 8, 9, 9, 0, 0, 0, 0]
    assert cmap.tolist() == want and k == 10
    assert build_compression_map(tok)[0].tolist() == want[:20]  # default: the tokenizer's size
    with pytest.raises(ValueError):
        build_compression_map(tok, vocab_size=3)


def _byte_level(text: str) -> str:
    """text as a byte-level BPE token string (one char per UTF-8 byte)."""
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(text)[0][0]


def test_compression_map_byte_level_tokens():
    """Byte-level tokens through the ByteLevel decoder: stripped ends, folded accents and case,
    whitespace-only tokens as " ", partial UTF-8 keyed by the raw token string, specials as text."""
    texts = [" tuple", "tuple", "Éte", "ete", " ", "  ", "\n", "\u0301", "\x0b", "<unk>"]
    partial = ["Ã", "Ä", "aÃ"]  # lone lead bytes 0xC3 / 0xC4: decode to U+FFFD
    vocab = [_byte_level(t) for t in texts] + partial
    unk = _byte_level("<unk>")
    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(vocab)}, unk_token=unk))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|pad|>", "<|PAD|>"])
    assert [tok.decode([i]) for i in range(10, 13)] == ["\ufffd", "\ufffd", "a\ufffd"]
    cmap, k = build_compression_map(tok, vocab_size=20)
    #      tuple  ete   " " x3   marks/VT: own text  unk  partial  pad x2  padded
    want = [0, 0, 1, 1, 2, 2, 2, 3, 4, 5, 6, 7, 8, 9, 9, 0, 0, 0, 0, 0]
    assert cmap.tolist() == want and k == 10


def test_compression_map_partial_key_shares_the_key_space():
    """A partial-UTF-8 token's key is its raw token string, in the same key space as normalized
    texts: byte 0xA0 alone is the byte-level char "ł", and the token for the text "ł" (bytes C5 82)
    normalizes to "ł" too, so the two share a lookup id."""
    vocab = ["ł", _byte_level("ł"), _byte_level("Ł"), "<unk>"]
    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    tok.decoder = decoders.ByteLevel()
    assert [tok.decode([i]) for i in range(3)] == ["\ufffd", "ł", "Ł"]
    cmap, k = build_compression_map(tok)
    assert cmap.tolist() == [0, 0, 0, 1] and k == 2
