"""CSA2 attention layer (SPEC §3, §4, §11).

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
from model.numerics import wide
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
        self.norm = nn.RMSNorm(kv_dim, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [B, T, D] -> [B, T // m, C]; a trailing partial block is not an entry yet
        m = self.ratio
        kv = self.wkv(x)
        if m > 1:
            B, T, C = kv.shape
            S = T // m
            kv = kv[:, :S * m].view(B, S, m, C)
            gate = wide(self.wgate(x[:, :S * m]).view(B, S, m, C)).softmax(dim=2)
            kv = (wide(kv) * gate).sum(2).to(x.dtype)
        return self.norm(kv)


class CSA2Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec):
        super().__init__()
        self.spec = spec
        self.n_heads, self.kv_dim, self.window = cfg.n_heads, cfg.kv_dim, cfg.window
        self.index_topk, self.pool_block, self.pool_blocks = cfg.index_topk, cfg.pool_block, cfg.pool_blocks
        self.indexer_loss_coef = cfg.indexer_loss_coef
        self.qat = cfg.kv_quant == "qat"
        self.attend = ATTENTION_IMPLS[cfg.attn_impl]
        self.scale = cfg.kv_dim ** -0.5
        if cfg.n_heads % cfg.o_groups:
            raise ValueError(f"n_heads={cfg.n_heads} not divisible by o_groups={cfg.o_groups}")

        if spec.mode == "swa":
            self.rotary = Rotary(cfg.rope_dim, cfg.rope_theta)
        else:
            yarn = cfg.max_seq_len > cfg.original_seq_len
            self.rotary = Rotary(cfg.rope_dim, cfg.rope_theta_compressed,
                                 cfg.rope_factor if yarn else 1.0, cfg.original_seq_len,
                                 cfg.beta_fast, cfg.beta_slow)
        self.wq_a = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
        self.q_norm = nn.RMSNorm(cfg.q_lora_rank, eps=cfg.norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, cfg.n_heads * cfg.kv_dim, bias=False)
        self.wkv = nn.Linear(cfg.dim, cfg.kv_dim, bias=False)  # window KV
        self.kv_norm = nn.RMSNorm(cfg.kv_dim, eps=cfg.norm_eps)
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
        B, T, _ = x.shape
        angles = self.rotary.angles(rt.positions)  # [B, T, R/2]
        qr = self.q_norm(self.wq_a(x))  # [B, T, Rq]
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.kv_dim))  # [B, T, H, C]
        q = self.rotary(q, angles.unsqueeze(-2))
        win = self.rotary(self.kv_norm(self.wkv(x)), angles)  # [B, T, C]
        if self.qat:
            win = fake_quant_fp8(win)

        glob = idx = indexer = None
        if self.spec.mode != "swa":
            if self.spec.owns_kv:
                self._write_global_kv(x, rt)
            glob = rt.kv[self.spec.kv_source]
            if self.index_query is not None:
                idx, indexer = self._select(qr, x, rt)
            else:
                idx = rt.topk[self.spec.index_source]

        attend_idx = idx
        if glob is not None and rt.indexer_mode == "dense":
            attend_idx = rt.all_visible(self.spec.compress_ratio)  # [B, T, S]: column j is entry j
        out, p_glob = self.attend(q, win, glob, attend_idx, rt.doc_start, self.sink, self.scale, self.window)
        if indexer is not None and rt.with_indexer_loss:
            rt.indexer_losses.append(self.indexer_loss_coef * self._indexer_loss(p_glob, attend_idx, idx, indexer, rt))
        if indexer is not None and rt.collect_recall:
            self._record_recall(q, win, glob, p_glob, idx, rt)
        out = self.rotary(out, angles.unsqueeze(-2), inverse=True)  # values carried RoPE
        grouped = out.flatten(2).unflatten(-1, (self.wo_a.shape[0], -1))  # [B, T, G, H/G*C]
        low = torch.einsum("btgi,goi->btgo", grouped, self.wo_a)  # [B, T, G, Ro]
        return self.wo_b(low.flatten(2))

    def _candidates(self, rt: AttentionRuntime, attend_idx: torch.Tensor) -> torch.Tensor:
        """What this layer's indexer scores: every visible entry (Full) or the pool (Reindex)."""
        return attend_idx if self.spec.mode == "full" else rt.pool[self.spec.kv_source]

    def _indexer_loss(self, p_glob, attend_idx, idx, indexer, rt: AttentionRuntime) -> torch.Tensor:
        """Sparse stage: KL on the selected set. Dense warm-up: KL towards the dense attention
        over everything the indexer scores."""
        if rt.indexer_mode == "sparse":
            return indexer_kl(p_glob, idx, *indexer)
        cand = self._candidates(rt, attend_idx)  # [B, T, P]
        p_cand = _probs_at(p_glob, cand)  # attend_idx lists entry j in column j
        return indexer_kl(p_cand, cand, *indexer)

    @torch.no_grad()
    def _record_recall(self, q, win, glob, p_glob, idx, rt: AttentionRuntime) -> None:
        """Share of the dense global attention mass (summed over heads) that the top-k, and the
        pool where there is one, hold; averaged over queries that see any entry."""
        all_ids = rt.all_visible(self.spec.compress_ratio)
        if rt.indexer_mode == "dense":
            p_all = p_glob
        else:
            _, p_all = dense_attention(q, win, glob, all_ids, rt.doc_start, self.sink, self.scale, self.window)
        mass = p_all.sum(2)  # [B, T, S] over entry ids
        total = mass.sum(-1)
        rows = total > 0

        def share(ids: torch.Tensor) -> torch.Tensor:
            got = mass.gather(-1, ids.clamp(min=0)).masked_fill(ids < 0, 0.0).sum(-1)
            return (got[rows] / total[rows]).mean()

        rt.recall["topk"].append(share(idx))
        pool = rt.pool.get(self.spec.layer_id, rt.pool.get(self.spec.kv_source)) if rt.pool else None
        if pool is not None:
            rt.recall["pool"].append(share(pool))

    def _write_global_kv(self, x: torch.Tensor, rt: AttentionRuntime) -> None:
        """Full layers only: compressed latent (RoPE at j*m, FP4 QAT) and MXFP4 index keys."""
        latent = self.compressor(x)  # [B, S, C]
        B, S, _ = latent.shape
        entry_pos = (torch.arange(S, device=x.device) * self.spec.compress_ratio).expand(B, S)
        entry_angles = self.rotary.angles(entry_pos)  # [B, S, R/2]
        latent = self.rotary(latent, entry_angles)
        if self.qat:
            latent = fake_quant_kv_fp4(latent)
        rt.kv[self.spec.layer_id] = latent
        # the indexer learns only from its own loss: its inputs are detached
        rt.index_k[self.spec.layer_id] = self.index_key(latent.detach(), entry_angles, self.rotary, self.qat)

    def _select(self, qr: torch.Tensor, x: torch.Tensor, rt: AttentionRuntime):
        """Full: score every visible entry; Reindex: score only inside the source's pool.
        Returns the top-k ids [B, T, k] and (index queries, head weights, index keys)."""
        spec, m = self.spec, self.spec.compress_ratio
        angles = self.rotary.angles(rt.positions)
        iq, iw = self.index_query(qr.detach(), x.detach(), angles, self.rotary, self.qat)
        keys = rt.index_k[spec.kv_source]
        with torch.no_grad():
            if spec.mode == "full":
                scores = index_scores(iq, iw, keys).masked_fill(~rt.visible(m), NEG_INF)
                idx = select_topk(scores, self.index_topk)
                if spec.builds_pool:
                    rt.pool[spec.layer_id] = candidate_pool(scores, rt.newest_visible(m),
                                                            self.pool_block, self.pool_blocks)
            else:  # reindex
                cand = rt.pool[spec.kv_source]
                idx = select_topk(index_scores_at(iq, iw, keys, cand), self.index_topk, positions=cand)
        rt.topk[spec.layer_id] = idx
        return idx, (iq, iw, keys)


def _probs_at(p_glob: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """p_glob [B, T, H, S] (column j = entry j), ids [B, T, P] -> [B, T, H, P], 0 at -1."""
    H = p_glob.shape[2]
    picked = p_glob.gather(-1, ids.clamp(min=0).unsqueeze(2).expand(-1, -1, H, -1))
    return picked.masked_fill((ids < 0).unsqueeze(2), 0.0)


def indexer_kl(p_glob: torch.Tensor, idx: torch.Tensor, iq: torch.Tensor, iw: torch.Tensor,
               keys: torch.Tensor) -> torch.Tensor:
    """KL(attention || indexer) on the selected set: the target is the attention mass on the
    selected entries, summed over heads and L1-normalised (DeepSeek-V3.2's sparse stage).
    p_glob [B, T, H, k] attention probabilities at idx [B, T, k]. Averaged over all B*T queries
    (those without a selected entry add 0), so the loss is additive over sequences and a batch
    split across data-parallel ranks sees the same total."""
    target = p_glob.detach().sum(2)  # [B, T, k]
    mass = target.sum(-1)
    rows = mass > 0  # queries that attended to at least one selected entry
    if not bool(rows.any()):
        return target.new_zeros(())
    target = target[rows] / mass[rows].unsqueeze(-1)
    log_q = F.log_softmax(index_scores_at(iq, iw, keys, idx)[rows], dim=-1)
    kl = torch.where(target > 0, target * (target.clamp(min=1e-30).log() - log_q), 0.0)
    return kl.sum() / rows.numel()
