"""Fused single-pass mHC residual step (Triton forward and backward).

Replaces this chain of plain-PyTorch references from `model/mhc.py` at a sub-layer boundary
(`Block.forward` in `model/transformer.py`; the schedule that calls this step is `model/fused_mhc.py`):

    h_new = update_streams(h, y, post, comb)        # h'[d] = post[d] y + sum_s comb[s, d] h[s]
    x     = mix_streams(pre, h_new)                 # next sub-layer input, pre known already
    mix   = the NEXT HyperConnection's forward up to its F.linear:
            flat = h_new.flatten(-2); (flat * rsqrt(mean(flat^2) + norm_eps)) @ fn^T

Single-pass mHC makes this possible: `pre` of the next sub-layer was produced by the previous
HyperConnection, so one read of the streams gives the update, the next input and the next
coefficient logits. Per token the forward reads h (n*D) and y (D) and writes h' (n*D) and
x (D): the (2n + 2) * D ideal. The [2n + n*n, n*D] logit weight is read from L2 once per
token tile, not per token. In `fused_block_forward` (bf16 streams):

    y = block.attention(x, rt)
    h, x, mix = fused_mhc_step(h, y, post, comb, ffn_pre, block.ffn_hc.fn, block.ffn_hc.norm_eps)
    post, comb, next_pre = block.ffn_hc.coefficients(mix)
    y = block.ffn(x, rt)
    h, x, mix = fused_mhc_step(h, y, post, comb, next_pre, <next layer>.attn_hc.fn, norm_eps)

Where no update comes before a boundary (the first sub-layer; the one after an Engram, which
rewrites h before the next attn_hc), `fused_mhc_mix` runs the same kernels with the update
left out: one read of h gives x and the logits (reference: `reference_mhc_mix`). The last
boundary has no next HyperConnection (the final norm of mix_streams only).

The epilogue (sigmoid, 2*sigmoid, Sinkhorn of the n x n comb) is not in this kernel, but in
`hc_coefficients`: it acts on [T, 2n + n*n] fp32 logits (96 bytes a token for n = 4, against
~80 KB of streams at D = 4096) and needs the sum over all D blocks first (the forward splits D
over programs). Its 20 Sinkhorn rounds run in one launch of their own kernel
(model/kernels/sinkhorn.py) when model.kernels=true.

Contract (`fused_mhc_step`), any leading dims `...` (flattened to T tokens inside):
    h    [..., n, D]   bf16 / fp16 / fp32 streams    -> h_new [..., n, D] same dtype
    y    [..., D]      sub-layer output, any float  -> x     [..., D]    h's dtype (under
                                                         autocast: the autocast dtype)
    post [..., n], comb [..., n, n], pre [..., n]     fp32 (cast if not)
    fn   [2n + n*n, n*D] fp32 weight of the next HyperConnection, norm_eps its `norm_eps`
         (the model's RMSNorm eps, not hc_eps: DeepSeek's inference code normalises with it)
                                                      -> mix   [..., 2n + n*n] fp32 logits
Differentiable in h, y, post, comb, pre and fn. Math is fp32: h_new is rounded to h's
dtype once, and x and mix are computed from the rounded h_new (what the reference's next
HyperConnection and mix_streams see); the reference rounds more often in bf16. fp64 inputs
fall back to the reference composition.

Precision of the small matmuls: with bf16 streams h' is exact in bf16, so the logits use
fn split into bf16 hi + lo halves (two bf16 MMAs, fp32 accumulation: ~fp32 accuracy at bf16
tensor-core speed); the fn gradient splits g_dot the same way. fp32 / fp16 streams use a
3-pass tf32 dot for the logits and a host fp32 matmul for the fn gradient. The backward's
g_dot @ fn term is exact fp32 on CUDA cores (see `_mhc_bwd_kernel`).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from model.mhc import HyperConnection, mix_streams, update_streams

# fp32 x fp32 tl.dot: tf32x3 (three tensor-core passes) keeps ~fp32 accuracy for the logits,
# like the reference's fp32 F.linear; plain tf32 would lose ~3 decimal digits.
_DOT_PRECISION = "tf32x3"


@dataclass(frozen=True)
class MHCKernelConfig:
    """Tiles and work split. block_t >= 16 (tl.dot). None picks the per-dtype default: D blocks
    of 64 for bf16 streams, 32 otherwise (the fp32 operands of the 3-pass tf32 dot need more
    registers), chosen offline with ptxas for no register spills. Both stream dtypes training
    runs have defaults chosen by a sweep of tiles, warps and stages on an H200 (bf16: the default
    under autocast, see `resolved`; fp32: with model.fp32_residual=true)."""
    block_t: int = 32  # tokens per tile: the forward's, and the backward's unless bwd_block_t
    fwd_block_d: Optional[int] = None  # model-dim columns per forward tile
    bwd_block_d: Optional[int] = None  # ... per backward tile
    bwd_block_t: Optional[int] = None  # backward token tile (None: 16 for fp32 streams, else block_t)
    # forward token tile (None: block_t, but 16 for fp32 streams with a bf16 / fp16 y or x, whose
    # 32-token tile spills 364 / 348 bytes at 4 warps on sm_90 where fp32 y and x spill 52 / 44)
    fwd_block_t: Optional[int] = None
    num_warps: int = 8  # the forward's unless fwd_num_warps; the backward's unless bwd_num_warps
    fwd_num_warps: Optional[int] = None  # None: 4 for fp32 streams, else num_warps
    bwd_num_warps: Optional[int] = None  # None: 4 for bf16 streams, else num_warps
    num_stages: int = 1  # backward: short load-bound loops, software pipelining only costs smem and registers
    # forward: 3 stages prefetch the next D block's streams while this one mixes (the backward,
    # load-bound, only loses by it)
    fwd_num_stages: int = 3
    fwd_splits: Optional[int] = None  # forward: D ranges per token tile (None: fill the GPU)
    bwd_groups: Optional[int] = None  # backward: token groups per D block (None: fill the GPU)

    def resolved(self, dtype: torch.dtype, narrow_io: bool = False) -> MHCKernelConfig:
        """narrow_io: y or x is narrower than the streams (bf16 / fp16 against fp32 streams)."""
        bf16 = dtype == torch.bfloat16
        block_d = 64 if bf16 else 32  # 64 bf16 = a 128-byte line per stream row
        fp32 = dtype == torch.float32
        # bf16 streams (model.fp32_residual=false): 64-token forward tiles and 32 x 64 backward tiles
        # at 4 warps were the fastest of the sweep
        return replace(self, fwd_block_d=self.fwd_block_d or block_d,
                       fwd_block_t=self.fwd_block_t or (64 if bf16 else 16 if fp32 and narrow_io
                                                        else self.block_t),
                       bwd_block_d=self.bwd_block_d or (64 if fp32 or bf16 else block_d),
                       bwd_block_t=self.bwd_block_t or (16 if fp32 else self.block_t),
                       fwd_num_warps=self.fwd_num_warps or (4 if fp32 else self.num_warps),
                       bwd_num_warps=self.bwd_num_warps or (4 if bf16 else self.num_warps))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _programs_wanted(device: torch.device) -> int:
    # ~4 resident programs per SM keeps enough loads in flight for a bandwidth-bound kernel
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # interpreter: fewest programs is fastest


def forward_splits(T: int, D: int, device: torch.device, dtype: torch.dtype = torch.bfloat16,
                   cfg: Optional[MHCKernelConfig] = None):
    """(D splits, D blocks per split) of the forward: enough programs to fill the GPU even
    when there are few token tiles; each split adds one [T, 2n+n*n] fp32 partial (two for bf16)."""
    cfg = (cfg or MHCKernelConfig()).resolved(dtype)
    n_blocks = triton.cdiv(D, cfg.fwd_block_d)
    splits = cfg.fwd_splits or triton.cdiv(_programs_wanted(device), triton.cdiv(max(T, 1), cfg.fwd_block_t))
    per_split = triton.cdiv(n_blocks, max(1, min(splits, n_blocks)))
    return triton.cdiv(n_blocks, per_split), per_split  # no empty splits


# ----------------------------------------------------------------------------- kernels
# Layout: each stream is its own 2-D tile [BT, BD] (held in a tuple, one entry per stream),
# so all stream mixing is elementwise FMAs within a thread. A 3-D [BT, n, BD] tile would put
# the stream axis across warps and make every mix a shared-memory reduction (and spill).
@triton.jit
def _token_coeffs(ptr, t64, t_ok, W: tl.constexpr):
    """Columns of a [T, W] fp32 coefficient array for tokens t: a tuple of W [BT] vectors."""
    cols = ()
    for j in tl.static_range(W):
        cols = cols + (tl.load(ptr + t64 * W + j, mask=t_ok, other=0.0),)
    return cols


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b. UPCAST (interpreter only, whose bf16 tl.dot multiplies raw bit patterns):
    the same products in fp32, exact for bf16 inputs."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _mix_dest(d: tl.constexpr, hs, yv, post, comb, N: tl.constexpr):
    """h'[d] = post[d] y + sum_s comb[s, d] h[s] for one D block: [BT, BD] fp32."""
    hn = post[d][:, None] * yv
    for s in tl.static_range(N):
        hn += comb[s * N + d][:, None] * hs[s]
    return hn


@triton.jit
def _mhc_fwd_kernel(h_ptr, y_ptr, post_ptr, comb_ptr, pre_ptr, fa_ptr,
                    hn_ptr, x_ptr, dot_part_ptr, ss_part_ptr,
                    T, D, blocks_per_split,
                    N: tl.constexpr, MS: tl.constexpr, MA: tl.constexpr,
                    BT: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                    UPDATE: tl.constexpr):
    """Program (token tile, D split): loops over its D blocks; per block reads h [BT, n, BD]
    and y [BT, BD] once, writes h' and x, and accumulates sum(h'^2) [BT] and the logits
    fa @ h'^T [MS, BT] over its D range (partials, summed over splits on the host side).
    fa [MS, n*D]: fn itself (fp32), or its bf16 hi and lo halves stacked (bf16 streams).
    Without UPDATE, h' is h itself: y, post, comb and hn are not touched (`fused_mhc_mix`)."""
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    t = pid_t * BT + tl.arange(0, BT)
    t_ok = t < T
    t64 = t.to(tl.int64)  # T * n * D overflows int32 at long sequences
    ma = tl.arange(0, MA)  # fa row (padded: tl.dot wants >= 16, wgmma 64)
    ma_ok = ma < MS
    K = N * D  # fa row length
    row_h = t64[:, None] * K  # [BT, 1] start of each token's streams
    row_y = t64[:, None] * D
    # per-token coefficients, loaded once per program: tuples of [BT] vectors
    pre = _token_coeffs(pre_ptr, t64, t_ok, N)
    post = pre  # placeholders without UPDATE (never read)
    comb = pre
    if UPDATE:
        post = _token_coeffs(post_ptr, t64, t_ok, N)
        comb = _token_coeffs(comb_ptr, t64, t_ok, N * N)  # comb[s * N + d]: source s -> dest d

    # logits transposed, [rows of fa, tokens]: the weight is the dot's M side (>= 64 rows ->
    # Hopper wgmma with both operands in shared memory, no per-warp register copies of fn)
    acc = tl.zeros([MA, BT], dtype=tl.float32)
    ss = tl.zeros([BT], dtype=tl.float32)  # sum of squares of h'
    d0 = pid_s * blocks_per_split * BD
    for blk in range(0, blocks_per_split):
        k = d0 + blk * BD + tl.arange(0, BD)
        k_ok = k < D
        mask = t_ok[:, None] & k_ok[None, :]
        hs = ()
        for s in tl.static_range(N):  # the only read of h
            hs = hs + (tl.load(h_ptr + row_h + s * D + k[None, :], mask=mask, other=0.0).to(tl.float32),)
        x = tl.zeros([BT, BD], dtype=tl.float32)
        yv = x
        if UPDATE:
            yv = tl.load(y_ptr + row_y + k[None, :], mask=mask, other=0.0).to(tl.float32)
        for d in tl.static_range(N):  # destination stream
            if UPDATE:
                hn_out = _mix_dest(d, hs, yv, post, comb, N).to(hn_ptr.dtype.element_ty)
                tl.store(hn_ptr + row_h + d * D + k[None, :], hn_out, mask=mask)
            else:  # exact: hs[d] was widened from this dtype
                hn_out = hs[d].to(h_ptr.dtype.element_ty)
            hn = hn_out.to(tl.float32)  # x and the logits see the stored (rounded) h'
            x += pre[d][:, None] * hn
            ss += tl.sum(hn * hn, axis=1)
            fa = tl.load(fa_ptr + ma[:, None] * K + d * D + k[None, :],
                         mask=ma_ok[:, None] & k_ok[None, :], other=0.0)  # [MA, BD], from L2
            acc = _dot(fa, tl.trans(hn_out.to(fa_ptr.dtype.element_ty)), acc, PRECISION, UPCAST)
        tl.store(x_ptr + row_y + k[None, :], x.to(x_ptr.dtype.element_ty), mask=mask)
    part = pid_s.to(tl.int64) * T + t64
    tl.store(dot_part_ptr + part[None, :] * MS + ma[:, None], acc, mask=ma_ok[:, None] & t_ok[None, :])
    tl.store(ss_part_ptr + part, ss, mask=t_ok)


@triton.jit
def _rank1(gdot_ptr, fn_ptr, t64, t_ok, k, k_ok, j, d, D, K, M: tl.constexpr):
    """g_dot[:, j] fn[j, d*D + k]: [BT, BD] fp32; both loads hit L1 after a group's first tile."""
    gd_j = tl.load(gdot_ptr + t64 * M + j, mask=t_ok, other=0.0)  # [BT]
    fn_j = tl.load(fn_ptr + j * K + d * D + k, mask=k_ok, other=0.0)  # [BD]
    return gd_j[:, None] * fn_j[None, :]


@triton.jit
def _mhc_bwd_kernel(h_ptr, y_ptr, post_ptr, comb_ptr, pre_ptr, fn_ptr,
                    ghn_ptr, gx_ptr, coef_ptr, gdot_ptr,
                    gh_ptr, gy_ptr, gpost_part_ptr, gcomb_part_ptr, gpre_part_ptr,
                    T, D, n_tiles,
                    N: tl.constexpr, M: tl.constexpr,
                    BT: tl.constexpr, BD: tl.constexpr,
                    HAS_GHN: tl.constexpr, HAS_GX: tl.constexpr, HAS_GMIX: tl.constexpr,
                    UPDATE: tl.constexpr, J_UNROLL: tl.constexpr = 8):
    """Program (D block, token group): loops over the group's token tiles at a fixed D block; the
    per-token coefficient gradients (reductions over D) are written as per-D-block partials.

    Recomputes h' from h and y (which are read anyway for the post/comb gradients), so h' is
    not re-read. With g_dot = r * g_mix and G[d] the total gradient reaching h'[d]:
        G[d]    = g_hn[d] + pre[d] g_x + g_dot @ fn[:, d] + coef * h'[d]   (coef: RMS term)
        g_h[s]  = sum_d comb[s, d] G[d]        g_y = sum_d post[d] G[d]
        g_post[d] = <G[d], y>   g_comb[s, d] = <G[d], h[s]>   g_pre[d] = <g_x, h'[d]>
    g_dot @ fn[:, d] runs as M rank-1 fp32 updates on CUDA cores (exact fp32): a tensor-core
    dot there hands its (transposed MMA) layout to the whole elementwise chain, which then
    spills (checked with ptxas for sm_90); ~24 FMAs an element should stay under the memory
    roof (an estimate: ~5 FLOP per HBM byte against ~14 on H200; not yet measured).
    g_fn = g_dot^T h' (a reduction over tokens) is a host matmul over the h' the forward saved:
    a tensor-core dot in this kernel made it slower than that GEMM (its four [64, BD] fp32
    accumulators).
    Without UPDATE (`fused_mhc_mix`: h' is h), g_h[d] = G[d]: y, post, comb and their
    gradients are not touched, and there is no g_hn.
    """
    pid_b = tl.program_id(0)
    pid_g = tl.program_id(1)
    n_groups = tl.num_programs(1)
    k = pid_b * BD + tl.arange(0, BD)
    k_ok = k < D
    K = N * D
    for tile in range(pid_g, n_tiles, n_groups):
        t = tile * BT + tl.arange(0, BT)
        t_ok = t < T
        t64 = t.to(tl.int64)
        mask = t_ok[:, None] & k_ok[None, :]
        row_h = t64[:, None] * K
        row_y = t64[:, None] * D
        part = pid_b.to(tl.int64) * T + t64  # row of the per-D-block partials
        pre = _token_coeffs(pre_ptr, t64, t_ok, N)
        post = pre  # placeholders without UPDATE (never read)
        comb = pre
        if UPDATE:
            post = _token_coeffs(post_ptr, t64, t_ok, N)
            comb = _token_coeffs(comb_ptr, t64, t_ok, N * N)
        hs = ()
        for s in tl.static_range(N):
            hs = hs + (tl.load(h_ptr + row_h + s * D + k[None, :], mask=mask, other=0.0).to(tl.float32),)
        gy = tl.zeros([BT, BD], dtype=tl.float32)
        yv = gy
        if UPDATE:
            yv = tl.load(y_ptr + row_y + k[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_GX:
            gx = tl.load(gx_ptr + row_y + k[None, :], mask=mask, other=0.0).to(tl.float32)
        else:
            gx = tl.zeros([BT, BD], dtype=tl.float32)
        if HAS_GMIX:
            coef = tl.load(coef_ptr + t64, mask=t_ok, other=0.0)  # [BT]
        gh = ()
        if UPDATE:
            for _ in tl.static_range(N):
                gh = gh + (tl.zeros([BT, BD], dtype=tl.float32),)
        for d in tl.static_range(N):
            if UPDATE:  # recompute h'[d] exactly as the forward stored it
                hn_out = _mix_dest(d, hs, yv, post, comb, N).to(gh_ptr.dtype.element_ty)
            else:
                hn_out = hs[d].to(gh_ptr.dtype.element_ty)
            hn = hn_out.to(tl.float32)
            g = pre[d][:, None] * gx
            if HAS_GHN:
                g += tl.load(ghn_ptr + row_h + d * D + k[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_GMIX:
                # a runtime loop over groups of J_UNROLL rows: fully unrolled, all 24 fn rows and g_dot
                # columns would be hoisted into registers (2x slower); one row an iteration leaves
                # each FMA waiting on its two L1 loads. Unrolled by 8 the loads of a group are in
                # flight together
                for j0 in range(0, M - M % J_UNROLL, J_UNROLL):
                    for jj in tl.static_range(J_UNROLL):
                        g += _rank1(gdot_ptr, fn_ptr, t64, t_ok, k, k_ok, j0 + jj, d, D, K, M)
                for j in tl.static_range(M - M % J_UNROLL, M):  # the rest (n = 3: 15 rows)
                    g += _rank1(gdot_ptr, fn_ptr, t64, t_ok, k, k_ok, j, d, D, K, M)
                g += coef[:, None] * hn
            if UPDATE:
                new_gh = ()
                for s in tl.static_range(N):
                    new_gh = new_gh + (gh[s] + comb[s * N + d][:, None] * g,)
                    tl.store(gcomb_part_ptr + part * (N * N) + s * N + d, tl.sum(g * hs[s], axis=1),
                             mask=t_ok)
                gh = new_gh
                gy += post[d][:, None] * g
                tl.store(gpost_part_ptr + part * N + d, tl.sum(g * yv, axis=1), mask=t_ok)
            else:  # h' = h: G[d] is h[d]'s whole gradient
                tl.store(gh_ptr + row_h + d * D + k[None, :], g.to(gh_ptr.dtype.element_ty), mask=mask)
            if HAS_GX:
                tl.store(gpre_part_ptr + part * N + d, tl.sum(gx * hn, axis=1), mask=t_ok)
        if UPDATE:
            for s in tl.static_range(N):
                tl.store(gh_ptr + row_h + s * D + k[None, :], gh[s].to(gh_ptr.dtype.element_ty), mask=mask)
            tl.store(gy_ptr + row_y + k[None, :], gy.to(gy_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- autograd
def _pow2(x: int, floor: int = 1) -> int:
    return max(floor, triton.next_power_of_2(x))


def _split_bf16(a: torch.Tensor):
    """fp32 a -> bf16 (hi, lo) with hi + lo = a to ~2^-17 relative: two bf16 tensor-core
    products then carry ~fp32 accuracy, at bf16 speed."""
    hi = a.to(torch.bfloat16)
    return hi, (a - hi.float()).to(torch.bfloat16)


def _forward_weight(fn: torch.Tensor, dtype: torch.dtype):
    """(fa [MS, n*D], dot precision) of the forward's logit dot. bf16 streams: h' is exactly
    bf16, so [fn_hi; fn_lo] (MS = 2M rows, the halves added afterwards) gives fp32-grade
    logits from bf16 MMAs. Otherwise fn in fp32 with 3-pass tf32."""
    if dtype == torch.bfloat16:
        return torch.cat(_split_bf16(fn)).contiguous(), None
    return fn, _DOT_PRECISION


def _forward(h, y, post, comb, pre, fn, norm_eps: float, cfg: MHCKernelConfig, x_dtype: torch.dtype):
    """The forward kernel and its host-side sums -> (h_new, x, mix, r, resolved cfg). y, post and
    comb None: no residual update (h' is h, h_new None)."""
    T, N, D = h.shape
    M = fn.shape[0]
    update = y is not None
    narrow = min(y.element_size() if update else h.element_size(), x_dtype.itemsize) < h.element_size()
    cfg = cfg.resolved(h.dtype, narrow_io=narrow)
    h_new = torch.empty_like(h) if update else None
    x = torch.empty(T, D, dtype=x_dtype, device=h.device)
    fa, precision = _forward_weight(fn, h.dtype)
    MS = fa.shape[0]
    splits, per_split = forward_splits(T, D, h.device, h.dtype, cfg)
    dot_part = torch.empty(splits, T, MS, device=h.device, dtype=torch.float32)
    ss_part = torch.empty(splits, T, device=h.device, dtype=torch.float32)
    if T > 0:  # without an update, h stands in for the pointers the kernel does not touch
        _mhc_fwd_kernel[(triton.cdiv(T, cfg.fwd_block_t), splits)](
            h, y if update else h, post if update else pre, comb if update else pre, pre, fa,
            h_new if update else h, x, dot_part, ss_part, T, D, per_split,
            N=N, MS=MS, MA=_pow2(MS, 64), BT=cfg.fwd_block_t, BD=cfg.fwd_block_d,
            PRECISION=precision, UPCAST=_interpreting(), UPDATE=update, num_warps=cfg.fwd_num_warps,
            num_stages=cfg.fwd_num_stages)
    # [T] RMS factor and [T, M] logits: tiny host-side reductions over the D splits
    r = torch.rsqrt(ss_part.sum(0) / (N * D) + norm_eps)
    dot = dot_part.sum(0)
    if MS != M:  # bf16 hi + lo halves
        dot = dot[:, :M] + dot[:, M:]
    return h_new, x, dot * r[:, None], r, cfg


def _backward(h, y, post, comb, pre, fn, r, mix, h_new, cfg: MHCKernelConfig, g_hn, g_x, g_mix,
              need_fn: bool):
    """Gradients (g_h, g_y, g_post, g_comb, g_pre, g_fn) of `_forward`'s outputs; y, post and
    comb None as there (g_y, g_post, g_comb None then). h_new: the streams the logits were taken
    of (g_fn is a host matmul over them)."""
    T, N, D = h.shape
    M = fn.shape[0]
    update = y is not None
    need_fn = need_fn and g_mix is not None
    gdot = coef = r  # placeholders for pointers the kernel does not read
    if g_mix is not None:
        g_mix = g_mix.float()
        gdot = (g_mix * r[:, None]).contiguous()  # d/d(h' . fn[m])
        # d/dh' through r = rsqrt(mean(h'^2) + norm_eps): 2 * dL/d(ss) = -(r^2 / nD) <g_mix, mix>
        coef = (-(r * r) / (N * D) * (g_mix * mix).sum(-1)).contiguous()
    g_hn = g_hn.contiguous() if g_hn is not None else None
    g_x = g_x.contiguous() if g_x is not None else None
    n_blocks = triton.cdiv(D, cfg.bwd_block_d)
    n_tiles = triton.cdiv(T, cfg.bwd_block_t)
    groups = cfg.bwd_groups or triton.cdiv(_programs_wanted(h.device), n_blocks)
    groups = max(1, min(groups, n_tiles))
    g_h = torch.empty_like(h)
    g_y = torch.empty_like(y) if update else None
    f32 = dict(device=h.device, dtype=torch.float32)
    gpre_part = torch.empty(n_blocks, T, N, **f32) if g_x is not None else r
    gpost_part = torch.empty(n_blocks, T, N, **f32) if update else gpre_part
    gcomb_part = torch.empty(n_blocks, T, N, N, **f32) if update else gpre_part
    if T > 0:  # dummies (h, pre, g_h, r) for what the kernel does not touch
        _mhc_bwd_kernel[(n_blocks, groups)](
            h, y if update else h, post if update else pre, comb if update else pre, pre, fn,
            g_hn if g_hn is not None else h, g_x if g_x is not None else h, coef, gdot,
            g_h, g_y if update else g_h, gpost_part, gcomb_part, gpre_part, T, D, n_tiles,
            N=N, M=M, BT=cfg.bwd_block_t, BD=cfg.bwd_block_d,
            HAS_GHN=g_hn is not None, HAS_GX=g_x is not None, HAS_GMIX=g_mix is not None,
            UPDATE=update, num_warps=cfg.bwd_num_warps, num_stages=cfg.num_stages)
    g_pre = gpre_part.sum(0) if g_x is not None else None
    g_fn = None
    if need_fn and h_new.dtype == torch.bfloat16 and h_new.is_cuda:
        # g_dot's bf16 halves against h' (exact in bf16), accumulated and returned in fp32
        g_fn = torch.mm(torch.cat(_split_bf16(gdot), 1).T, h_new.reshape(T, N * D), out_dtype=torch.float32)
        g_fn = g_fn[:M] + g_fn[M:]
    elif need_fn:  # g_dot^T @ h' in fp32 (one more read of h')
        g_fn = gdot.T @ h_new.reshape(T, N * D).float()
    if not update:
        return g_h, None, None, None, g_pre, g_fn
    return g_h, g_y, gpost_part.sum(0), gcomb_part.sum(0), g_pre, g_fn


class _FusedMHCStep(torch.autograd.Function):
    """Flat shapes: h [T, n, D], y [T, D], post/pre [T, n], comb [T, n, n], fn [M, n*D]."""

    @staticmethod
    def forward(ctx, h, y, post, comb, pre, fn, norm_eps: float, cfg: MHCKernelConfig, x_dtype: torch.dtype):
        h_new, x, mix, r, cfg = _forward(h, y, post, comb, pre, fn, norm_eps, cfg, x_dtype)
        ctx.save_for_backward(h, y, post, comb, pre, fn, r, mix, h_new)
        ctx.cfg = cfg
        ctx.set_materialize_grads(False)  # unused outputs cost no traffic in the backward
        return h_new, x, mix

    @staticmethod
    def backward(ctx, g_hn, g_x, g_mix):
        h, y, post, comb, pre, fn, r, mix, h_new = ctx.saved_tensors
        grads = _backward(h, y, post, comb, pre, fn, r, mix, h_new, ctx.cfg, g_hn, g_x, g_mix,
                          ctx.needs_input_grad[5])
        return *grads, None, None, None


class _FusedMHCMix(torch.autograd.Function):
    """`_FusedMHCStep` without the residual update: h [T, n, D], pre [T, n], fn [M, n*D] -> x, mix."""

    @staticmethod
    def forward(ctx, h, pre, fn, norm_eps: float, cfg: MHCKernelConfig, x_dtype: torch.dtype):
        _, x, mix, r, cfg = _forward(h, None, None, None, pre, fn, norm_eps, cfg, x_dtype)
        ctx.save_for_backward(h, pre, fn, r, mix)
        ctx.cfg = cfg
        ctx.set_materialize_grads(False)
        return x, mix

    @staticmethod
    def backward(ctx, g_x, g_mix):
        h, pre, fn, r, mix = ctx.saved_tensors
        g_h, _, _, _, g_pre, g_fn = _backward(h, None, None, None, pre, fn, r, mix, h, ctx.cfg, None, g_x,
                                              g_mix, ctx.needs_input_grad[2])
        return g_h, g_pre, g_fn, None, None, None


# ----------------------------------------------------------------------------- entry points
def _x_dtype(h: torch.Tensor) -> torch.dtype:
    """The next sub-layer input's dtype: the autocast dtype under autocast (as the reference's
    mix_streams einsum gives it, so the norm after it casts nothing), else the streams'."""
    dev = h.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype


@torch.compiler.disable  # trainer.compile: a graph break, launched as is (model/kernels/__init__.py)
def fused_mhc_step(h: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                   pre: torch.Tensor, fn: torch.Tensor, norm_eps: float,
                   config: Optional[MHCKernelConfig] = None):
    """h [..., n, D], y [..., D], post/pre [..., n], comb [..., n, n], fn [2n+n*n, n*D]
    -> (h_new [..., n, D], x [..., D], mix [..., 2n+n*n] fp32); see the module docstring.
    Same values as `reference_mhc_step`; differentiable in every tensor argument."""
    if h.dtype == torch.float64:
        return reference_mhc_step(h, y, post, comb, pre, fn, norm_eps)
    *lead, N, D = h.shape
    M = fn.shape[0]
    if y.shape != (*lead, D) or fn.shape[1] != N * D:
        raise ValueError(f"shape mismatch: h {tuple(h.shape)}, y {tuple(y.shape)}, fn {tuple(fn.shape)}")
    T = math.prod(lead)
    # y is read in its own dtype and widened in registers, and its gradient written in that dtype:
    # a cast to the streams' dtype here was a copy of [T, D] each way, at every boundary. Under
    # autocast x comes out in the autocast dtype, as the reference's mix_streams einsum gives it,
    # so the norm after it casts nothing either.
    x_dtype = _x_dtype(h)
    if y.dtype == torch.float64:
        y = y.to(h.dtype)
    # casts and reshapes stay outside the Function, so autograd casts the gradients back
    h_new, x, mix = _FusedMHCStep.apply(
        h.reshape(T, N, D).contiguous(), y.reshape(T, D).contiguous(),
        post.float().reshape(T, N).contiguous(), comb.float().reshape(T, N, N).contiguous(),
        pre.float().reshape(T, N).contiguous(), fn.float().contiguous(), float(norm_eps),
        config or MHCKernelConfig(), x_dtype)
    return h_new.view(*lead, N, D), x.view(*lead, D), mix.view(*lead, M)


@torch.compiler.disable
def fused_mhc_mix(h: torch.Tensor, pre: torch.Tensor, fn: torch.Tensor, norm_eps: float,
                  config: Optional[MHCKernelConfig] = None):
    """A boundary with no residual update before it (the first sub-layer, the one after an
    Engram): h [..., n, D], pre [..., n], fn [2n+n*n, n*D] -> (x [..., D], mix [..., 2n+n*n] fp32)
    in one read of h, the forward kernel with its update left out. Same values as
    `reference_mhc_mix`, x in the dtype `fused_mhc_step` gives it; differentiable in h, pre, fn."""
    if h.dtype == torch.float64:
        return reference_mhc_mix(h, pre, fn, norm_eps)
    *lead, N, D = h.shape
    M = fn.shape[0]
    if fn.shape[1] != N * D or pre.shape != (*lead, N):
        raise ValueError(f"shape mismatch: h {tuple(h.shape)}, pre {tuple(pre.shape)}, fn {tuple(fn.shape)}")
    T = math.prod(lead)
    x_dtype = _x_dtype(h)
    x, mix = _FusedMHCMix.apply(h.reshape(T, N, D).contiguous(), pre.float().reshape(T, N).contiguous(),
                                fn.float().contiguous(), float(norm_eps), config or MHCKernelConfig(),
                                x_dtype)
    return x.view(*lead, D), mix.view(*lead, M)


def reference_mhc_mix(h, pre, fn, norm_eps):
    """What `fused_mhc_mix` replaces: mix_streams, and a HyperConnection's RMS norm + linear
    (its forward up to `mix`) in fp32 (fp64 for fp64 streams)."""
    flat = h.flatten(-2)
    flat = flat.double() if flat.dtype == torch.float64 else flat.float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    return mix_streams(pre, h), F.linear(flat, fn.to(flat.dtype))


def reference_mhc_step(h, y, post, comb, pre, fn, norm_eps):
    """The unfused composition the kernel replaces: update_streams, then `reference_mhc_mix`
    of the updated streams (the next HyperConnection's logits and the next sub-layer's input)."""
    h_new = update_streams(h, y, post, comb)
    return (h_new, *reference_mhc_mix(h_new, pre, fn, norm_eps))


def hc_coefficients(hc: HyperConnection, mix: torch.Tensor):
    """The rest of `HyperConnection.forward` on fused logits: mix [..., 2n+n*n] ->
    post [..., n], comb [..., n, n], next_pre [..., n] (the same tensors as hc(h_new))."""
    return hc.coefficients(mix)


def fused_forward_bytes_per_token(n: int, dim: int, elem_bytes: int = 2, splits: int = 1) -> dict:
    """HBM bytes a token costs the fused forward with bf16 streams (the kernel and its host-
    side reductions), next to the ideal (2n + 2) * D * elem_bytes. Not counted: the logit
    weight (read from L2 once per token tile) and the coefficients' re-reads per D block."""
    m = 2 * n + n * n
    streams = (2 * n + 2) * dim * elem_bytes
    coeffs = 4 * (n + n * n + n)  # post, comb, pre (fp32)
    partials = 2 * 4 * splits * (2 * m + 1)  # hi/lo logit and sum-of-squares partials: written, read
    epilogue = 2 * 4 * (2 * m + 1)  # their sums written and read again to form r and mix
    output = 4 * (m + 1)  # mix and r (saved for the backward)
    return {"ideal": streams, "fused": streams + coeffs + partials + epilogue + output}
