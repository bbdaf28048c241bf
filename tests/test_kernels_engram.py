"""model/kernels/engram.py against its references in model/engram.py (Engram._context,
Engram.addresses, EngramTable.lookup and its embedding gradient). On a CPU the kernels run in
Triton's interpreter (tests/conftest.py)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from conf.model import FlashModelConfig, TinyModelConfig
from model.engram import Engram
from model.kernels.engram import (
    effective_multipliers,
    engram_addresses_triton,
    engram_gather_triton,
    engram_lookup_triton,
    host_gather,
)
from model.runtime import document_starts

DEV = "cuda" if torch.cuda.is_available() else "cpu"


VOCAB = 1000  # lookup ids of the tiny Engrams: multipliers up to ~2^53, products of id 999 up to ~2^63


def make_engram(cfg=None, layer=1, pad_id=0, sparse=False, device=DEV) -> Engram:
    torch.manual_seed(0)
    cfg = cfg or TinyModelConfig(vocab_size=VOCAB)
    with torch.device(device):  # initialised where it lives (GPU-sized tables init fast there)
        return Engram(cfg, layer, pad_id=pad_id, sparse_grad=sparse)


def batch(B=2, T=37, high=VOCAB, seed=0, device=DEV):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, high, (B, T), generator=g)
    if T >= 24:
        ids[:, 5:9] = ids[:, 20:24]  # repeated n-grams must hash alike
        ids[:, 10:14] = high - 1  # the largest products
    doc_ids = torch.cumsum(torch.rand(B, T, generator=g) < 0.15, dim=1)
    return ids.to(device), document_starts(doc_ids).to(device)


def addresses_of(eng, ids, **kw):
    return engram_addresses_triton(ids, eng.multipliers, eng.orders, eng.primes, eng.offsets,
                                   pad_id=eng.pad_id, **kw)


@pytest.mark.parametrize("with_doc", [False, True])
@pytest.mark.parametrize("pad_id", [0, 3])
def test_addresses_bit_exact(with_doc, pad_id):
    eng = make_engram(pad_id=pad_id)
    ids, doc = batch()
    doc = doc if with_doc else None
    want = eng.addresses(ids, doc)
    got = addresses_of(eng, ids, doc_start=doc)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    # int32 ids hash the same
    assert torch.equal(addresses_of(eng, ids.int(), doc_start=doc), want)


def test_addresses_context_parallel_slice():
    """A slice [offset, offset + T) of a longer sequence: global positions ([T] and [B, T]),
    global doc starts and the ids just before the slice."""
    eng = make_engram(pad_id=1)
    full, doc = batch(B=2, T=50, seed=1)
    off = 20
    ids, hist = full[:, off:], full[:, off - 5:off]  # more history than max_n - 1 = 3
    pos = torch.arange(off, 50, device=DEV)
    for p in (pos, pos.expand(2, -1)):
        want = eng.addresses(ids, doc[:, off:], p, hist)
        assert torch.equal(want, eng.addresses(full, doc)[:, off:])  # the reference agrees with itself
        assert torch.equal(addresses_of(eng, ids, doc_start=doc[:, off:], positions=p, history=hist), want)
    # history without doc starts
    assert torch.equal(addresses_of(eng, ids, positions=pos, history=hist),
                       eng.addresses(ids, None, pos, hist))


def test_addresses_bit_exact_when_products_wrap():
    """ids far outside the lookup vocabulary: the int64 products wrap and the XOR goes negative;
    the floor-style modulo still matches torch's %."""
    eng = make_engram()
    ids = torch.randint(-(2**62), 2**62, (2, 30), generator=torch.Generator().manual_seed(2)).to(DEV)
    want = eng.addresses(ids)
    got = addresses_of(eng, ids)
    assert torch.equal(got, want)
    assert (want >= eng.offsets).all() and (want < eng.offsets + eng.primes).all()


def test_effective_multipliers_layout():
    m = torch.tensor([3, 5, 7, 9])
    got = effective_multipliers(m, [2, 4], heads=2)
    assert got.tolist() == [[3, 5, 0, 0], [3, 5, 0, 0], [3, 5, 7, 9], [3, 5, 7, 9]]


def test_addresses_golden():
    """Tiny's layer 2 with rows above 10 (primes 31 37 41 43 47 53), 1000 lookup ids, pad 2: the
    addresses worked out by hand for tests/test_engram.py (plain Python ints, XOR and %)."""
    cfg = dataclasses.replace(TinyModelConfig(vocab_size=VOCAB), engram_min_rows=10)
    eng = make_engram(cfg, layer=2, pad_id=2)
    ids = torch.tensor([[5, 17, 999, 0, 42, 7]], device=DEV)
    want = [[26, 44, 101, 143, 191, 242], [11, 49, 85, 144, 194, 206], [1, 64, 76, 116, 163, 249],
            [17, 31, 88, 123, 173, 247], [1, 56, 77, 143, 167, 236], [30, 51, 90, 111, 192, 215]]
    assert addresses_of(eng, ids).tolist() == [want]
    assert engram_lookup_triton(eng, ids).shape == (1, 6, 6, cfg.engram_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_rows_exact(dtype):
    eng = make_engram().to(dtype)
    ids, doc = batch(seed=3)
    want = eng.table.lookup(eng.addresses(ids, doc))
    got = engram_lookup_triton(eng, ids, doc)
    assert got.shape == (2, 37, len(eng.orders) * eng.heads, eng.cfg.engram_dim) and got.dtype == dtype
    assert torch.equal(got, want)
    rows, addr = engram_gather_triton(ids, eng.table.weight, eng.multipliers, eng.orders, eng.primes,
                                      eng.offsets, doc, return_addresses=True)
    assert torch.equal(rows, want) and torch.equal(addr, eng.addresses(ids, doc))


def _table_grad(eng, fn, ids, doc, up):
    eng.table.weight.grad = None
    (fn(ids, doc) * up).sum().backward()
    return eng.table.weight.grad


def _upstream(shape, seed=4, device=DEV):
    # small integers: sums of any order are exact, so the gradients must be equal
    return torch.randint(-8, 9, shape, generator=torch.Generator().manual_seed(seed)).float().to(device)


@pytest.mark.parametrize("sparse", [False, True])
def test_table_gradient_equal(sparse):
    eng = make_engram(sparse=sparse)
    ids, doc = batch(B=2, T=40, high=50, seed=5)  # few distinct ids: rows hit many times
    ref = lambda i, d: eng.table.lookup(eng.addresses(i, d))
    ker = lambda i, d: engram_lookup_triton(eng, i, d)
    up = _upstream(ref(ids, doc).shape)
    want, got = _table_grad(eng, ref, ids, doc, up), _table_grad(eng, ker, ids, doc, up)
    assert got.is_sparse == want.is_sparse == sparse
    if sparse:
        assert torch.equal(got._indices(), want._indices()) and torch.equal(got._values(), want._values())
        got, want = got.coalesce().to_dense(), want.coalesce().to_dense()
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert (got != 0).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [24, 128])
def test_other_widths_and_narrow_table_gradient(width, dtype):
    """Row widths other than the tiny config's: 24 (column mask), 128 (two column chunks in the
    interpreter, no mask); a bf16 table's dense gradient sums in fp32 and rounds once."""
    eng = make_engram()
    ids, doc = batch(B=2, T=40, high=50, seed=9)  # few distinct ids: rows hit many times
    addr = eng.addresses(ids, doc)
    n_rows = int(eng.offsets[-1] + eng.primes[-1])
    table = torch.randn(n_rows, width,
                        generator=torch.Generator().manual_seed(9)).to(DEV, dtype).requires_grad_()
    got = engram_gather_triton(ids, table, eng.multipliers, eng.orders, eng.primes, eng.offsets, doc)
    assert torch.equal(got, F.embedding(addr, table))
    # integers < 2^8: exact in bf16, fp32 sums exact, but sums of several often need > 8 significant bits
    up = torch.randint(-255, 256, got.shape, generator=torch.Generator().manual_seed(10)).float().to(DEV)
    (grad,) = torch.autograd.grad((got * up).sum(), table)
    wide = table.detach().float().requires_grad_()
    (want,) = torch.autograd.grad((F.embedding(addr, wide) * up).sum(), wide)
    assert grad.dtype == dtype and torch.equal(grad, want.to(dtype)) and (grad != 0).any()


def test_gradient_through_the_module():
    """The kernel's rows in Engram.forward's place give the projection and the table the
    reference's gradients."""
    eng = make_engram()
    ids, doc = batch(B=2, T=16, seed=6)
    E = eng.cfg.engram_dim

    def run(rows_fn):
        eng.zero_grad(set_to_none=True)
        rows = rows_fn()
        out = eng.proj(rows.flatten(2)).square().sum()
        out.backward()
        return out.detach(), eng.table.weight.grad.clone(), eng.proj.weight.grad.clone()

    ref = run(lambda: eng.table.lookup(eng.addresses(ids, doc)))
    got = run(lambda: engram_lookup_triton(eng, ids, doc))
    assert E == eng.table.weight.shape[1]
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_host_gather_helper():
    table = torch.randn(100, 8)
    addr = torch.randint(0, 100, (3, 4, 5))
    assert torch.equal(host_gather(table, addr), table[addr])


def test_unknown_host_path():
    eng = make_engram(device="cpu")
    ids, _ = batch(device="cpu")
    if DEV == "cpu":  # table and ids on one device: the fused kernel, host_path unused
        assert engram_lookup_triton(eng, ids, host_path="other").shape[:2] == ids.shape
    else:
        with pytest.raises(ValueError):
            engram_lookup_triton(eng, ids.cuda(), host_path="other")


# --------------------------------------------------------------------------- GPU, realistic sizes
def _flash_like(sparse=False, device="cuda") -> Engram:
    """flash's orders, heads and row width (6,144 values per token), smaller tables."""
    cfg = dataclasses.replace(FlashModelConfig(), engram_min_rows=200_000)
    return make_engram(cfg, layer=1, sparse=sparse, device=device)


@pytest.mark.gpu
@pytest.mark.parametrize("sparse", [False, True])
def test_gpu_gather_and_gradient(sparse):
    eng = _flash_like(sparse)
    ids, doc = batch(B=4, T=4096, high=2**17, seed=7, device="cuda")
    want = eng.table.lookup(eng.addresses(ids, doc))
    assert torch.equal(engram_lookup_triton(eng, ids, doc), want)
    ref = lambda i, d: eng.table.lookup(eng.addresses(i, d))
    ker = lambda i, d: engram_lookup_triton(eng, i, d)
    up = _upstream(want.shape, device="cuda")
    a, b = _table_grad(eng, ker, ids, doc, up), _table_grad(eng, ref, ids, doc, up)
    if sparse:
        a, b = a.coalesce().to_dense(), b.coalesce().to_dense()
    assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("host_path", ["staged", "uva"])
def test_gpu_host_table(host_path, sparse):
    eng = _flash_like(sparse=sparse, device="cpu")
    eng.table.weight.data = eng.table.weight.data.pin_memory()
    for name in ("multipliers", "primes", "offsets"):
        setattr(eng, name, getattr(eng, name).cuda())
    ids, doc = batch(B=2, T=2048, seed=8, device="cuda")
    want = eng.table.lookup(eng.addresses(ids, doc))
    got = engram_lookup_triton(eng, ids, doc, host_path=host_path)
    assert got.device == ids.device and torch.equal(got, want)
    up = _upstream(want.shape, device="cuda")
    ker = lambda i, d: engram_lookup_triton(eng, i, d, host_path=host_path)
    a = _table_grad(eng, ker, ids, doc, up)
    b = _table_grad(eng, lambda i, d: eng.table.lookup(eng.addresses(i, d)), ids, doc, up)
    assert a.device.type == "cpu" and a.is_sparse == sparse
    if sparse:
        a, b = a.coalesce().to_dense(), b.coalesce().to_dense()
    assert torch.equal(a, b)
