"""Lightning indexer, top-k selection and the hierarchical candidate pool (docs/ARCHITECTURE.md §3, §11).

score(t, s) = sum_h w_h(t) * relu(q_h(t) . k(s))
Index keys are projected from the layer's compressed KV latent (before its RoPE and FP4
rounding), not from the hidden state.
Queries come from the attention's low-rank q (`qr`), head weights from the hidden state.
"""
from __future__ import annotations

import torch
from torch import nn

from model.numerics import RMSNorm, gather_rows, wide
from model.quant import fake_quant_mxfp4
from model.rope import Rotary

NEG_INF = float("-inf")


class IndexKey(nn.Module):
    """On KV-owner layers: index_k = k_norm(wk(latent)), RoPE on the trailing dims, MXFP4.
    `latent` is the compressor's output before RoPE and FP4 rounding."""

    def __init__(self, kv_dim: int, index_dim: int, eps: float):
        super().__init__()
        self.wk = nn.Linear(kv_dim, index_dim, bias=False)
        self.k_norm = RMSNorm(index_dim, eps=eps)

    def forward(self, latent: torch.Tensor, angles: torch.Tensor, rotary: Rotary, qat: bool) -> torch.Tensor:
        # latent [B, S, C] (pre-RoPE), angles [B, S, R/2] at the entries' positions -> [B, S, Di]
        k = rotary(self.k_norm(self.wk(latent)), angles)
        return fake_quant_mxfp4(k) if qat else k


class IndexQuery(nn.Module):
    """On Full and Reindex layers: per-head queries and per-head weights."""

    def __init__(self, dim: int, q_lora_rank: int, n_heads: int, head_dim: int):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, head_dim
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.weights_proj = nn.Linear(dim, n_heads, bias=False)
        self.weight_scale = head_dim ** -0.5 * n_heads ** -0.5

    def forward(self, qr: torch.Tensor, x: torch.Tensor, angles: torch.Tensor, rotary: Rotary,
                qat: bool) -> tuple[torch.Tensor, torch.Tensor]:
        # qr [B, T, Rq], x [B, T, D] -> q [B, T, Hi, Di], w [B, T, Hi]
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        q = rotary(q, angles.unsqueeze(-2))
        if qat:
            q = fake_quant_mxfp4(q)
        return q, wide(self.weights_proj(x)) * self.weight_scale


# elements of the [B, t, H, S] per-head logits that index_scores materialises at a time
SCORE_BLOCK_ELEMENTS = 2**28


def index_scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Against every entry: q [B, T, H, Di], w [B, T, H], k [B, S, Di] -> [B, T, S] fp32.
    Runs over blocks of queries, so the per-head logits stay within SCORE_BLOCK_ELEMENTS
    whatever the context length (only the [B, T, S] result grows with it)."""
    B, T, H, _ = q.shape
    step = max(1, SCORE_BLOCK_ELEMENTS // max(1, B * H * k.shape[1]))
    kw = wide(k)
    out = []
    for lo in range(0, T, step):
        logits = torch.einsum("bthd,bsd->bths", wide(q[:, lo:lo + step]), kw).relu_()
        out.append(torch.einsum("bths,bth->bts", logits, w[:, lo:lo + step]))
    return out[0] if len(out) == 1 else torch.cat(out, dim=1)


def index_scores_at(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """Only at candidate entries cand [B, T, P] (-1 = none): gathers P keys per query, so the
    cost follows the pool size, not the context length -> [B, T, P] fp32 (-inf at -1). Runs over
    blocks of queries, so the gathered keys stay within SCORE_BLOCK_ELEMENTS."""
    B, T, P = cand.shape
    step = max(1, SCORE_BLOCK_ELEMENTS // (B * P * k.shape[-1]))
    out = []
    for lo in range(0, T, step):
        keys = gather_rows(k, cand[:, lo:lo + step].clamp(min=0))  # [B, t, P, Di]
        logits = torch.einsum("bthd,btpd->btph", wide(q[:, lo:lo + step]), wide(keys)).relu()
        out.append(torch.einsum("btph,bth->btp", logits, w[:, lo:lo + step]))
    scores = out[0] if len(out) == 1 else torch.cat(out, dim=1)
    return scores.masked_fill(cand < 0, NEG_INF)


# Eager under trainer.compile: torch 2.11's inductor fuses the tie cumsum and the `where` below
# into one kernel that stores the cumsum, then reads it back in a second loop with no barrier
# between them; on the H200 some rows read stale values and lose takes (ids = S, out of range).
# A tl.debug_barrier() between the loops makes the same generated kernel exact.
@torch.compiler.disable
def topk_ids(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of scores [..., S] (k <= S) -> (column ids [..., k] ascending, their scores).
    Ties at the k-th value go to the lowest columns. torch.topk leaves ties unspecified, and its
    choice changes with S, so the same query could select differently in a training forward
    (S = every entry of the sequence) and in decoding (S = the entries so far). ReLU index
    scores tie often (exact zeros), so this matters."""
    S = scores.shape[-1]
    kth = torch.topk(scores, k, dim=-1).values[..., -1:]  # [..., 1]
    above, tied = scores > kth, scores == kth
    take = above | (tied & (tied.cumsum(-1) <= k - above.sum(-1, keepdim=True)))  # exactly k per row
    cols = torch.arange(S, device=scores.device)
    ids = S - torch.topk(torch.where(take, S - cols, 0), k, dim=-1).values  # distinct keys: ascending ids
    # a row with a NaN score takes too few (NaN compares false): its spare ids (S) move onto the last
    # column, so a diverged model's forward reaches its NaN loss instead of an out-of-range gather
    ids = ids.clamp_(max=S - 1)
    return ids, scores.gather(-1, ids)


def select_topk(scores: torch.Tensor, k: int, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Top-k entries of scores [B, T, S] (-inf = invisible), sorted by position, -1 padded to
    exactly k columns. `positions` [B, T, S] maps columns to entry ids (default: column index)."""
    B, T, S = scores.shape
    kk = min(k, S)
    cols, values = topk_ids(scores, kk)
    ids = cols if positions is None else positions.gather(-1, cols)
    ids = ids.masked_fill(values == NEG_INF, -1)
    ids = _sort_padded(ids)
    if kk < k:
        ids = torch.cat((ids, ids.new_full((B, T, k - kk), -1)), dim=-1)
    return ids


def _sort_padded(ids: torch.Tensor) -> torch.Tensor:
    """Sort ids ascending along the last dim with the -1 slots moved to the end."""
    big = torch.iinfo(ids.dtype).max
    ids = torch.sort(ids.masked_fill(ids < 0, big), dim=-1).values
    return ids.masked_fill(ids == big, -1)


def candidate_pool(scores: torch.Tensor, newest: torch.Tensor, block: int, n_blocks: int) -> torch.Tensor:
    """The per-query candidate pool of the decoder's Full layer.

    scores [B, T, S] (-inf = invisible); newest [B, T] = newest visible entry (-1 = none).
    Entries are grouped in blocks of `block`; a block scores its max; the newest block is
    always kept; the top `n_blocks` blocks survive -> positions [B, T, n_blocks*block],
    -1 where the slot is empty or the entry is not visible.
    """
    B, T, S = scores.shape
    nb = -(-S // block)
    padded = torch.nn.functional.pad(scores, (0, nb * block - S), value=NEG_INF)
    visible = padded > NEG_INF
    block_score = padded.view(B, T, nb, block).amax(-1)  # [B, T, nb]
    has_newest = newest >= 0
    newest_block = (newest.clamp(min=0) // block).unsqueeze(-1)
    forced = torch.full_like(block_score[..., :1], float("inf"))
    block_score = torch.where(has_newest.unsqueeze(-1),
                              block_score.scatter(-1, newest_block, forced), block_score)
    kb = min(n_blocks, nb)
    blocks, values = topk_ids(block_score, kb)  # ascending block ids: the pool's order is canonical
    blocks = blocks.masked_fill(values == NEG_INF, -1)  # [B, T, kb]
    offs = torch.arange(block, device=scores.device)
    pos = (blocks.clamp(min=0).unsqueeze(-1) * block + offs).flatten(-2)  # [B, T, kb*block]
    ok = (blocks >= 0).repeat_interleave(block, dim=-1) & visible.gather(-1, pos)
    pos = pos.masked_fill(~ok, -1)
    if kb < n_blocks:
        pos = torch.cat((pos, pos.new_full((B, T, (n_blocks - kb) * block), -1)), dim=-1)
    return pos
