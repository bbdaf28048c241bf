"""CSA2 attention layer (docs/ARCHITECTURE.md §3, §4, §11).

Per layer: low-rank queries over one shared 512-d latent (MQA, K = V, RoPE on the last
64 dims), a 128-token sliding window with its own KV, and - except on SWA-only layers -
sparse attention over k entries of a compressed global KV chosen by the lightning indexer.
Window and global entries share one softmax with a per-head sink logit. The output is a
grouped low-rank projection.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from conf.model import ModelConfig
from model.csa import ATTENTION_IMPLS, dense_attention
from model.indexer import IndexKey, IndexQuery, candidate_pool, index_scores, index_scores_at, select_topk
from model.numerics import RMSNorm, wide
from model.plan import LayerSpec
from model.quant import fake_quant_fp8, fake_quant_kv_fp4
from model.rope import Rotary
from model.runtime import AttentionRuntime

NEG_INF = float("-inf")


class Compressor(nn.Module):
    """Global KV of an owner layer: m tokens -> one normalised latent entry.
    m = 1: norm(wkv(x)); m > 1: per block, sum_i wkv(x_i) * softmax_i(wgate(x_i)), then norm."""

    def __init__(self, dim: int, kv_dim: int, ratio: int, eps: float):
        super().__init__()
        self.ratio = ratio
        self.wkv = nn.Linear(dim, kv_dim, bias=False)
        self.wgate = nn.Linear(dim, kv_dim, bias=False) if ratio > 1 else None
        self.norm = RMSNorm(kv_dim, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [B, T, D] -> [B, T // m, C]; a trailing partial block is not an entry yet
        m = self.ratio
        if m == 1:
            return self.norm(self.wkv(x))
        # the pooled path in fp32, projections included, as the public model computes it: its
        # softmax over the m tokens weighs logits that bf16 would round
        B, T, _ = x.shape
        S, C = T // m, self.wkv.weight.shape[0]
        xs = wide(x[:, :S * m])
        with torch.autocast(x.device.type, enabled=False):
            kv = F.linear(xs, wide(self.wkv.weight)).view(B, S, m, C)
            gate = F.linear(xs, wide(self.wgate.weight)).view(B, S, m, C).softmax(dim=2)
        return self.norm((kv * gate).sum(2).to(x.dtype))


class CSA2Attention(nn.Module):
    # the ops besides `attend` (the attention implementation, picked by model.attn_impl); model.ops.
    # KernelPolicy may swap in the Triton kernels: index scores at candidates, index scores over
    # every entry with the visibility mask applied as it scores (None: score, then mask), top-k
    scores_at = staticmethod(index_scores_at)
    scores_masked = None
    select = staticmethod(select_topk)
    # True when `attend` takes q unrotated with its angles and returns out rotated back (the
    # kernel folds RoPE into the attention call)
    attend_rotates = False

    def __init__(self, cfg: ModelConfig, spec: LayerSpec):
        super().__init__()
        self.spec = spec
        self.n_heads, self.kv_dim, self.window = cfg.n_heads, cfg.kv_dim, cfg.window
        self.index_topk, self.pool_block, self.pool_blocks = cfg.index_topk, cfg.pool_block, cfg.pool_blocks
        self.indexer_loss_coef = cfg.indexer_loss_coef
        self.qat = cfg.kv_quant == "qat"
        self.attend = _head_summed(ATTENTION_IMPLS[cfg.attn_impl])
        self.scale = cfg.kv_dim ** -0.5
        if cfg.n_heads % cfg.o_groups:
            raise ValueError(f"n_heads={cfg.n_heads} not divisible by o_groups={cfg.o_groups}")

        if spec.mode == "swa":  # window only: plain RoPE at rope_theta, never YaRN
            self.rotary = Rotary(cfg.rope_dim, cfg.rope_theta)
        else:  # YaRN whenever original_seq_len > 0 (0 turns it off), as DeepSeek's inference code
            self.rotary = Rotary(cfg.rope_dim, cfg.rope_theta_compressed, cfg.rope_factor,
                                 cfg.original_seq_len, cfg.beta_fast, cfg.beta_slow)
        self.wq_a = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, eps=cfg.norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, cfg.n_heads * cfg.kv_dim, bias=False)
        self.wkv = nn.Linear(cfg.dim, cfg.kv_dim, bias=False)  # window KV
        self.kv_norm = RMSNorm(cfg.kv_dim, eps=cfg.norm_eps)
        self.sink = nn.Parameter(torch.zeros(cfg.n_heads, dtype=torch.float32))
        group_in = cfg.n_heads // cfg.o_groups * cfg.kv_dim
        self.wo_a = nn.Parameter(torch.empty(cfg.o_groups, cfg.o_lora_rank, group_in))
        self.wo_b = nn.Linear(cfg.o_groups * cfg.o_lora_rank, cfg.dim, bias=False)

        self.compressor = self.index_key = self.index_query = None
        if spec.owns_kv:
            self.compressor = Compressor(cfg.dim, cfg.kv_dim, spec.compress_ratio, cfg.norm_eps)
            self.index_key = IndexKey(cfg.kv_dim, cfg.index_dim, cfg.norm_eps)
        if spec.has_indexer_query:
            self.index_query = IndexQuery(cfg.dim, cfg.q_lora_rank, cfg.index_heads, cfg.index_dim)

    def forward(self, x: torch.Tensor, rt: AttentionRuntime) -> torch.Tensor:
        """x [B, T, D] (normed sub-layer input) -> [B, T, D]."""
        angles = self.rotary.angles(rt.positions)  # [B, T, R/2]
        qr = self.q_norm(self.wq_a(x))  # [B, T, Rq]
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.kv_dim))  # [B, T, H, C], RoPE not applied yet
        win = self.rotary(self.kv_norm(self.wkv(x)), angles)  # [B, T, C]
        if self.qat:
            win = fake_quant_fp8(win)
        glob = iq = iw = None
        if self.spec.mode != "swa":
            if self.spec.owns_kv:
                self.write_global_kv(x, rt)
            glob = rt.kv[self.spec.kv_source]
            if self.index_query is not None:  # the indexer learns only from its own loss: inputs detached
                iq, iw = self.index_query(qr.detach(), x.detach(), angles, self.rotary, self.qat)
        halo = rt.shard.halo(win, self.window - 1, self.spec.layer_id)  # window rows before the slice
        out = self.attend_queries(q, angles, win, halo, glob, iq, iw, rt)  # [B, T, H, C]
        grouped = out.flatten(2).unflatten(-1, (self.wo_a.shape[0], -1))  # [B, T, G, H/G*C]
        return self.wo_b(grouped_projection(grouped, self.wo_a).flatten(2))

    def attend_queries(self, q, angles, win, halo, glob, iq, iw, rt: AttentionRuntime) -> torch.Tensor:
        """Every query at once: q [B, T, H, C] before RoPE, angles [B, T, R/2] -> out [B, T, H, C]
        with the values' RoPE taken back out. Publishes the layer's top-k, pool, indexer loss and
        recall to rt. (model/chunking.py runs the same function over chunks of queries.)"""
        rows = slice(None)
        # an `attend` that rotates takes q unrotated and rotates q in place and out back on their
        # 64 RoPE dims, where two rotaries would copy all of q and out each way
        fold = self.attend_rotates
        if not fold:
            q = self.rotary(q, angles.unsqueeze(-2))
        idx, pool = self.select_rows(iq, iw, glob, rt, rows)
        out, kl = self.attend_rows(q, win, halo, iq, iw, glob, idx, rt, rows, angles if fold else None)
        recall = self.recall_rows(q, win, halo, glob, iq, idx, pool, rt, rows)  # q is rotated by now
        self.publish(rt, [idx], [pool], kl, [recall])
        return out if fold else self.rotary(out, angles.unsqueeze(-2), inverse=True)

    def publish(self, rt: AttentionRuntime, topk: list, pools: list, loss, recalls: list) -> None:
        """Hand rt what this layer computed for its queries, each list in query order: the top-k ids
        and candidate pools (for the layers that reuse them), the indexer loss (None: not wanted),
        the recall sums (None entries: not collected)."""
        if self.index_query is not None and topk[0] is not None:  # Reuse layers publish no top-k
            rt.topk[self.spec.layer_id] = _cat_rows(topk)
            if pools[0] is not None:
                rt.pool[self.spec.layer_id] = _cat_rows(pools)
        if loss is not None:
            rt.indexer_losses.append(self.indexer_loss_coef * loss)
        if recalls[0] is not None:
            got = torch.stack(recalls).sum(0)  # [topk mass share sum, pool share sum, queries]
            rt.recall["topk"].append(got[0] / got[2])
            if self.spec.builds_pool or self.spec.mode == "reindex":
                rt.recall["pool"].append(got[1] / got[2])

    def attend_rows(self, q, win, halo, iq, iw, glob, idx, rt: AttentionRuntime, rows: slice,
                    q_angles: torch.Tensor | None = None):
        """Attention of the queries in `rows` and their indexer loss (None when not wanted).
        q_angles (only for an `attend` that rotates): q comes unrotated and out goes back rotated
        by the inverse (the RoPE folded into the kernel call, `sparse_attention_triton`)."""
        attend_idx = idx
        if glob is not None and rt.indexer_mode == "dense":
            attend_idx = rt.all_visible(self.spec.compress_ratio, rows)  # [B, Tc, S]: column j is entry j
        with_kl = iq is not None and rt.with_indexer_loss  # Reuse layers have no indexer of their own
        # p_sel [B, Tc, k] head-summed, only for the indexer loss: with it the kernel's forward
        # writes and re-reads every selected logit ([B, Tc, H, k] fp32)
        fold = {} if q_angles is None else {"q_angles": q_angles}
        out, p_sel = self.attend(q, win, glob, attend_idx, rt.doc_start[:, rows], self.sink, self.scale,
                                 self.window, rt.positions[:, rows], halo, want_probs=with_kl, **fold)
        kl = None
        if with_kl:
            keys = rt.index_k[self.spec.kv_source]
            if rt.indexer_mode == "sparse":  # KL on the selected set
                kl = indexer_kl(p_sel, idx, iq, iw, keys, self.scores_at)
            else:  # dense warm-up: KL towards the dense attention over everything the indexer scores
                cand = attend_idx if self.spec.mode == "full" else self._source_pool(rt, rows)
                kl = indexer_kl(_probs_at(p_sel, cand), cand, iq, iw, keys, self.scores_at)
        return out, kl

    @torch.no_grad()
    def recall_rows(self, q, win, halo, glob, iq, idx, pool, rt: AttentionRuntime, rows: slice):
        """Share of the dense global attention mass (summed over heads) that the top-k idx, and the
        candidate pool where this layer builds or reads one, hold, summed over the queries in
        `rows` that see any entry -> [topk share sum, pool share sum, number of such queries];
        None unless rt collects recall on a layer with its own indexer (iq). q is rotated."""
        if iq is None or not rt.collect_recall:
            return None
        if not (self.spec.builds_pool or self.spec.mode == "reindex"):
            pool = None
        elif pool is None:  # a pool that keeps every block is not built, or a Reindex layer's source
            pool = self._source_pool(rt, rows)
        all_ids = rt.all_visible(self.spec.compress_ratio, rows)
        _, p_all = dense_attention(q, win, glob, all_ids, rt.doc_start[:, rows], self.sink, self.scale,
                                   self.window, rt.positions[:, rows], halo)
        mass = p_all.sum(2)  # [B, Tc, S] over entry ids
        total = mass.sum(-1)
        seen = total > 0

        def share(ids: torch.Tensor) -> torch.Tensor:
            got = mass.gather(-1, ids.clamp(min=0)).masked_fill(ids < 0, 0.0).sum(-1)
            return (got[seen] / total[seen]).sum()

        pool_share = share(pool) if pool is not None else total.new_zeros(())
        return torch.stack((share(idx), pool_share, seen.sum().to(total.dtype)))

    def write_global_kv(self, x: torch.Tensor, rt: AttentionRuntime) -> None:
        """Full layers only: compressed latent (RoPE at j*m, FP4 QAT) and MXFP4 index keys."""
        m = self.spec.compress_ratio
        x, first = rt.shard.block_input(x, self.spec.layer_id, m)  # first: global id of the first entry
        latent = self.compressor(x)  # [B, S_local, C] entries this slice completes
        B, S, _ = latent.shape
        entry_pos = ((first + torch.arange(S, device=x.device)) * m).expand(B, S)
        entry_angles = self.rotary.angles(entry_pos)  # [B, S, R/2]
        # Index keys come from the latent before its RoPE and FP4 rounding (IndexKey rotates its own
        # output), as in DeepSeek's inference code. The indexer learns only from its own loss:
        # its input is detached.
        index_k = self.index_key(latent.detach(), entry_angles, self.rotary, self.qat)
        latent = self.rotary(latent, entry_angles)
        if self.qat:
            latent = fake_quant_kv_fp4(latent)
        rt.kv[self.spec.layer_id] = rt.shard.gather(latent, self.spec.layer_id, "kv")  # [B, S_total, C]
        rt.index_k[self.spec.layer_id] = rt.shard.gather(index_k, self.spec.layer_id, "index_k")

    @torch.no_grad()
    def select_rows(self, iq, iw, glob, rt: AttentionRuntime, rows: slice):
        """Top-k ids [B, Tc, k] of the queries in `rows`, and the candidate pool [B, Tc, P] when this
        layer builds one (else None); (None, None) without global KV (SWA layers). Full: score every
        visible entry; Reindex: score only inside the source's pool; Reuse: the source's top-k."""
        spec, m = self.spec, self.spec.compress_ratio
        if glob is None:
            return None, None
        if iq is None:
            return rt.topk[spec.index_source][:, rows], None
        keys = rt.index_k[spec.kv_source]
        iq, iw = iq[:, rows], iw[:, rows]
        if spec.mode == "full":
            scores = self._visible_scores(iq, iw, keys, rt, rows)
            idx = self.select(scores, self.index_topk)
            pool = None
            # else Reindex scores densely
            if spec.builds_pool and not self.pool_is_every_entry(keys.shape[1]):
                pool = candidate_pool(scores, rt.newest_visible(m, rows), self.pool_block, self.pool_blocks)
            return idx, pool
        if self.pool_is_every_entry(keys.shape[1]):  # reindex over the pool = over every visible entry
            return self.select(self._visible_scores(iq, iw, keys, rt, rows), self.index_topk), None
        cand = rt.pool[spec.kv_source][:, rows]  # reindex
        return self.select(self.scores_at(iq, iw, keys, cand), self.index_topk, positions=cand), None

    def _visible_scores(self, iq, iw, keys, rt: AttentionRuntime, rows: slice) -> torch.Tensor:
        """Index scores [B, Tc, S] of every entry, -inf where the query cannot see it."""
        m = self.spec.compress_ratio
        if self.scores_masked is not None:  # the kernel applies visibility as it scores
            return self.scores_masked(iq, iw, keys, rt.positions[:, rows], rt.doc_start[:, rows], m)
        return index_scores(iq, iw, keys).masked_fill(~rt.visible(m, rows), NEG_INF)

    def pool_is_every_entry(self, n_entries: int) -> bool:
        """The pool keeps every block when there are at most pool_blocks of them (short contexts:
        `small` at 4K has 512 blocks of 8 for 4096 entries). It then holds exactly the visible
        entries in position order, so dense scoring selects the same ids as gathering the pool's
        keys, and the dense matmul reuses each key across a tile of queries where the gather
        loads it once per query."""
        return n_entries <= self.pool_blocks * self.pool_block

    def _source_pool(self, rt: AttentionRuntime, rows: slice) -> torch.Tensor:
        """The pool of this layer's KV source for the queries in `rows`: [B, Tc, P] entry ids, -1
        = empty; every visible entry ([B, Tc, S]) when the pool keeps every block (none is built)."""
        if self.pool_is_every_entry(rt.index_k[self.spec.kv_source].shape[1]):
            return rt.all_visible(self.spec.compress_ratio, rows)
        return rt.pool[self.spec.kv_source][:, rows]


class _GroupedProjection(torch.autograd.Function):
    """y[..., g, :] = x[..., g, :] @ w[g]^T as strided batched matmuls: x [N, G, I] is read in place
    (batch stride I, row stride G*I) and dx is written in x's layout. einsum's version is the same
    bmm, but its dx comes out [G, N, I] and the caller (the inverse rotary's kernel) copied it into
    [N, G, I]: 537 MB a layer at `small`'s micro-batch 8."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        y = x.new_empty(x.shape[0], w.shape[0], w.shape[1])  # [N, G, O]
        torch.bmm(x.transpose(0, 1), w.transpose(1, 2), out=y.transpose(0, 1))
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dy_g = dy.transpose(0, 1)  # [G, N, O]
        dx = torch.empty_like(x)
        torch.bmm(dy_g, w, out=dx.transpose(0, 1))
        dw = torch.bmm(dy_g.transpose(1, 2), x.transpose(0, 1))  # [G, O, I]
        return dx, dw


def grouped_projection(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., G, I], w [G, O, I] -> [..., G, O] = einsum("...gi,goi->...go") in x's dtype (the
    grouped low-rank output projection; under autocast w is cast as a matmul's weight would be)."""
    if torch.compiler.is_compiling():  # inductor picks its own layouts
        return torch.einsum("...gi,goi->...go", x, w)
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, w = x.to(dtype), w.to(dtype)
    elif w.dtype != x.dtype:
        raise TypeError(f"grouped_projection: x is {x.dtype}, w is {w.dtype}")
    lead = x.shape[:-2]
    y = _GroupedProjection.apply(x.reshape(-1, *x.shape[-2:]).contiguous(), w.contiguous())
    return y.view(*lead, *y.shape[-2:])


def _cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """Per-chunk [B, Tc, ...] tensors in query order -> [B, T, ...] (no copy for one chunk)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _head_summed(impl):
    """A reference attention whose selected-entry probabilities come summed over heads
    [B, T, k], as the Triton kernel returns them (all the indexer loss needs)."""
    def attend(*args, want_probs: bool = True):
        out, p_glob = impl(*args)
        return out, None if p_glob is None or not want_probs else p_glob.sum(2)
    return attend


def _probs_at(p_sel: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """p_sel [B, T, S] (column j = entry j), ids [B, T, P] -> [B, T, P], 0 at -1."""
    return p_sel.gather(-1, ids.clamp(min=0)).masked_fill(ids < 0, 0.0)


def indexer_kl(p_sel: torch.Tensor, idx: torch.Tensor, iq: torch.Tensor, iw: torch.Tensor,
               keys: torch.Tensor, scores_at=index_scores_at) -> torch.Tensor:
    """KL(attention || indexer) on the selected set: the target is the attention mass on the
    selected entries, summed over heads and L1-normalised (DeepSeek-V3.2's sparse stage).
    p_sel [B, T, k] head-summed attention probabilities at idx [B, T, k]. Averaged over all B*T
    queries (those without a selected entry add 0), so the loss is additive over sequences and a
    batch split across data-parallel ranks sees the same total. `scores_at`: the indexer scoring
    at candidates (reference or kernel)."""
    target = p_sel.detach()  # [B, T, k]
    mass = target.sum(-1, keepdim=True)
    rows = mass > 0  # [B, T, 1] queries that attended to at least one selected entry
    # masked, not indexed by `rows`: no host sync (boolean indexing and `if rows.any()` each wait
    # for the GPU), and the loss stays connected to the indexer's inputs even when no query
    # attends to a selected entry, so every context-parallel rank runs the same backward collectives
    target = torch.where(rows, target / torch.where(rows, mass, 1.0), 0.0)
    scores = scores_at(iq, iw, keys, idx).masked_fill(~rows, 0.0)  # -inf only at -1 ids of kept rows
    log_q = F.log_softmax(scores, dim=-1)
    kl = torch.where(target > 0, target * (target.clamp(min=1e-30).log() - log_q), 0.0)
    return kl.sum() / rows.numel()
