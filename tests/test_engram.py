"""Tests for model/engram.py. Expected values come from the spec's numbers, trial division and a plain
Python loop over the hash formula, never from the code under test."""

from __future__ import annotations

import math
import random
import time

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from conf.model import FlashModelConfig, TinyModelConfig
from model.engram import Engram, build_compression_map, engram_table_params, engram_table_primes


def is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, math.isqrt(n) + 1))


def primes_after(lo: int, count: int) -> list[int]:
    out, n = [], lo
    while len(out) < count:
        n += 1
        if is_prime(n):
            out.append(n)
    return out


def reference_addresses(ids: list[int], starts: list[int], mult: list, primes: list[int],
                        orders: list[int], heads: int, pad: int) -> list[list[int]]:
    """The hash formula position by position: XOR_i ids[t - i] * mult[o][k][i] mod prime, plus offset."""
    out = []
    for t in range(len(ids)):
        row, offset = [], 0
        for o, n in enumerate(orders):
            for k in range(heads):
                x = 0
                for i in range(n):
                    x ^= (ids[t - i] if t - i >= starts[t] else pad) * mult[o][k][i]
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
    cfg = TinyModelConfig()
    primes = engram_table_primes(cfg)
    per_layer = len(cfg.engram_orders) * cfg.engram_heads
    expected = primes_after(cfg.engram_min_rows, 2 * per_layer)
    first, second = cfg.engram_layers
    assert primes == {first: expected[:per_layer], second: expected[per_layer:]}


# --------------------------------------------------------------------------- hashing
def test_addresses_match_reference_hash():
    cfg = TinyModelConfig()
    pad = 7
    engram = Engram(cfg, cfg.engram_layers[1], pad_id=pad)
    mult = engram.multipliers.tolist()
    assert all(m % 2 == 1 and 0 < m < 2**31 for m in engram.multipliers.flatten().tolist())
    per_layer = len(cfg.engram_orders) * cfg.engram_heads
    primes = primes_after(cfg.engram_min_rows, 2 * per_layer)[per_layer:]  # the second Engram layer

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 2**20, (2, 9), generator=gen)
    doc_start = torch.tensor([[0] * 9, [0, 0, 0, 0, 4, 5, 5, 5, 5]])  # row 1: docs [0,4) [4,5) [5,9)
    got = engram.addresses(ids, doc_start)
    assert got.shape == (2, 9, per_layer) and got.dtype == torch.long
    for b in range(2):
        want = reference_addresses(ids[b].tolist(), doc_start[b].tolist(), mult, primes,
                                   cfg.engram_orders, cfg.engram_heads, pad)
        assert got[b].tolist() == want
    assert torch.equal(engram.addresses(ids[:1]), got[:1])  # doc_start=None: one document


def test_addresses_deterministic_and_in_range():
    cfg = TinyModelConfig()
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


def test_pad_before_sequence_start():
    cfg, pad = TinyModelConfig(), 11
    engram = Engram(cfg, 1, pad_id=pad)
    ids = torch.tensor([[5, 9, 2, 8, 3]])
    padded = torch.cat([torch.full((1, 3), pad), ids], dim=1)  # explicit pad ids in front
    assert torch.equal(engram.addresses(ids), engram.addresses(padded)[:, 3:])


def test_pad_across_document_boundary():
    cfg, pad = TinyModelConfig(), 11
    engram = Engram(cfg, 1, pad_id=pad)
    doc_a, doc_b = torch.tensor([[4, 4, 6, 1]]), torch.tensor([[5, 9, 2, 8, 3]])
    packed = torch.cat([doc_a, doc_b], dim=1)
    doc_start = torch.tensor([[0, 0, 0, 0, 4, 4, 4, 4, 4]])
    got = engram.addresses(packed, doc_start)
    assert torch.equal(got[:, 4:], engram.addresses(doc_b))
    assert torch.equal(got[:, :4], engram.addresses(doc_a))
    assert not torch.equal(engram.addresses(packed)[:, 4:], got[:, 4:])  # without doc_start it differs


# --------------------------------------------------------------------------- gate and gradients
def test_gate_formula_hand_computed():
    cfg = TinyModelConfig()
    engram = Engram(cfg, 1)
    S, D, E = cfg.hc_mult, cfg.dim, engram.proj.in_features
    u = torch.tensor([1.0, -1.0]).repeat(D // 2)  # a +-1 pattern: RMS 1
    v = torch.linspace(-1, 1, D)
    key_scale = [2.0, 0.5, 0.0, 1.0]  # stream 2 has a zero key: d = 0 exactly
    with torch.no_grad():
        engram.table.weight.fill_(1.0)  # every lookup row is ones, so proj input = ones(E)
        w = torch.zeros(S + 1, D, E)
        for s, a in enumerate(key_scale):
            w[s] = (a * u / E)[:, None]
        w[S] = (v / E)[:, None]
        engram.proj.weight.copy_(w.reshape((S + 1) * D, E))
    agree_3_of_4 = torch.where(torch.arange(D) < D // 4, -u, u)
    h_dirs = [u, -u, u, agree_3_of_4]
    h_scales = [3.0, 0.1, 7.0, 1.0]
    h = torch.stack([c * x for c, x in zip(h_scales, h_dirs)])[None, None].repeat(1, 2, 1, 1)  # [1, 2, S, D]

    root = 128**0.25  # |d| = sqrt(D) when hidden and key agree everywhere (D = 128)
    d3 = (D // 2) / D**0.5  # 3/4 agree: sum = D/2
    sig = lambda x: 1 / (1 + math.exp(-x))
    gates = torch.tensor([sig(root), sig(-root), 0.5, sig(math.sqrt(d3))])
    out = engram(h, torch.zeros(1, 2, dtype=torch.long))
    want = h + gates[None, None, :, None] * v
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sparse", [False, True])
def test_gradient_reaches_only_looked_up_rows(sparse: bool):
    cfg = TinyModelConfig()
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
    assert engram.proj.weight.grad is not None and engram.key_norm.weight.grad is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_host_table_with_gpu_model():
    cfg = TinyModelConfig()
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
    cfg = TinyModelConfig()
    with torch.device("meta"):
        engram = Engram(cfg, cfg.engram_layers[1], pad_id=2)
    engram.to_empty(device="cpu")
    engram.reset_parameters()
    direct = Engram(cfg, cfg.engram_layers[1], pad_id=2)
    for name in ("multipliers", "primes", "offsets"):
        assert torch.equal(getattr(engram, name), getattr(direct, name)), name
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

    assert same(" hello", " Hello", " HELLO")
    assert same(" café", " cafe", " Café", " CAFÉ", " CAFE")
    assert same(" naïve", " Naïve", " NAÏVE")
    assert same(" ", "\n", "\t")
    assert not same("hello", " hello")  # a leading space is kept (collapsed, not stripped)

    partial = [i for i in range(V) if "\ufffd" in bpe.decode([i])]
    assert len(partial) >= 128  # at least the lone bytes 0x80-0xFF
    own = cmap[partial].tolist()
    others = set(cmap[[i for i in range(V) if i not in set(partial)]].tolist())
    assert len(set(own)) == len(own) and not set(own) & others

    pad, PAD = bpe.token_to_id("<pad>"), bpe.token_to_id("<PAD>")
    assert cmap[pad] != cmap[PAD]  # special tokens are never merged


def test_merged_tokens_hash_identically(bpe: Tokenizer):
    cmap, _ = build_compression_map(bpe)
    a = torch.tensor([bpe.encode(" Hello world. Café über").ids])
    b = torch.tensor([bpe.encode(" hello WORLD. cafe Über").ids])
    assert a.shape == b.shape and not torch.equal(a, b)
    engram = Engram(TinyModelConfig(), 1, pad_id=int(cmap[bpe.token_to_id("<pad>")]))
    assert torch.equal(engram.addresses(cmap[a]), engram.addresses(cmap[b]))


def test_compression_map_hand_made_vocab():
    vocab = [" Hello", " hello", "Hello", " ＨＥＬＬＯ", " ﬁne", " fine", " Café", " cafe", " cafe\u0301",
             "a b", "a  b", "a\tb", "a\n\nb", "x\ufffd", "X\ufffd", "\u0301", "\u0300", "<unk>"]
    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    tok.add_special_tokens(["<pad>", "<PAD>"])
    cmap, k = build_compression_map(tok, vocab_size=len(vocab) + 4)
    #        Hello-group  Hello  fine   cafe      a b         ufffd  marks  unk specials padding
    want = [0, 0, 1, 0, 2, 2, 3, 3, 3, 4, 4, 4, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    assert cmap.tolist() == want and k == 14
    with pytest.raises(ValueError):
        build_compression_map(tok, vocab_size=3)
