"""Triton sparse attention (model/kernels/sparse_attention.py) against the plain-PyTorch
reference model.csa.sparse_attention: outputs, head-summed selected-entry probabilities and
gradients. On CPU the kernels run in Triton's interpreter (fp32, small shapes); the gpu tests
run bf16 at full-model head count / latent / top-k against the reference in fp32."""
from __future__ import annotations

import pytest
import torch

from model.csa import sparse_attention
from model.kernels.sparse_attention import sparse_attention_triton


def _doc_start(T: int, offset: int, starts: list[int]) -> torch.Tensor:
    """[T] start position of the document holding position offset + t (starts are positions)."""
    pos = offset + torch.arange(T)
    ds = torch.zeros(T, dtype=torch.long)
    for s in sorted(starts):
        ds = torch.where(pos >= s, torch.tensor(s), ds)
    return ds


def _inputs(B=2, T=24, H=16, C=32, k=16, W=8, S=20, offset=0, halo=False, glob=True, dtype=torch.float32,
            device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g).to(device, dtype)
    q, win = r(B, T, H, C), r(B, T, C)
    positions = (offset + torch.arange(T)).expand(B, T).contiguous()
    doc = torch.stack([_doc_start(T, offset, [0, offset + 5, offset + 13]),
                       _doc_start(T, offset, [offset + 2, offset + T - 3])])[:B]
    args = dict(q=q, win_kv=win, glob_kv=None, idx=None, doc_start=doc.to(device), sink=r(H) * 0.5,
                scale=C ** -0.5, window=W, positions=positions.to(device) if offset else None,
                halo=r(B, W - 1, C) if halo else None)
    if glob:
        idx = torch.stack([torch.randperm(S, generator=g)[:k] for _ in range(B * T)]).view(B, T, k)
        empty = torch.rand(B, T, k, generator=g) < 0.3
        empty[0, 3] = True  # a query with no selected entry at all
        args.update(glob_kv=r(B, S, C), idx=torch.where(empty, -1, idx).to(device))
    return args


def _grads(fn, args: dict, names: list[str], gout: torch.Tensor):
    args = {n: (v.detach().clone().requires_grad_(n in names) if torch.is_tensor(v) and v.is_floating_point()
                else v) for n, v in args.items()}
    out, p = fn(**args)
    (out.float() * gout).sum().backward()
    return out, p, {n: args[n].grad for n in names}


def _check(args: dict, atol: float = 1e-4):
    names = [n for n in ("q", "win_kv", "glob_kv", "sink", "halo") if args[n] is not None]
    gout = torch.randn(args["q"].shape, generator=torch.Generator().manual_seed(1))
    out_r, p_r, g_r = _grads(sparse_attention, args, names, gout)
    out_k, p_k, g_k = _grads(sparse_attention_triton, args, names, gout)
    torch.testing.assert_close(out_k, out_r, atol=atol, rtol=1e-4)
    if args["glob_kv"] is None:
        assert p_k is None
    else:
        torch.testing.assert_close(p_k, p_r.detach().sum(2), atol=atol, rtol=1e-4)
        assert (p_k[args["idx"] < 0] == 0).all()
    for n in names:
        assert g_k[n] is not None and g_r[n] is not None, n
        torch.testing.assert_close(g_k[n], g_r[n], atol=atol, rtol=1e-4, msg=lambda m, n=n: f"grad {n}: {m}")


def test_matches_reference_with_padding_and_documents():
    # k=20 is not a block multiple; W=24 spans two key blocks; documents cut the window
    _check(_inputs(k=20, W=24))


def test_trailing_padding_as_select_topk_writes_it():
    """select_topk's rows: ascending ids, then -1 to k; the kernels stop after the last selected
    slot. Counts from 0 to k (whole 16-slot blocks of padding skipped, a partial last block), and
    one row selected only in its last slot (leading padding: nothing may be skipped there)."""
    args = _inputs(k=48, S=60)
    B, T, k = args["idx"].shape
    g = torch.Generator().manual_seed(2)
    rows = []
    for i in range(B * T):
        n = [0, k, 1, 17, 33][i] if i < 5 else int(torch.randint(0, k + 1, (1,), generator=g))
        ids = torch.randperm(60, generator=g)[:n].sort().values
        rows.append(torch.cat((ids, ids.new_full((k - n,), -1))))
    idx = torch.stack(rows).view(B, T, k)
    idx[1, 5] = -1
    idx[1, 5, -1] = 7
    args["idx"] = idx
    _check(args)


def test_context_parallel_slice_with_halo():
    # positions offset, the W-1 rows before the slice from the previous rank (their gradient too)
    _check(_inputs(offset=40, halo=True))


def test_offset_without_halo_keeps_zero_rows():
    # the reference pads missing window rows with zeros; valid positions still count (logit 0)
    _check(_inputs(B=1, offset=40, halo=False))


def test_window_only_layer():
    _check(_inputs(glob=False, halo=True, offset=16))


def test_fp32_inputs_tune_over_one_config():
    """fp32 launches (tests, numerics checks) compile one config, the smallest value chunk and key
    block of each list, instead of tuning over all of them; bf16 launches keep the whole list."""
    import model.kernels.sparse_attention as sa

    for configs in (sa._FWD_CONFIGS, sa._BWD_CONFIGS):
        assert sa._fp32_one_config(configs, {}, PREC="tf32") == configs
        (one,) = sa._fp32_one_config(configs, {}, PREC="ieee")
        width = lambda c: c.kwargs.get("BLOCK_CV", 0) * c.kwargs.get("SPLIT", 1)
        assert all((width(one), one.kwargs["BLOCK_N"]) <= (width(c), c.kwargs["BLOCK_N"]) for c in configs)
    assert sa._fp32_one_config(sa._BWD_CONFIGS, {}, PREC="ieee")[0].kwargs["BLOCK_CV"] == 64


def test_head_blocks_and_no_probs():
    args = _inputs(B=1, T=12, H=20, k=16)  # 20 heads: a masked partial head block
    _check(args)
    # 80 heads: two head blocks of 64; p_sum sums the logits both stored
    _check(_inputs(B=1, T=6, H=80, k=16, W=4))
    out, p = sparse_attention_triton(**args, want_probs=False)
    assert p is None and out.shape == args["q"].shape


@pytest.mark.parametrize("C", [32, 48], ids=["C32", "C48-partial-pair"])
def test_backward_with_two_value_chunks_a_program(monkeypatch, C):
    """SPLIT = 2: one backward program takes two value chunks of 16 from one recomputation of the
    logits. C = 48: the second program's second chunk lies past C (masked)."""
    import model.kernels.sparse_attention as sa

    monkeypatch.setitem(sa._FIXED, "SPLIT", 2)
    _check(_inputs(C=C, k=20, W=24, offset=40, halo=True))


@pytest.mark.parametrize("C,block_cv", [(32, 32), (48, 64)], ids=["C32", "C48-masked-tail"])
def test_one_pass_when_a_program_covers_the_latent(monkeypatch, C, block_cv):
    """ONE_PASS: a program's value chunk covers C, so each key block's rows are loaded once and
    feed every dot (forward and backward, one chunk a program). C = 48 in a chunk of 64: the
    columns past C are masked."""
    import model.kernels.sparse_attention as sa

    monkeypatch.setitem(sa._FIXED, "BLOCK_CV", block_cv)
    _check(_inputs(C=C, k=20, W=24, offset=40, halo=True))


def _widened(args: dict) -> dict:
    """args with every float tensor in fp32: the reference's inputs for a bf16 kernel call."""
    return {n: v.float() if torch.is_tensor(v) and v.is_floating_point() else v for n, v in args.items()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("H,halo", [(64, False), (64, True), (16, True)], ids=["H64", "H64-halo", "H16-halo"])
def test_gpu_bf16_full_scale(H, halo):
    """H = 64 (`flash`) and H = 16 (`small`): the autotuner picks chunked and one-pass configs."""
    args = _inputs(B=1, T=256, H=H, C=512, k=512, W=128, S=1024, offset=512 if halo else 0, halo=halo,
                   dtype=torch.bfloat16, device="cuda")
    names = [n for n in ("q", "win_kv", "glob_kv", "sink", "halo") if args[n] is not None]
    gout = torch.randn(args["q"].shape, device="cuda")
    wide = _widened(args)
    out_r, p_r, g_r = _grads(sparse_attention, wide, names, gout)
    out_k, p_k, g_k = _grads(sparse_attention_triton, args, names, gout)
    assert out_k.dtype == torch.bfloat16
    assert _rel(out_k, out_r) < 1e-2
    assert _rel(p_k, p_r.detach().sum(2)) < 1e-2
    for n in names:  # d sink sums p_sink * rowsum(dout * out) over bf16-rounded out: looser
        assert _rel(g_k[n], g_r[n]) < (5e-2 if n == "sink" else 2e-2), (n, _rel(g_k[n], g_r[n]))


@pytest.mark.gpu
def test_gpu_every_one_pass_forward_config_matches_reference(monkeypatch):
    """Each forward config whose value chunk covers C (`small`'s H = 16, C = 512), pinned in turn as
    the only one: the autotuner may pick any of them at the step's shape, which the other gpu tests
    do not reach."""
    import model.kernels.sparse_attention as sa

    configs = [c for c in sa._FWD_CONFIGS if c.kwargs["BLOCK_CV"] >= 512]
    assert len(configs) >= 2
    args = _inputs(B=1, T=256, H=16, C=512, k=512, W=128, S=1024, offset=512, halo=True, dtype=torch.bfloat16,
                   device="cuda")
    wide = _widened(args)
    with torch.no_grad():
        out_r, p_r = sparse_attention(**wide)
        for cfg in configs:
            monkeypatch.setattr(sa._fwd, "configs", [cfg])
            monkeypatch.setattr(sa._fwd, "cache", {})
            out_k, p_k = sparse_attention_triton(**args)
            assert _rel(out_k, out_r) < 1e-2 and _rel(p_k, p_r.sum(2)) < 1e-2, cfg


# 16 heads with a halo repeats the 4-head halo case at another head count: extended tier
@pytest.mark.parametrize("H,halo,offset", [pytest.param(16, True, 40, marks=pytest.mark.extended),
                                           (4, False, 0), (4, True, 16)],
                         ids=["H16-halo", "H4-from-start", "H4-halo"])
def test_window_gradient_reads_only_what_the_backward_wrote(monkeypatch, H, halo, offset):
    """The window rows' dK = dV is a GEMM over the per-query kernel's stored p and ds * scale
    (no atomics). Its scratch comes NaN-filled here: any column the backward did not write (before
    a document, outside a query's window, the alignment padding) would turn the gradient NaN.
    H = 4 puts 4 queries in each GEMM step of the interpreter's K = 16."""
    import model.kernels.sparse_attention as sa

    nan_scratch = lambda shape, dtype, device: tuple(torch.full(shape, float("nan"), dtype=dtype,
                                                                device=device) for _ in range(2))
    monkeypatch.setattr(sa, "_window_scratch", nan_scratch)
    _check(_inputs(H=H, k=20, W=24, offset=offset, halo=halo))
    _check(_inputs(H=H, W=8, glob=False, halo=halo, offset=offset))


def _rope_folded(args: dict, R: int, gout: torch.Tensor, folded: bool):
    """out and the gradients of the unrotated q (and the rest) with q's RoPE applied by a Rotary
    before the call and out rotated back after it (folded=False: the reference attention between
    two reference rotaries), or folded into the kernel call (q_angles)."""
    from model.rope import Rotary

    rot = Rotary(R, 10_000.0).to(args["q"].device)
    names = [n for n in ("q", "win_kv", "glob_kv", "sink", "halo") if args[n] is not None]
    leaves = {n: args[n].detach().clone().requires_grad_(True) for n in names}
    call = {**args, **leaves}
    T = args["q"].shape[1]
    pos = args["positions"]
    if pos is None:
        pos = torch.arange(T, device=args["q"].device).expand(args["q"].shape[0], T)
    angles = rot.angles(pos)  # [B, T, R/2]
    q = leaves["q"] * 1.0  # a non-leaf: the folded call rotates it in place
    if folded:
        out, p = sparse_attention_triton(**{**call, "q": q}, q_angles=angles)
        q_rot = q  # rotated in place, and recorded so by autograd
    else:
        q_rot = call["q"] = rot(q, angles.unsqueeze(-2))
        out, p = sparse_attention(**call)
        out = rot(out, angles.unsqueeze(-2), inverse=True)
        p = None if p is None else p.detach().sum(2)
    # the rotated q is used after the call too: its gradient joins the attention's
    ((out.float() * gout).sum() + (q_rot.float() * gout.flip(1)).sum()).backward()
    return out, p, q_rot.detach(), {n: leaves[n].grad for n in names}


@pytest.mark.parametrize("glob,halo,block_cv,split", [(True, True, 16, 1), (False, False, 16, 1),
                                                      (True, True, 32, 1), (True, False, 16, 2)],
                         ids=["selected-halo", "window-only", "one-pass", "two-chunks"])
def test_rope_folded_into_the_call(monkeypatch, glob, halo, block_cv, split):
    """q_angles: q's rotary applied in place on its trailing R dims by the call, and out rotated
    back, against Rotary -> reference attention -> inverse Rotary: out, p_sum, the rotated q left in
    q, and the gradients of the unrotated q, the KV rows and the sink; the backward in value chunks
    (the logits streamed), in one pass, and two chunks a program."""
    import model.kernels.sparse_attention as sa

    monkeypatch.setattr(sa, "_FIXED", dict(sa._FIXED, BLOCK_CV=block_cv, SPLIT=split))
    args = _inputs(C=32, k=20, W=24, offset=40 if halo else 0, halo=halo, glob=glob)
    gout = torch.randn(args["q"].shape, generator=torch.Generator().manual_seed(3))
    out_r, p_r, q_r, g_r = _rope_folded(args, 16, gout, folded=False)
    out_k, p_k, q_k, g_k = _rope_folded(args, 16, gout, folded=True)
    torch.testing.assert_close(out_k, out_r, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(q_k, q_r, atol=1e-5, rtol=1e-5)
    if glob:
        torch.testing.assert_close(p_k, p_r, atol=1e-4, rtol=1e-4)
    for n, g in g_r.items():
        torch.testing.assert_close(g_k[n], g, atol=1e-4, rtol=1e-4, msg=lambda m, n=n: f"grad {n}: {m}")


@pytest.mark.gpu
def test_gpu_rope_folded_bf16_small_heads():
    """The folded RoPE at `small`'s heads and latent in bf16 against the fp32 reference between two
    reference rotaries (64 rotated dims of 512)."""
    args = _inputs(B=1, T=256, H=16, C=512, k=512, W=128, S=1024, offset=512, halo=True, dtype=torch.bfloat16,
                   device="cuda")
    gout = torch.randn(args["q"].shape, device="cuda")
    wide = _widened(args)
    out_r, p_r, q_r, g_r = _rope_folded(wide, 64, gout, folded=False)
    out_k, p_k, q_k, g_k = _rope_folded(args, 64, gout, folded=True)
    assert out_k.dtype == torch.bfloat16
    assert _rel(out_k, out_r) < 1e-2 and _rel(p_k, p_r) < 1e-2 and _rel(q_k, q_r) < 1e-2
    for n, g in g_r.items():
        assert _rel(g_k[n], g) < (5e-2 if n == "sink" else 2e-2), (n, _rel(g_k[n], g))


def test_rope_folded_refuses_what_it_cannot_rotate_in_place():
    args = _inputs(C=32, k=20, W=24)
    B, T, H, C = args["q"].shape
    with pytest.raises(ValueError, match="contiguous"):
        sparse_attention_triton(**{**args, "q": args["q"].transpose(1, 2).contiguous().transpose(1, 2)},
                                q_angles=torch.zeros(B, T, 8))
    with pytest.raises(ValueError, match="does not fit"):
        sparse_attention_triton(**args, q_angles=torch.zeros(B, T, C))
    one = _inputs(B=1, C=32, k=20, W=24)  # a contiguous view of part of a tensor: q_in would not be q
    longer = torch.cat([one["q"], one["q"]], dim=1)
    with pytest.raises(ValueError, match="all of the tensor it views"):
        sparse_attention_triton(**{**one, "q": longer[:, :T]}, q_angles=torch.zeros(1, T, 8))
