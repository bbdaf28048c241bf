"""Triton kernels for lightning-indexer scoring (docs/ARCHITECTURE.md §3).

References (plain PyTorch, model/indexer.py): `index_scores` (every entry) and `index_scores_at`
(only at candidate ids, the Reindex path and the indexer KL loss); the visibility mask fused into
`index_scores_triton` is `AttentionRuntime.visible` (model/runtime.py), as `_select` in
model/attention.py applies it.

    score(t, s) = sum_h w[t, h] * relu(q[t, h, :] . k[s, :])      (fp32 accumulation)

* `index_scores_triton(q, w, k[, positions, doc_start, m])` -> [B, T, S] fp32. One program per
  (query block, key block): the key tile stays on chip while the program loops over heads, each
  head a [BLOCK_T, Di] x [Di, BLOCK_S] tl.dot whose relu is weighted by w[:, h] and added to one
  [BLOCK_T, BLOCK_S] fp32 accumulator. (Stacking the heads into one [BLOCK_T*H, Di] operand gives
  the same MMAs but then needs a [BLOCK_T, H, BLOCK_S] register reshape for the head sum; the
  head loop keeps the sum in the MMA's own layout.) With `positions` and `doc_start` the
  visibility mask is fused: invisible entries are -inf and tiles with no visible entry skip
  their matmuls (about half the tiles of a causal sequence). No backward (selection runs under
  no_grad).
* `index_scores_at_triton(q, w, k, cand)` -> [B, T, P] fp32, -inf at cand == -1. One program per
  query (and chunk of its candidates): q[t] [H, Di] stays on chip, candidate key rows are
  gathered tile by tile, [H, Di] x [Di, BLOCK_P] per tile; the work follows P, never S.
  Differentiable (torch.autograd.Function): the backward recomputes the logits per tile and
  produces dq, dw in registers and dk by fp32 atomic adds into the gathered rows (the same
  scatter-add the reference's index_select backward does).

Dtypes: q and k fp32, bf16 or fp16 (fp64 is refused: the float64 equivalence checks use the
reference); w any float, read as fp32. fp32 inputs use IEEE dots on a GPU (TF32 would miss the
1e-4 agreement); bf16 inputs multiply exactly in the MMA and accumulate in fp32, like the
reference's wide() products up to summation order. Under TRITON_INTERPRET=1 (CPU tests) the
kernels run in Triton's interpreter with fixed small tiles and no autotuning.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

INTERPRET = bool(triton.knobs.runtime.interpret)
NEG_INF = float("-inf")
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------- dense scores
@triton.jit
def _scores_kernel(q_ptr, w_ptr, k_ptr, out_ptr, pos_ptr, doc_ptr,
                   T, S, H, m,
                   sqb, sqt, sqh, sqd, swb, swt, swh, skb, sks, skd, sob, sot, sos, spb, spt, sdb, sdt,
                   DI: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
                   MASK: tl.constexpr, IEEE: tl.constexpr):
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    n_s = tl.cdiv(S, BLOCK_S)
    # key blocks vary fastest: the programs resident together share one query block (hot in L2)
    pid_t, pid_s = pid // n_s, pid % n_s
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)  # [BS]
    offs_d = tl.arange(0, BLOCK_D)  # [BD]
    t_ok, s_ok, d_ok = offs_t < T, offs_s < S, offs_d < DI

    n_heads = H
    if MASK:
        # AttentionRuntime.visible: (j+1)*m <= t+1 (whole block in the past) and j*m >= doc_start
        pos = tl.load(pos_ptr + b * spb + offs_t * spt, mask=t_ok, other=-1)  # [BT] int64
        doc = tl.load(doc_ptr + b * sdb + offs_t * sdt, mask=t_ok, other=0)  # [BT] int64
        j = offs_s.to(tl.int64)[None, :]
        vis = ((j + 1) * m <= pos[:, None] + 1) & (j * m >= doc[:, None]) & s_ok[None, :]  # [BT, BS]
        # a tile nothing can see runs zero head iterations (its stores are all -inf)
        n_heads = tl.where(tl.max(vis.to(tl.int32)) > 0, H, 0)

    # key tile [BS, BD], loaded once, reused by every head
    kt = tl.load(k_ptr + b * skb + offs_s[:, None].to(tl.int64) * sks + offs_d[None, :] * skd,
                 mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    kt = tl.trans(kt)  # [BD, BS]
    q_base = q_ptr + b * sqb + offs_t[:, None].to(tl.int64) * sqt + offs_d[None, :] * sqd  # [BT, BD]
    w_base = w_ptr + b * swb + offs_t.to(tl.int64) * swt  # [BT]
    acc = tl.zeros((BLOCK_T, BLOCK_S), dtype=tl.float32)
    for h in range(0, n_heads):
        qh = tl.load(q_base + h * sqh, mask=t_ok[:, None] & d_ok[None, :], other=0.0)  # [BT, BD]
        wh = tl.load(w_base + h * swh, mask=t_ok, other=0.0).to(tl.float32)  # [BT]
        if IEEE:
            x = tl.dot(qh, kt, input_precision="ieee")  # [BT, BS] fp32
        else:
            x = tl.dot(qh, kt)
        acc += tl.maximum(x, 0.0) * wh[:, None]
    if MASK:
        acc = tl.where(vis, acc, float("-inf"))
    out = out_ptr + b * sob + offs_t[:, None].to(tl.int64) * sot + offs_s[None, :] * sos
    tl.store(out, acc, mask=t_ok[:, None] & s_ok[None, :])


def _dense_configs():
    # sizes for Hopper-class GPUs; each config keeps the [BT, BS] logits and accumulator (fp32)
    # within the register file of its warps
    return [triton.Config({"BLOCK_T": bt, "BLOCK_S": bs}, num_warps=nw, num_stages=ns)
            for bt, bs, nw, ns in ((64, 128, 4, 3), (64, 128, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3),
                                   (64, 256, 8, 3), (128, 128, 8, 2), (64, 64, 4, 4))]


if INTERPRET:  # the interpreter cannot autotune; small tiles exercise the multi-tile paths
    _scores = _scores_kernel
    _DENSE_FIXED = {"BLOCK_T": 16, "BLOCK_S": 16}
else:
    _scores = triton.autotune(_dense_configs(), key=["H", "DI", "MASK", "IEEE"])(_scores_kernel)
    _DENSE_FIXED = {}


def _check(q: torch.Tensor, w: torch.Tensor,
           k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if (q.dim() != 4 or k.dim() != 3 or w.shape != q.shape[:3] or k.shape[0] != q.shape[0]
            or k.shape[2] != q.shape[3]):
        raise ValueError(f"expected q [B,T,H,Di], w [B,T,H], k [B,S,Di]; got {tuple(q.shape)}, "
                         f"{tuple(w.shape)}, {tuple(k.shape)}")
    if q.dtype not in _FLOATS or k.dtype not in _FLOATS:
        raise TypeError(f"index kernels take fp32/bf16/fp16 q and k, got {q.dtype}, {k.dtype} "
                        "(use model.indexer's reference for float64)")
    if q.shape[3] < 16:
        raise ValueError(f"index_dim {q.shape[3]} < 16: tl.dot needs K >= 16")
    if q.dtype != k.dtype:  # tl.dot wants one operand dtype
        common = torch.promote_types(q.dtype, k.dtype)
        q, k = q.to(common), k.to(common)
    return q, w, k


@torch.compiler.disable  # trainer.compile: a graph break, launched as is (model/kernels/__init__.py)
@torch.no_grad()
def index_scores_triton(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor,
                        positions: Optional[torch.Tensor] = None, doc_start: Optional[torch.Tensor] = None,
                        m: int = 1) -> torch.Tensor:
    """q [B, T, H, Di], w [B, T, H], k [B, S, Di] -> scores [B, T, S] fp32 (`index_scores`).

    With positions [B, T] (global query positions) and doc_start [B, T], entry j of query t is
    -inf unless (j+1)*m <= t+1 and j*m >= doc_start[t] (`AttentionRuntime.visible(m, rows)` with
    positions = rt.positions[:, rows], doc_start = rt.doc_start[:, rows]); both or neither."""
    q, w, k = _check(q, w, k)
    B, T, H, Di = q.shape
    S = k.shape[1]
    out = torch.empty(B, T, S, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    mask = positions is not None
    if mask != (doc_start is not None):
        raise ValueError("pass positions and doc_start together (or neither)")
    if mask:
        positions = positions.to(device=q.device, dtype=torch.int64).expand(B, T)
        doc_start = doc_start.to(device=q.device, dtype=torch.int64).expand(B, T)
        pos_args = (positions, doc_start)
        pos_strides = (*positions.stride(), *doc_start.stride())
    else:
        pos_args = (out, out)  # never read (MASK is off)
        pos_strides = (0, 0, 0, 0)

    def grid(meta):
        return (triton.cdiv(T, meta["BLOCK_T"]) * triton.cdiv(S, meta["BLOCK_S"]), B)

    _scores[grid](q, w, k, out, *pos_args, T, S, H, int(m),
                  *q.stride(), *w.stride(), *k.stride(), *out.stride(), *pos_strides,
                  DI=Di, BLOCK_D=triton.next_power_of_2(Di), MASK=mask,
                  IEEE=q.dtype == torch.float32, **_DENSE_FIXED)
    return out


# --------------------------------------------------------------------------- scores at candidates
@triton.jit
def _scores_at_fwd_kernel(q_ptr, w_ptr, k_ptr, c_ptr, out_ptr,
                          T, P, H, S, p_chunk,
                          sqb, sqt, sqh, sqd, swb, swt, swh, skb, sks, skd, scb, sct, scp, sob, sot, sop,
                          DI: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_P: tl.constexpr, IEEE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # b * T + t
    b, t = row // T, row % T
    offs_h, offs_d = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_D)
    h_ok, d_ok = offs_h < H, offs_d < DI
    # this query's heads, kept on chip for all its candidate tiles; padded heads are 0 (w too)
    q = tl.load(q_ptr + b * sqb + t * sqt + offs_h[:, None] * sqh + offs_d[None, :] * sqd,
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)  # [BH, BD]
    w = tl.load(w_ptr + b * swb + t * swt + offs_h * swh, mask=h_ok, other=0.0).to(tl.float32)  # [BH]
    k_base = k_ptr + b * skb
    lo = tl.program_id(1) * p_chunk
    for p0 in range(lo, tl.minimum(lo + p_chunk, P), BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        p_ok = offs_p < P
        c = tl.load(c_ptr + b * scb + t * sct + offs_p * scp, mask=p_ok, other=-1).to(tl.int64)  # [BP]
        valid = (c >= 0) & (c < S)  # -1 = no candidate (an out-of-range id is never read)
        keys = tl.load(k_base + c[:, None] * sks + offs_d[None, :] * skd,
                       mask=valid[:, None] & d_ok[None, :], other=0.0)  # [BP, BD] gathered rows
        if IEEE:
            x = tl.dot(q, tl.trans(keys), input_precision="ieee")  # [BH, BP]
        else:
            x = tl.dot(q, tl.trans(keys))
        s = tl.sum(tl.maximum(x, 0.0) * w[:, None], axis=0)  # [BP]
        s = tl.where(valid, s, float("-inf"))
        tl.store(out_ptr + b * sob + t * sot + offs_p * sop, s, mask=p_ok)


@triton.jit
def _scores_at_bwd_kernel(q_ptr, w_ptr, k_ptr, c_ptr, g_ptr, dq_ptr, dw_ptr, dk_ptr,
                          T, P, H, S,
                          sqb, sqt, sqh, sqd, swb, swt, swh, skb, sks, skd, scb, sct, scp, sgb, sgt, sgp,
                          DI: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_P: tl.constexpr, IEEE: tl.constexpr, NEED_DK: tl.constexpr):
    # x[h, p] = q[h] . k[c_p];  score[p] = sum_h w[h] relu(x[h, p])
    # dw[h] = sum_p g[p] relu(x[h, p]);  dx[h, p] = g[p] w[h] [x > 0]
    # dq[h] = sum_p dx[h, p] k[c_p];  dk[c_p] += sum_h dx[h, p] q[h]
    row = tl.program_id(0).to(tl.int64)
    b, t = row // T, row % T
    offs_h, offs_d = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_D)
    h_ok, d_ok = offs_h < H, offs_d < DI
    q = tl.load(q_ptr + b * sqb + t * sqt + offs_h[:, None] * sqh + offs_d[None, :] * sqd,
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)  # [BH, BD]
    w = tl.load(w_ptr + b * swb + t * swt + offs_h * swh, mask=h_ok, other=0.0).to(tl.float32)  # [BH]
    k_base = k_ptr + b * skb
    dk_base = dk_ptr + b * S * DI  # dk: a contiguous fp32 [B, S, DI] buffer
    dq = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    dw = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        p_ok = offs_p < P
        c = tl.load(c_ptr + b * scb + t * sct + offs_p * scp, mask=p_ok, other=-1).to(tl.int64)
        valid = (c >= 0) & (c < S)
        keys = tl.load(k_base + c[:, None] * sks + offs_d[None, :] * skd,
                       mask=valid[:, None] & d_ok[None, :], other=0.0)  # [BP, BD]
        # the -inf slots pass no gradient (masked_fill's backward), whatever g holds there
        g = tl.load(g_ptr + b * sgb + t * sgt + offs_p * sgp, mask=valid & p_ok, other=0.0)  # [BP]
        if IEEE:
            x = tl.dot(q, tl.trans(keys), input_precision="ieee")  # [BH, BP]
        else:
            x = tl.dot(q, tl.trans(keys))
        dw += tl.sum(tl.maximum(x, 0.0) * g[None, :], axis=1)
        dx = tl.where(x > 0.0, w[:, None] * g[None, :], 0.0)  # [BH, BP] fp32
        # bf16 inputs: dx is rounded to bf16 for the MMA (as flash-attention does with dS)
        dxo = dx.to(keys.dtype)
        if IEEE:
            dq += tl.dot(dxo, keys, input_precision="ieee")  # [BH, BD]
        else:
            dq += tl.dot(dxo, keys)
        if NEED_DK:
            if IEEE:
                dkt = tl.dot(tl.trans(dxo), q, input_precision="ieee")  # [BP, BD]
            else:
                dkt = tl.dot(tl.trans(dxo), q)
            tl.atomic_add(dk_base + c[:, None] * DI + offs_d[None, :], dkt,
                          mask=valid[:, None] & d_ok[None, :], sem="relaxed")
    tl.store(dq_ptr + row * (H * DI) + offs_h[:, None] * DI + offs_d[None, :], dq.to(dq_ptr.dtype.element_ty),
             mask=h_ok[:, None] & d_ok[None, :])  # dq: contiguous [B, T, H, DI] in q's dtype (rounded once)
    tl.store(dw_ptr + row * H + offs_h, dw, mask=h_ok)  # dw: contiguous fp32 [B, T, H]


def _at_blocks(H: int, Di: int, backward: bool = False) -> dict:
    block_h = max(16, triton.next_power_of_2(H))  # tl.dot needs M >= 16 (padded heads are 0)
    block_d = triton.next_power_of_2(Di)
    if INTERPRET:
        return {"BLOCK_H": block_h, "BLOCK_D": block_d, "BLOCK_P": 16}
    # [BH, BP] logits in fp32 plus a [BP, BD] key tile: 64 candidates per tile at H=64, Di=128
    block_p = 64 if block_h * block_d <= 64 * 128 else 32
    if backward and block_h * block_d <= 16 * 128:
        # `small` (16 heads x 128): 128 candidates, 4 warps, 2 stages, the fastest of a sweep; prefetching
        # the candidate rows further ahead was slower
        return {"BLOCK_H": block_h, "BLOCK_D": block_d, "BLOCK_P": 128, "num_warps": 4, "num_stages": 2}
    # the backward also holds dq [BH, BD] and a dk tile [BP, BD] in fp32: twice the warps
    return {"BLOCK_H": block_h, "BLOCK_D": block_d, "BLOCK_P": block_p, "num_warps": 8 if backward else 4}


def _scores_at_forward(q, w, k, cand) -> torch.Tensor:
    B, T, H, Di = q.shape
    P = cand.shape[-1]
    out = torch.empty(B, T, P, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    blocks = _at_blocks(H, Di)
    # split a query's candidates over several programs only when there are few queries
    n_sm = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
    tiles = triton.cdiv(P, blocks["BLOCK_P"])
    splits = max(1, min(tiles, triton.cdiv(4 * n_sm, B * T)))
    p_chunk = triton.cdiv(tiles, splits) * blocks["BLOCK_P"]
    grid = (B * T, triton.cdiv(P, p_chunk))
    _scores_at_fwd_kernel[grid](q, w, k, cand, out, T, P, H, k.shape[1], p_chunk,
                                *q.stride(), *w.stride(), *k.stride(), *cand.stride(), *out.stride(),
                                DI=Di, IEEE=q.dtype == torch.float32, **blocks)
    return out


class _IndexScoresAt(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, w, k, cand):
        ctx.save_for_backward(q, w, k, cand)
        return _scores_at_forward(q, w, k, cand)

    @staticmethod
    def backward(ctx, g):
        q, w, k, cand = ctx.saved_tensors
        B, T, H, Di = q.shape
        S, P = k.shape[1], cand.shape[-1]
        need_q, need_w, need_k = ctx.needs_input_grad[:3]
        # every query's program writes its whole dq and dw row (in q's dtype: no fp32 copy to cast)
        alloc = torch.empty if P > 0 else torch.zeros
        dq = alloc(B, T, H, Di, dtype=q.dtype, device=q.device)
        dw = alloc(B, T, H, dtype=torch.float32, device=q.device)
        dk = torch.zeros(B, S, Di, dtype=torch.float32, device=q.device) if need_k else dq
        if B * T > 0 and P > 0:
            _scores_at_bwd_kernel[(B * T,)](q, w, k, cand, g, dq, dw, dk, T, P, H, S,
                                            *q.stride(), *w.stride(), *k.stride(), *cand.stride(),
                                            *g.stride(), DI=Di, IEEE=q.dtype == torch.float32, NEED_DK=need_k,
                                            **_at_blocks(H, Di, backward=True))
        return (dq if need_q else None, dw.to(w.dtype) if need_w else None,
                dk.to(k.dtype) if need_k else None, None)


@torch.compiler.disable  # trainer.compile: a graph break, launched as is (model/kernels/__init__.py)
def index_scores_at_triton(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor,
                           cand: torch.Tensor) -> torch.Tensor:
    """q [B, T, H, Di], w [B, T, H], k [B, S, Di], cand [B, T, P] int (-1 = none) -> [B, T, P]
    fp32, -inf at -1 (`index_scores_at`). Differentiable in q, w and k."""
    q2, w, k2 = _check(q, w, k)
    if cand.shape[:2] != q.shape[:2] or cand.dim() != 3:
        raise ValueError(f"cand {tuple(cand.shape)} must be [B, T, P] for q {tuple(q.shape)}")
    if cand.dtype not in (torch.int64, torch.int32):
        cand = cand.long()
    out = _IndexScoresAt.apply(q2, w, k2, cand)
    return out
