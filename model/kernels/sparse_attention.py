"""Triton CSA2 sparse attention, forward and backward. Reference: `model.csa.sparse_attention`
(same arguments, same math); `sparse_attention_triton` returns (out, p_sum) where p_sum [B, T, k]
is the reference's p_glob summed over heads (all `indexer_kl` uses), never [B, T, H, k].

Per query t (MQA: one C-dim latent row is both K and V for every head):
  keys    = window rows t-W+1 .. t (halo rows before the first query, zeros without a halo;
            valid where key position >= doc_start) + global rows glob_kv[idx[t, j]] (-1 = empty)
  softmax over [window logits, global logits, sink[h]] in fp32, the sink column dropped.

Kernel layout (the forward and the per-query backward):
  * one program = one query x a block of heads (BLOCK_H, all H when H <= 64) x a chunk of the
    value dimension (BLOCK_CV). Every selected row is loaded once per program for all its heads,
    and the logits are `tl.dot(q [BLOCK_H, BLOCK_C], k^T [BLOCK_C, BLOCK_N])` summed over C.
  * the [H, C] fp32 accumulator (64 x 512 = 128 KiB at full scale) does not fit one program, so
    C is split across programs: each recomputes the full-C logits (QK flops x C/BLOCK_CV) but
    keeps only a [BLOCK_H, BLOCK_CV] accumulator. Splitting heads instead would not recompute
    logits but would need BLOCK_H < 64, below the 64-row tile Hopper's wgmma wants, and would
    load every key H/BLOCK_H times; the programs of one query run back to back (the c-chunk is
    the fastest grid index), so the repeated key reads mostly hit L2.
  * online softmax starts from the sink (m = sink, den = 1), so the running max is always finite
    and fully masked blocks (-1 padding, other documents) need no special case.
  * logits are kept in log2 units (exp2); LSE [B, T, H] is saved in those units.
Backward recomputes p from LSE (flash-attention style): ds = p * (dp - delta), delta =
rowsum(dout * out) computed in the kernel; dq is stored per C-chunk, the gathered global rows'
dK = dV are atomically added into an fp32 buffer. The window rows (halo included) get theirs
from a second kernel, `_window_dkv_kernel`: the per-query kernel stores the window's p and
ds * scale ([B, T, H, W] plus alignment padding, in q's dtype: the roundings the dots took), and
each program of the second one owns a block of rows and sums over the band of queries that see
them, a GEMM with K = (query, head) pairs, rather than W atomic adds of C fp32 values a row.
p_sum, only when asked for: the final normaliser is unknown while the forward streams, so the
forward writes each selected logit ([B, T, H, k] fp32 scratch), and `_psum_kernel`, launched after
it, sums exp2(logit - LSE) over heads (one program a query, every slot written: no fill, no
atomics), rather than a second QK pass over the selected rows or an epilogue that reads the
logits back in the program that wrote them.

A backward program may take SPLIT = 2 consecutive value chunks (two dq accumulators, two dK = dV
adds a key block) from one recomputation of the logits, so at C = 512 one program covers C.

ONE_PASS (set when a program's chunk(s) cover C): a key block's rows are loaded once and feed every
dot, against q and dout held in registers; otherwise the logits stream C in BLOCK_C pieces and the
value chunk is loaded again.

Known costs: without ONE_PASS, logits are recomputed C/(BLOCK_CV*SPLIT) times (forward: SPLIT = 1);
every selected row receives one atomic add per query selecting it. The adds are relaxed
reductions (Triton's default acq_rel atomics are much slower here); no fp64. The measurements
behind these choices: bench/reports/2026-12-06-design-history.md and
bench/reports/2026-12-06-code-comment-history.md.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from model.csa import _with_halo, window_doc_start
from model.kernels.rope import rotary_rows, rotate_trailing_

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
LOG2E = 1.4426950408889634


@triton.jit
def _scores(Qrow, KV, rows, n_ok, offs_h, h_ok, C, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_C: tl.constexpr, PREC: tl.constexpr):
    """q [BLOCK_H, C] . kv[rows] [BLOCK_N, C]^T -> [BLOCK_H, BLOCK_N] fp32 (raw dot products)."""
    s = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        c_ok = offs_c < C
        qc = tl.load(Qrow + offs_h[:, None] * C + offs_c[None, :], mask=h_ok[:, None] & c_ok[None, :],
                     other=0.0)
        kc = tl.load(KV + rows[:, None] * C + offs_c[None, :], mask=n_ok[:, None] & c_ok[None, :], other=0.0)
        s += tl.dot(qc, tl.trans(kc.to(qc.dtype)), input_precision=PREC)
    return s


@triton.jit
def _fwd_block(Qrow, KV, rows, n_ok, q, m, den, acc, offs_h, h_ok, offs_v, v_ok, C, qk_scale,
               SLrow, offs_n, K, store_s, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
               PREC: tl.constexpr, ONE_PASS: tl.constexpr, STORE_S: tl.constexpr):
    """One online-softmax step over BLOCK_N keys; returns the updated (m, den, acc). ONE_PASS (the
    program's value chunk is all of C): the [BLOCK_N, C] rows are loaded once and feed both dots,
    against q [BLOCK_H, C] held by the caller; otherwise the logits stream C in BLOCK_C pieces.
    STORE_S (where store_s): the block's logits (log2 units, -inf where masked) go to
    SLrow[h, offs_n], for `_psum_kernel`."""
    dt = Qrow.dtype.element_ty
    if ONE_PASS:
        v = tl.load(KV + rows[:, None] * C + offs_v[None, :], mask=n_ok[:, None] & v_ok[None, :],
                    other=0.0).to(dt)
        s = tl.dot(q, tl.trans(v), input_precision=PREC)
    else:
        s = _scores(Qrow, KV, rows, n_ok, offs_h, h_ok, C, BLOCK_H, BLOCK_N, BLOCK_C, PREC)
        v = tl.load(KV + rows[:, None] * C + offs_v[None, :], mask=n_ok[:, None] & v_ok[None, :],
                    other=0.0).to(dt)
    s = tl.where(n_ok[None, :], s * qk_scale, float("-inf"))
    if STORE_S:
        if store_s:
            tl.store(SLrow + offs_h[:, None] * K + offs_n[None, :], s,
                     mask=h_ok[:, None] & (offs_n < K)[None, :])
    m_new = tl.maximum(m, tl.max(s, 1))  # finite: m starts at the sink
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    den = den * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(dt), v, input_precision=PREC)
    return m_new, den, acc


@triton.jit
def _dkv_chunk(DKV, rows, n_ok, v, p, ds, q_v, do_v, dq, offs_v, v_ok, C, scale, PREC: tl.constexpr,
               ADD_DKV: tl.constexpr):
    """One value chunk v = kv[rows] [BLOCK_N, BLOCK_CV]: dq += ds . v, and (ADD_DKV) dK = dV rows
    (p^T . dout + ds^T . q) added into DKV."""
    dt = q_v.dtype
    dq += tl.dot(ds.to(dt), v, input_precision=PREC)
    if ADD_DKV:
        dkv = tl.dot(tl.trans(p.to(dt)), do_v, input_precision=PREC)  # K = V: value part ...
        dkv += tl.dot(tl.trans((ds * scale).to(dt)), q_v, input_precision=PREC)  # ... plus key part
        # relaxed: nothing in the kernel reads DKV back, and the kernel's end orders the adds for the
        # reader. The default acq_rel orders every add (sm_90 PTX: atom.global.gpu.acq_rel.add.v4.f32);
        # relaxed ones are fire-and-forget reductions (red.global.gpu.relaxed.add.v4.f32), as in the
        # indexer and Engram.
        tl.atomic_add(DKV + rows[:, None] * C + offs_v[None, :], dkv, mask=n_ok[:, None] & v_ok[None, :],
                      sem="relaxed")
    return dq


@triton.jit
def _value_chunks(KV, rows, n_ok, offs_v, v_ok, offs_w, w_ok, C, dt, SPLIT: tl.constexpr):
    """kv[rows] at the program's value chunk(s): [BLOCK_N, BLOCK_CV] each (the second = the first
    when SPLIT = 1)."""
    v = tl.load(KV + rows[:, None] * C + offs_v[None, :], mask=n_ok[:, None] & v_ok[None, :],
                other=0.0).to(dt)
    v_w = v
    if SPLIT == 2:
        v_w = tl.load(KV + rows[:, None] * C + offs_w[None, :], mask=n_ok[:, None] & w_ok[None, :],
                      other=0.0).to(dt)
    return v, v_w


@triton.jit
def _bwd_block(Qrow, DOrow, KV, DKV, rows, n_ok, q_v, do_v, q_w, do_w, lse, delta, dq, dq_w, offs_h, h_ok,
               offs_v, v_ok, offs_w, w_ok, C, scale, qk_scale, PWrow, DSWrow, offs_n, W, WP, store_p,
               BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, PREC: tl.constexpr,
               SPLIT: tl.constexpr, ONE_PASS: tl.constexpr, WINDOW: tl.constexpr):
    """Recompute p and dp = dout . v over full C, then this program's value chunk(s) of dq and
    dK=dV: the chunk at offs_v, and with SPLIT = 2 also the one at offs_w (same p and ds).
    ONE_PASS (the program's chunks cover C): the rows of each chunk are loaded once and feed the
    logits, dp and dq, against the q / dout chunks the program holds.
    WINDOW (window key blocks): no dK = dV here; where store_p (one program of each head block),
    p and ds * scale go to PWrow / DSWrow [H, WP] (already offset by the query's shift, see
    `_window_dkv_kernel`) in q's dtype."""
    dt = Qrow.dtype.element_ty
    if ONE_PASS:
        v, v_w = _value_chunks(KV, rows, n_ok, offs_v, v_ok, offs_w, w_ok, C, dt, SPLIT)
        s = tl.dot(q_v, tl.trans(v), input_precision=PREC)
        dp = tl.dot(do_v, tl.trans(v), input_precision=PREC)
        if SPLIT == 2:
            s += tl.dot(q_w, tl.trans(v_w), input_precision=PREC)
            dp += tl.dot(do_w, tl.trans(v_w), input_precision=PREC)
    else:
        s = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
        dp = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):  # one key load feeds both dots
            offs_c = c0 + tl.arange(0, BLOCK_C)
            hc = h_ok[:, None] & (offs_c < C)[None, :]
            kc = tl.load(KV + rows[:, None] * C + offs_c[None, :], mask=n_ok[:, None] & (offs_c < C)[None, :],
                         other=0.0)
            kt = tl.trans(kc.to(dt))
            s += tl.dot(tl.load(Qrow + offs_h[:, None] * C + offs_c[None, :], mask=hc, other=0.0), kt,
                        input_precision=PREC)
            dp += tl.dot(tl.load(DOrow + offs_h[:, None] * C + offs_c[None, :], mask=hc, other=0.0), kt,
                         input_precision=PREC)
        v, v_w = _value_chunks(KV, rows, n_ok, offs_v, v_ok, offs_w, w_ok, C, dt, SPLIT)
    ok = h_ok[:, None] & n_ok[None, :]
    p = tl.where(ok, tl.exp2(s * qk_scale - lse[:, None]), 0.0)
    ds = p * (dp - delta[:, None])  # d loss / d logit (natural units)
    if WINDOW:
        if store_p:  # the same roundings as the dK = dV dots below take
            at = offs_h[:, None] * WP + offs_n[None, :]
            wm = h_ok[:, None] & (offs_n < W)[None, :]  # p = ds = 0 before the document: stored too
            tl.store(PWrow + at, p.to(dt), mask=wm)
            tl.store(DSWrow + at, (ds * scale).to(dt), mask=wm)
    dq = _dkv_chunk(DKV, rows, n_ok, v, p, ds, q_v, do_v, dq, offs_v, v_ok, C, scale, PREC, not WINDOW)
    if SPLIT == 2:
        dq_w = _dkv_chunk(DKV, rows, n_ok, v_w, p, ds, q_w, do_w, dq_w, offs_w, w_ok, C, scale, PREC,
                          not WINDOW)
    return dq, dq_w


@triton.jit
def _selected_end(IDXrow, K, BLOCK_K: tl.constexpr):
    """One past the last selected slot of a query's idx row (0 when every slot is -1). The key
    blocks after it hold only -1 padding, which `select_topk` puts at the end (early queries
    see fewer than k entries), so the loops stop there instead of running masked dots."""
    offs = tl.arange(0, BLOCK_K)
    ids = tl.load(IDXrow + offs, mask=offs < K, other=-1)
    return tl.max(tl.where(ids >= 0, offs + 1, 0), 0)


@triton.jit
def _program(T, H, C, BLOCK_H: tl.constexpr, BLOCK_CV: tl.constexpr, SPLIT: tl.constexpr = 1):
    """Grid index -> (query, batch, query-in-batch, head offsets, offsets of the program's first
    value chunk); a program covers SPLIT consecutive chunks of BLOCK_CV. The C-chunk varies
    fastest so one query's programs run together and share its keys in L2."""
    NC = tl.cdiv(C, BLOCK_CV * SPLIT)
    NH = tl.cdiv(H, BLOCK_H)
    pid = tl.program_id(0)
    pid_q = (pid // (NC * NH)).to(tl.int64)
    offs_h = ((pid // NC) % NH) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_v = (pid % NC) * (BLOCK_CV * SPLIT) + tl.arange(0, BLOCK_CV)
    return pid_q, pid_q // T, pid_q % T, offs_h, offs_v, pid % NC == 0


@triton.jit
def _fwd_kernel(Q, KV, G, IDX, DOC, POS, SINK, OUT, LSE, SL, T, H, C, W, K, S, qk_scale,
                HAS_GLOB: tl.constexpr, WANT_P: tl.constexpr, PREC: tl.constexpr, BLOCK_H: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_CV: tl.constexpr, BLOCK_K: tl.constexpr,
                ONE_PASS: tl.constexpr):
    # Q/OUT [B, T, H, C]; KV [B, W-1+T, C] (halo rows first); G [B, S, C]; IDX [B, T, K];
    # DOC/POS [B, T]; SINK [H]; LSE [B, T, H] (log2 units).
    # WANT_P: SL [B, T, H, K] fp32 scratch for the selected logits (log2 units; written up to the
    # query's last selected slot), read by _psum_kernel.
    pid_q, b, t, offs_h, offs_v, first = _program(T, H, C, BLOCK_H, BLOCK_CV)
    h_ok = offs_h < H
    v_ok = offs_v < C
    Qrow = Q + pid_q * H * C
    if ONE_PASS:  # the program's chunk is all of C: q is loaded once for every key block's logits
        q = tl.load(Qrow + offs_h[:, None] * C + offs_v[None, :], mask=h_ok[:, None] & v_ok[None, :],
                    other=0.0)
    else:  # unused: the logits stream q from memory in BLOCK_C pieces
        q = tl.zeros([BLOCK_H, BLOCK_CV], dtype=Q.dtype.element_ty)
    m = tl.load(SINK + offs_h, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    den = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_CV], dtype=tl.float32)
    # window key w sits at position pos-W+1+w and row t+w of KV; blocks before the document skipped
    w_lo = tl.maximum(tl.load(DOC + pid_q) - tl.load(POS + pid_q) + W - 1, 0)
    for n0 in range((w_lo // BLOCK_N) * BLOCK_N, W, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = (offs_n >= w_lo) & (offs_n < W)
        rows = b * (T + W - 1) + t + offs_n
        m, den, acc = _fwd_block(Qrow, KV, rows, n_ok, q, m, den, acc, offs_h, h_ok, offs_v, v_ok, C,
                                 qk_scale, SL, offs_n, K, first, BLOCK_H, BLOCK_N, BLOCK_C, PREC, ONE_PASS,
                                 False)
    if HAS_GLOB:
        SLrow = SL + pid_q * H * K
        for n0 in range(0, _selected_end(IDX + pid_q * K, K, BLOCK_K), BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            ids = tl.load(IDX + pid_q * K + offs_n, mask=offs_n < K, other=-1).to(tl.int64)
            n_ok = ids >= 0
            rows = b * S + tl.where(n_ok, ids, 0)
            m, den, acc = _fwd_block(Qrow, G, rows, n_ok, q, m, den, acc, offs_h, h_ok, offs_v, v_ok, C,
                                     qk_scale, SLrow, offs_n, K, first, BLOCK_H, BLOCK_N, BLOCK_C, PREC,
                                     ONE_PASS, WANT_P)
    out = acc / den[:, None]
    tl.store(OUT + pid_q * H * C + offs_h[:, None] * C + offs_v[None, :], out.to(OUT.dtype.element_ty),
             mask=h_ok[:, None] & v_ok[None, :])
    lse = m + tl.log2(den)
    if first:  # every C-chunk program has the same m, den
        tl.store(LSE + pid_q * H + offs_h, lse, mask=h_ok)


@triton.jit
def _psum_kernel(SL, LSE, IDX, PSUM, H, K, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """PSUM [B, T, K] = sum over heads of exp2(SL - LSE) at the query's selected slots, 0 past its last
    one (SL is not written there). One program a query, all its heads."""
    pid_q = tl.program_id(0).to(tl.int64)
    end = _selected_end(IDX + pid_q * K, K, BLOCK_K)
    for n0 in range(0, K, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        p = tl.zeros([BLOCK_N], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            h_ok = offs_h < H
            lse = tl.load(LSE + pid_q * H + offs_h, mask=h_ok, other=0.0)
            sl = tl.load(SL + (pid_q * H + offs_h[:, None]) * K + offs_n[None, :],
                         mask=h_ok[:, None] & n_ok[None, :], other=float("-inf"))
            p += tl.sum(tl.exp2(sl - lse[:, None]), 0)
        tl.store(PSUM + pid_q * K + offs_n, p, mask=offs_n < K)


@triton.jit
def _bwd_kernel(Q, KV, G, IDX, DOC, POS, OUT, DO, DD, LSE, DQ, DG, PW, DSW, DELTA, T, H, C, W, WP, K, S,
                scale, qk_scale, BLOCK_WP: tl.constexpr,
                HAS_GLOB: tl.constexpr, PREC: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_C: tl.constexpr, BLOCK_CV: tl.constexpr, SPLIT: tl.constexpr, BLOCK_K: tl.constexpr,
                ONE_PASS: tl.constexpr):
    # DD: the output gradient delta reads with OUT (DO itself, or with the RoPE folded in both in the
    # rotated-back frame: the rotation is orthogonal, so rowsum(dout * out) is the same in either).
    # DQ like Q; DG [B, S, C] fp32 (atomic adds); PW / DSW [B, T, H, WP] (the window's p and ds * scale
    # in Q's dtype, for _window_dkv_kernel, entry w of query t at column w + t % 8); DELTA [B, T, H] fp32.
    # SPLIT = 2: the program takes two value chunks (offs_v, offs_w) from one recomputation of p, ds.
    pid_q, b, t, offs_h, offs_v, first = _program(T, H, C, BLOCK_H, BLOCK_CV, SPLIT)
    offs_w = offs_v + BLOCK_CV
    h_ok = offs_h < H
    v_ok = offs_v < C
    w_ok = (offs_w < C) & (SPLIT == 2)
    hv = h_ok[:, None] & v_ok[None, :]
    hw = h_ok[:, None] & w_ok[None, :]
    Qrow = Q + pid_q * H * C
    DOrow = DO + pid_q * H * C
    delta = tl.zeros([BLOCK_H], dtype=tl.float32)  # rowsum(dout * out) over all of C
    for c0 in range(0, C, BLOCK_CV):
        offs_c = c0 + tl.arange(0, BLOCK_CV)
        hc = h_ok[:, None] & (offs_c < C)[None, :]
        o = tl.load(OUT + pid_q * H * C + offs_h[:, None] * C + offs_c[None, :], mask=hc, other=0.0)
        do = tl.load(DD + pid_q * H * C + offs_h[:, None] * C + offs_c[None, :], mask=hc, other=0.0)
        delta += tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    lse = tl.load(LSE + pid_q * H + offs_h, mask=h_ok, other=0.0)
    q_v = tl.load(Qrow + offs_h[:, None] * C + offs_v[None, :], mask=hv, other=0.0)
    do_v = tl.load(DOrow + offs_h[:, None] * C + offs_v[None, :], mask=hv, other=0.0)
    q_w = tl.load(Qrow + offs_h[:, None] * C + offs_w[None, :], mask=hw, other=0.0)
    do_w = tl.load(DOrow + offs_h[:, None] * C + offs_w[None, :], mask=hw, other=0.0)
    dq = tl.zeros([BLOCK_H, BLOCK_CV], dtype=tl.float32)
    dq_w = tl.zeros([BLOCK_H, BLOCK_CV], dtype=tl.float32)
    w_lo = tl.maximum(tl.load(DOC + pid_q) - tl.load(POS + pid_q) + W - 1, 0)
    n_lo = (w_lo // BLOCK_N) * BLOCK_N
    if first:  # zeros in the scratch row's columns the window blocks below do not write
        cols = tl.arange(0, BLOCK_WP)
        pad = ((cols < n_lo + t % 8) | (cols >= W + t % 8)) & (cols < WP)
        at = pid_q * H * WP + offs_h[:, None] * WP + cols[None, :]
        zero = tl.zeros([BLOCK_H, BLOCK_WP], dtype=PW.dtype.element_ty)
        tl.store(PW + at, zero, mask=h_ok[:, None] & pad[None, :])
        tl.store(DSW + at, zero, mask=h_ok[:, None] & pad[None, :])
    for n0 in range(n_lo, W, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = (offs_n >= w_lo) & (offs_n < W)
        rows = b * (T + W - 1) + t + offs_n
        dq, dq_w = _bwd_block(Qrow, DOrow, KV, DG, rows, n_ok, q_v, do_v, q_w, do_w, lse, delta, dq, dq_w,
                              offs_h, h_ok, offs_v, v_ok, offs_w, w_ok, C, scale, qk_scale,
                              PW + pid_q * H * WP + t % 8, DSW + pid_q * H * WP + t % 8, offs_n, W, WP, first,
                              BLOCK_H, BLOCK_N, BLOCK_C, PREC, SPLIT, ONE_PASS, True)
    if HAS_GLOB:
        for n0 in range(0, _selected_end(IDX + pid_q * K, K, BLOCK_K), BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            ids = tl.load(IDX + pid_q * K + offs_n, mask=offs_n < K, other=-1).to(tl.int64)
            n_ok = ids >= 0
            rows = b * S + tl.where(n_ok, ids, 0)
            dq, dq_w = _bwd_block(Qrow, DOrow, G, DG, rows, n_ok, q_v, do_v, q_w, do_w, lse, delta, dq, dq_w,
                                  offs_h, h_ok, offs_v, v_ok, offs_w, w_ok, C, scale, qk_scale,
                                  PW, DSW, offs_n, W, WP, False,
                                  BLOCK_H, BLOCK_N, BLOCK_C, PREC, SPLIT, ONE_PASS, False)
    tl.store(DQ + pid_q * H * C + offs_h[:, None] * C + offs_v[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=hv)
    if SPLIT == 2:
        tl.store(DQ + pid_q * H * C + offs_h[:, None] * C + offs_w[None, :],
                 (dq_w * scale).to(DQ.dtype.element_ty), mask=hw)
    if first:
        tl.store(DELTA + pid_q * H + offs_h, delta, mask=h_ok)


@triton.jit
def _window_dkv_kernel(PW, DSW, Q, DO, DKV, T, H, C, W, WP, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_HP: tl.constexpr, BLOCK_CV: tl.constexpr, PREC: tl.constexpr):
    """dK = dV of the window rows without atomics: program (row block, value chunk, batch) owns
    rows r of KV [B, W-1+T, C] (halo rows first). Query t's window key w is row t + w, so the rows
    take sum over t in [r-W+1, r] and heads h of PW[t, h, r-t] dout[t, h] + DSW[t, h, r-t] q[t, h]:
    a GEMM over the band, BLOCK_T queries x BLOCK_HP heads a step (K = 64 on a GPU).
    Query t's entries sit at columns w + t % 8 of rows WP (a multiple of 16) long, so a row block's
    entries start 16-byte aligned for every query (column r - (t - t % 8)) and load as vectors;
    at column w they would be shifted by one element a query."""
    pid_r = tl.program_id(0)
    b = tl.program_id(2).to(tl.int64)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_v = tl.program_id(1) * BLOCK_CV + tl.arange(0, BLOCK_CV)
    v_ok = offs_v < C
    j = tl.arange(0, BLOCK_T * BLOCK_HP)  # (query, head) pairs of a step
    j_t, j_h = j // BLOCK_HP, j % BLOCK_HP
    acc = tl.zeros([BLOCK_R, BLOCK_CV], dtype=tl.float32)
    t_lo = tl.maximum(pid_r * BLOCK_R - (W - 1), 0)
    t_hi = tl.minimum(pid_r * BLOCK_R + BLOCK_R, T)  # exclusive
    for t0 in range(t_lo, t_hi, BLOCK_T):
        t = t0 + j_t
        pair_ok = (t < t_hi) & (j_h < H)
        bt = b * T + tl.where(pair_ok, t, 0)
        # [pairs, BLOCK_R] tiles: a pair's entries for the block's rows are contiguous, and the row's
        # zeros (outside the window, before the document) make a column-range mask enough: it is
        # constant over aligned 8-column groups, so the loads stay 16-byte vectors
        col = r[None, :] - (t // 8 * 8)[:, None]
        ok = pair_ok[:, None] & (col >= 0) & (col < WP)
        at = (bt * H + j_h)[:, None] * WP + col
        p = tl.load(PW + at, mask=ok, other=0.0)
        ds = tl.load(DSW + at, mask=ok, other=0.0)
        row = (bt * H + j_h)[:, None] * C + offs_v[None, :]  # [pairs, BLOCK_CV] of q / dout
        vm = pair_ok[:, None] & v_ok[None, :]
        acc = tl.dot(tl.trans(p), tl.load(DO + row, mask=vm, other=0.0), acc, input_precision=PREC)
        acc = tl.dot(tl.trans(ds), tl.load(Q + row, mask=vm, other=0.0), acc, input_precision=PREC)
    tl.store(DKV + (b * (T + W - 1) + r)[:, None] * C + offs_v[None, :], acc.to(DKV.dtype.element_ty),
             mask=(r < T + W - 1)[:, None] & v_ok[None, :])


# Block sizes. The interpreter runs fixed small blocks (tl.dot needs dims >= 16, no autotune);
# on a GPU the value chunk / key block / warps / stages are autotuned per (H, C, dtype), except
# that fp32 launches take one config (`_fp32_one_config`). BLOCK_H
# covers all heads up to 64 (one key load for every head); BLOCK_CV trades logit recompute
# (C / BLOCK_CV times) against accumulator registers. The first four configs of each list are for
# H=64, C=512 (bf16 on sm_90: wgmma, no spills). The rest are for 16 heads (`small`), where the
# [16, BLOCK_CV] accumulator is small enough to take C in one or two chunks (SPLIT = 2 in the
# backward), and key blocks of 16 / 32 rows suit the one-pass programs.
# The backward's atomics need DG zeroed between tuning runs (the window kernel writes every row).
_FIXED = dict(BLOCK_N=16, BLOCK_C=16, BLOCK_CV=16, SPLIT=1)
# ONE_PASS: the program's value chunk(s) cover C, so each key block's rows are loaded once for the
# logits and the value dots (forward), and for the logits, dp, dq and dK = dV (backward).
_one_pass = triton.heuristics({"ONE_PASS": lambda a: a["BLOCK_CV"] * a.get("SPLIT", 1) >= a["C"]})


def _cfg(cv, w, st, n=64, split=None, maxnreg=None):
    meta = dict(BLOCK_N=n, BLOCK_C=64, BLOCK_CV=cv, **({} if split is None else {"SPLIT": split}))
    return triton.Config(meta, num_warps=w, num_stages=st, maxnreg=maxnreg)


# maxnreg=168: uncapped, the one-pass forward at 512 / 32 / 4 warps / 2 stages needs ~246 registers a
# thread, so only 2 programs fit an SM and it is latency-bound; capped, 3 fit and it is faster despite
# a few spills (the backward loses at any cap, so it has none). Deeper pipelining of the row gather
# and 2-warp programs were slower: the forward's limit is the SM's L1 / shared-memory pipe.
_FWD_CONFIGS = [_cfg(128, 4, 2), _cfg(128, 8, 2), _cfg(256, 8, 2), _cfg(64, 4, 3),
                _cfg(512, 4, 3), _cfg(512, 4, 2), _cfg(256, 4, 3),
                _cfg(512, 4, 3, 32), _cfg(512, 4, 2, 32), _cfg(512, 8, 2, 32), _cfg(512, 4, 3, 16),
                _cfg(512, 4, 2, 32, maxnreg=168)]
_BWD_CONFIGS = ([_cfg(128, 8, 2, 64, 1), _cfg(64, 8, 2, 64, 1), _cfg(128, 8, 2, 32, 1),
                 _cfg(128, 8, 3, 64, 1), _cfg(256, 4, 3, 32, 1), _cfg(256, 4, 2, 64, 1),
                 _cfg(256, 2, 2, 32, 1), _cfg(512, 4, 2, 32, 1)]
                + [_cfg(256, 8, 2, 64, 2), _cfg(256, 8, 2, 32, 2), _cfg(256, 4, 2, 32, 2),
                   _cfg(256, 4, 2, 64, 2), _cfg(128, 4, 2, 64, 2), _cfg(256, 4, 3, 32, 2),
                   _cfg(256, 4, 2, 16, 2), _cfg(512, 8, 2, 32, 1)])


def _wcfg(r, cv, w, st):
    return triton.Config(dict(BLOCK_R=r, BLOCK_CV=cv), num_warps=w, num_stages=st)


# window dK = dV: the fastest of an 18-config sweep at `small`'s shape first, then its neighbours
_WIN_CONFIGS = [_wcfg(128, 128, 8, 3), _wcfg(128, 128, 8, 2), _wcfg(128, 64, 4, 3), _wcfg(128, 64, 8, 3),
                _wcfg(64, 128, 4, 2), _wcfg(64, 128, 4, 3)]


def _fp32_one_config(configs, named_args, **kwargs):
    """The autotuner's prune: fp32 inputs (tests and numerics checks; training runs bf16) get one
    config, the one with the smallest tiles, where tuning would compile the whole list first. The
    fp32 one-pass builds spill heavily and take seconds each to compile, so tuning them all would
    spend minutes before a first fp32 forward+backward."""
    if kwargs.get("PREC") != "ieee":
        return configs
    return [min(configs, key=lambda c: (c.kwargs.get("BLOCK_CV", 0) * c.kwargs.get("SPLIT", 1),
                                        c.kwargs.get("BLOCK_N", c.kwargs.get("BLOCK_R")), c.num_stages,
                                        c.num_warps))]


if INTERPRET:
    _fwd, _bwd, _window_dkv = _one_pass(_fwd_kernel), _one_pass(_bwd_kernel), _window_dkv_kernel
else:
    _fp32 = {"early_config_prune": _fp32_one_config}
    _fwd = triton.autotune(_FWD_CONFIGS, key=["H", "C", "HAS_GLOB", "WANT_P"],
                           prune_configs_by=_fp32)(_one_pass(_fwd_kernel))
    _bwd = triton.autotune(_BWD_CONFIGS, key=["H", "C", "HAS_GLOB"], reset_to_zero=["DG"],
                           prune_configs_by=_fp32)(_one_pass(_bwd_kernel))
    _window_dkv = triton.autotune(_WIN_CONFIGS, key=["H", "C", "W", "BLOCK_T"],
                                  prune_configs_by=_fp32)(_window_dkv_kernel)


def _meta(kernel: str) -> dict:
    """Block sizes to pass explicitly (interpreter only; autotuned configs supply them on a GPU)."""
    if not INTERPRET:
        return {}
    if kernel == "window_dkv":
        return dict(BLOCK_R=16, BLOCK_CV=_FIXED["BLOCK_CV"])
    drop = {"fwd": ("SPLIT",), "bwd": ()}[kernel]
    return {k: v for k, v in _FIXED.items() if k not in drop}


def _grid(n_query: int, H: int, C: int, block_h: int):
    return lambda meta: (n_query * triton.cdiv(H, block_h)
                         * triton.cdiv(C, meta["BLOCK_CV"] * meta.get("SPLIT", 1)),)


def _block_h(H: int) -> int:
    return max(16, min(64, triton.next_power_of_2(H)))


def _block_k(k: int) -> int:
    """The width `_selected_end` loads: a query's whole idx row."""
    return max(16, triton.next_power_of_2(k))


def _prec(q: torch.Tensor) -> str:
    return "ieee" if q.dtype == torch.float32 else "tf32"  # fp32 inputs: exact fp32 dots, not tf32


def _window_scratch(shape, dtype, device):
    """The backward's [B, T, H, WP] p and ds * scale of the window entries, uninitialised: the
    kernel writes every column (a function so a test can hand it NaN-filled tensors)."""
    return torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device)


class _SparseAttention(torch.autograd.Function):
    """q_in: q, or with the RoPE folded in the tensor q views (autograd refuses a Function that
    modifies a view in place and returns more than one tensor); `shape` is q's [B, T, H, C].
    With cos / sin (`q_angles`): q arrives unrotated and is rotated in place (q_in marked dirty
    and returned as a fourth output), and out is rotated back in place before it is returned;
    both touch only the trailing R dims (`rotate_trailing_`), where a separate rotary would copy
    all of q and out each way."""

    @staticmethod
    def forward(ctx, q_in, kv, glob, idx, doc_start, positions, sink, scale, window, want_probs, cos, sin,
                shape):
        B, T, H, C = shape
        q = q_in.view(shape)
        fold = cos is not None
        if fold:
            rotate_trailing_(q, cos, sin)
            ctx.mark_dirty(q_in)
        ctx.set_materialize_grads(False)  # no zero-filled [B, T, H, C] for the rotated q nothing reads
        has_glob = glob is not None
        want_p = has_glob and want_probs
        if not has_glob:  # window-only layer: dummies the kernel never reads (not empty: no null pointer)
            glob, idx = kv, torch.full((1,), -1, dtype=torch.int64, device=q.device)
        n_sel = idx.shape[-1] if has_glob else 0
        out = torch.empty_like(q)
        lse = torch.empty(B, T, H, dtype=torch.float32, device=q.device)
        # the logits scratch is written where it is read (only the visited key blocks): no fill
        logits = torch.empty((B, T, H, n_sel) if want_p else (1,), dtype=torch.float32, device=q.device)
        bh = _block_h(H)
        _fwd[_grid(B * T, H, C, bh)](q, kv, glob, idx, doc_start, positions, sink, out, lse, logits, T, H,
                                     C, window, n_sel, glob.shape[1], scale * LOG2E, HAS_GLOB=has_glob,
                                     WANT_P=want_p, PREC=_prec(q), BLOCK_H=bh, BLOCK_K=_block_k(n_sel),
                                     **_meta("fwd"))
        p_sum = torch.empty(idx.shape if want_p else (1,), dtype=torch.float32, device=q.device)
        if want_p and B * T > 0:
            _psum_kernel[(B * T,)](logits, lse, idx, p_sum, H, n_sel, BLOCK_H=bh, BLOCK_K=_block_k(n_sel),
                                   BLOCK_N=16 if INTERPRET else 128)
        if fold:
            rotate_trailing_(out, cos, sin, inverse=True)
        ctx.save_for_backward(q_in, kv, glob, idx, doc_start, positions, sink, out, lse, cos, sin)
        ctx.has_glob, ctx.scale, ctx.window, ctx.n_sel, ctx.shape = has_glob, scale, window, n_sel, shape
        ctx.mark_non_differentiable(lse, p_sum)
        return (out, lse, p_sum, q_in) if fold else (out, lse, p_sum)

    @staticmethod
    def backward(ctx, dout, _dlse, _dp_sum, dq_out=None):
        q_in, kv, glob, idx, doc_start, positions, sink, out, lse, cos, sin = ctx.saved_tensors
        q = q_in.view(ctx.shape)
        B, T, H, C = q.shape
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        # folded RoPE: out and dout are in the rotated-back frame; the kernels take dout in the
        # attention's (out_attn = R out, so its gradient is R dout), delta reads them as they are
        d_attn = dout if cos is None else rotary_rows(dout, cos, sin)
        W = ctx.window
        dq = torch.empty_like(q)
        # fp32: atomic accumulation (a dummy the kernel never adds to without global entries)
        dg = torch.zeros(glob.shape if ctx.has_glob else (1,), dtype=torch.float32, device=q.device)
        WP = triton.cdiv(W + 7, 16) * 16  # room for the shift t % 8, rows 32-byte aligned
        pw, dsw = _window_scratch((B, T, H, WP), q.dtype, q.device)
        delta = torch.empty(B, T, H, dtype=torch.float32, device=q.device)
        bh = _block_h(H)
        _bwd[_grid(B * T, H, C, bh)](q, kv, glob, idx, doc_start, positions, out, d_attn, dout, lse, dq, dg,
                                     pw, dsw, delta,
                                     T, H, C, W, WP, ctx.n_sel, glob.shape[1], ctx.scale,
                                     ctx.scale * LOG2E, HAS_GLOB=ctx.has_glob, PREC=_prec(q), BLOCK_H=bh,
                                     BLOCK_K=_block_k(ctx.n_sel), BLOCK_WP=triton.next_power_of_2(WP),
                                     **_meta("bwd"))
        dkv = torch.empty_like(kv)
        hp = triton.next_power_of_2(H)
        block_t = max(1, (16 if INTERPRET else 64) // hp)  # (query, head) pairs a GEMM step: K >= 16 / 64
        _window_dkv[lambda m: (triton.cdiv(T + W - 1, m["BLOCK_R"]), triton.cdiv(C, m["BLOCK_CV"]), B)](
            pw, dsw, q, d_attn, dkv, T, H, C, W, WP, BLOCK_T=block_t, BLOCK_HP=hp, PREC=_prec(q),
            **_meta("window_dkv"))
        # the sink column's ds is p_sink * (0 - delta): it has no value row
        p_sink = torch.exp2(sink.float() * LOG2E - lse)  # [B, T, H]
        dsink = -(p_sink * delta).sum((0, 1)).to(sink.dtype)
        dglob = dg.to(glob.dtype) if ctx.has_glob else None
        if cos is not None:  # dq is the rotated q's gradient: rotate it back onto the input's
            if dq_out is not None:
                dq += dq_out.view(dq.shape)
            rotate_trailing_(dq, cos, sin, inverse=True)
        return dq.view(q_in.shape), dkv, dglob, None, None, None, dsink, None, None, None, None, None, None


@torch.compiler.disable  # trainer.compile: a graph break, launched as is (model/kernels/__init__.py)
def sparse_attention_triton(q: torch.Tensor, win_kv: torch.Tensor, glob_kv: Optional[torch.Tensor],
                            idx: Optional[torch.Tensor], doc_start: torch.Tensor, sink: torch.Tensor,
                            scale: float, window: int, positions: Optional[torch.Tensor] = None,
                            halo: Optional[torch.Tensor] = None, want_probs: bool = True,
                            q_angles: Optional[torch.Tensor] = None):
    """Arguments as `model.csa.sparse_attention` (q [B, T, H, C]; win_kv [B, T, C]; glob_kv [B, S, C]
    or None; idx [B, T, k] (-1 = empty); doc_start / positions [B, T]; sink [H]; halo [B, W-1, C])
    -> (out [B, T, H, C] in q's dtype, p_sum [B, T, k] fp32 head-summed probabilities on idx
    (0 at -1), or None without glob_kv or with want_probs=False). p_sum carries no gradient.
    fp32 / bf16 / fp16 inputs (no fp64: use the reference for float64 checks).
    q_angles [B, T, R/2] (the RoPE folded in): q comes without its rotary, which the call applies
    to q's trailing R dims in place (q must be contiguous; afterwards it holds the rotated q, as
    autograd records), and out comes back rotated by the inverse: the values of `Rotary` on q
    before the call and `Rotary(..., inverse=True)` on out after it, without either's copy of the
    whole tensor."""
    if q.dtype == torch.float64:
        raise TypeError("sparse_attention_triton: float64 is not supported; use model.csa.sparse_attention")
    B, T, H, C = q.shape
    cos = sin = q_in = None
    if q_angles is not None:
        half = q_angles.shape[-1]
        if tuple(q_angles.shape) != (B, T, half) or 2 * half > C:
            raise ValueError(f"sparse_attention_triton: q_angles {tuple(q_angles.shape)} does not fit q "
                             f"{tuple(q.shape)}")
        q_in = q if q._base is None else q._base  # q's storage as one tensor: a view (q[:, :], unflatten)
        if not q.is_contiguous() or (q_in is not q and (q_in.data_ptr() != q.data_ptr()
                                                         or q_in.numel() != q.numel()
                                                         or not q_in.is_contiguous())):
            raise ValueError("sparse_attention_triton: q_angles rotates q in place, so q must be contiguous "
                             "(and all of the tensor it views)")
        ang = q_angles.float().reshape(B * T, half)
        cos, sin = ang.cos().contiguous(), ang.sin().contiguous()
    if positions is None:
        positions = torch.arange(T, device=q.device).expand(B, T)
    # [halo | win_kv] as one [B, W-1+T, C] tensor: window key w of query t is row t+w; autograd
    # splits its gradient back into win_kv and halo
    kv = _with_halo(win_kv.to(q.dtype), window, halo).contiguous()
    q = q.contiguous()
    doc_start = window_doc_start(doc_start, positions, halo)  # no halo: nothing before the first query
    doc_start, positions = doc_start.contiguous(), positions.contiguous()
    if glob_kv is not None:
        glob_kv, idx = glob_kv.to(q.dtype).contiguous(), idx.contiguous()
    out, _lse, p_sum, *_ = _SparseAttention.apply(q if q_in is None else q_in, kv, glob_kv, idx, doc_start,
                                                  positions, sink.contiguous(), float(scale), int(window),
                                                  bool(want_probs), cos, sin, (B, T, H, C))
    if glob_kv is None or not want_probs:
        return out, None
    return out, p_sum

