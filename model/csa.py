"""CSA2 attention math: one softmax over the selected global entries, the sliding window and
a per-head sink logit, MQA over one shared latent (K = V).

Two plain-PyTorch implementations of the same function:
  sparse_attention  gathers each query's k selected entries and W window keys (the shape a
                    kernel takes; memory O(T * (k + W)))
  dense_attention   scores every key and masks to the same set (the reference the sparse
                    path is tested against; memory O(T * (S + T)))
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from model.numerics import gather_rows, wide

NEG_INF = float("-inf")


def _softmax_with_sink(logits: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """logits [..., H, K] (fp32, -inf = masked), sink [H] -> probabilities [..., H, K]; the sink
    takes part in the normalisation and is dropped."""
    sink_col = wide(sink).view(*([1] * (logits.dim() - 2)), -1, 1).expand(*logits.shape[:-1], 1)
    return torch.cat((logits, sink_col), dim=-1).softmax(dim=-1)[..., :-1]


def _with_halo(win_kv: torch.Tensor, window: int, halo: Optional[torch.Tensor]) -> torch.Tensor:
    """[B, W-1+T, C]: the W-1 window rows before the first query (another context-parallel
    rank's, or zeros at the start of the sequence), then win_kv."""
    if halo is None:
        return F.pad(win_kv, (0, 0, window - 1, 0))
    return torch.cat((halo.to(win_kv.dtype), win_kv), dim=1)


def window_keys(win_kv: torch.Tensor, window: int, halo: Optional[torch.Tensor] = None) -> torch.Tensor:
    """win_kv [B, T, C] -> [B, T, W, C]: keys t-W+1 .. t for every query t. Gathered by row index
    rather than unfolded: under trainer.compile on a CPU (torch 2.13), inductor's gradient of an
    unfold with overlapping windows is wrong (tests/test_attention.py)."""
    T = win_kv.shape[1]
    rows = (torch.arange(T, device=win_kv.device).unsqueeze(-1)
            + torch.arange(window, device=win_kv.device))  # [T, W]
    return _with_halo(win_kv, window, halo)[:, rows]


def window_doc_start(doc_start: torch.Tensor, positions: Optional[torch.Tensor],
                     halo: Optional[torch.Tensor]) -> torch.Tensor:
    """Where each query's window may start. Without a halo there is nothing before the first
    query: window rows before it are padding, also when the slice does not start at 0 (the
    bounded replay of CED prefill starts its decoder layers mid-sequence with no window rows)."""
    if halo is not None or positions is None:
        return doc_start
    return torch.maximum(doc_start, positions[:, :1])


def window_valid(doc_start: torch.Tensor, window: int,
                 positions: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[B, T, W] bool: key position t-W+1+w exists and lies in query t's document."""
    if positions is None:
        positions = torch.arange(doc_start.shape[1], device=doc_start.device).expand_as(doc_start)
    key_pos = (positions.unsqueeze(-1) - (window - 1)
               + torch.arange(window, device=doc_start.device))  # [B, T, W]
    return key_pos >= doc_start.unsqueeze(-1)


def sparse_attention(q: torch.Tensor, win_kv: torch.Tensor, glob_kv: Optional[torch.Tensor],
                     idx: Optional[torch.Tensor], doc_start: torch.Tensor, sink: torch.Tensor,
                     scale: float, window: int, positions: Optional[torch.Tensor] = None,
                     halo: Optional[torch.Tensor] = None):
    """q [B, T, H, C]; win_kv [B, T, C]; glob_kv [B, S, C]; idx [B, T, k] entry ids (-1 = empty);
    doc_start [B, T]; sink [H]; positions [B, T] global query positions (default 0..T-1);
    halo [B, W-1, C] window rows before the first query (context parallelism)
    -> (out [B, T, H, C], probabilities on idx [B, T, H, k] or None)."""
    wk = window_keys(win_kv, window, halo)  # [B, T, W, C]
    logits = torch.einsum("bthc,btwc->bthw", wide(q), wide(wk)) * scale
    valid = window_valid(window_doc_start(doc_start, positions, halo), window, positions)  # [B, T, W]
    logits = logits.masked_fill(~valid.unsqueeze(2), NEG_INF)
    W = logits.shape[-1]
    if glob_kv is not None:
        gk = gather_rows(glob_kv, idx.clamp(min=0))  # [B, T, k, C]
        g_logits = torch.einsum("bthc,btkc->bthk", wide(q), wide(gk)) * scale
        g_logits = g_logits.masked_fill((idx < 0).unsqueeze(2), NEG_INF)
        logits = torch.cat((logits, g_logits), dim=-1)
    p = _softmax_with_sink(logits, sink)
    out = torch.einsum("bthw,btwc->bthc", p[..., :W], wide(wk))
    p_glob = None
    if glob_kv is not None:
        p_glob = p[..., W:]
        out = out + torch.einsum("bthk,btkc->bthc", p_glob, wide(gk))
    return out.to(q.dtype), p_glob


def dense_attention(q: torch.Tensor, win_kv: torch.Tensor, glob_kv: Optional[torch.Tensor],
                    idx: Optional[torch.Tensor], doc_start: torch.Tensor, sink: torch.Tensor,
                    scale: float, window: int, positions: Optional[torch.Tensor] = None,
                    halo: Optional[torch.Tensor] = None):
    """Same contract as `sparse_attention`, computed against every key with masks."""
    B, T, H, _ = q.shape
    if positions is None:
        positions = torch.arange(T, device=q.device).expand(B, T)
    keys = win_kv if halo is None else torch.cat((halo.to(win_kv.dtype), win_kv), dim=1)  # [B, K, C]
    first = positions[:, :1] - (0 if halo is None else halo.shape[1])  # position of key 0
    key_pos = first + torch.arange(keys.shape[1], device=q.device)  # [B, K]
    t, s = positions.unsqueeze(-1), key_pos.unsqueeze(1)  # [B, T, 1], [B, 1, K]
    win_ok = (s <= t) & (s > t - window) & (s >= doc_start.unsqueeze(-1))  # [B, T, K]
    logits = torch.einsum("bthc,bsc->bths", wide(q), wide(keys)) * scale
    logits = logits.masked_fill(~win_ok.unsqueeze(2), NEG_INF)
    W = keys.shape[1]
    if glob_kv is not None:
        if glob_kv.shape[1] == 0:  # no finished block yet: one zero entry, which no slot selects
            glob_kv = glob_kv.new_zeros(B, 1, glob_kv.shape[-1])
        S = glob_kv.shape[1]
        chosen = torch.zeros(B, T, S + 1, dtype=torch.bool, device=q.device)
        chosen.scatter_(-1, torch.where(idx < 0, S, idx), True)  # column S swallows the -1 slots
        g_logits = torch.einsum("bthc,bsc->bths", wide(q), wide(glob_kv)) * scale
        g_logits = g_logits.masked_fill(~chosen[..., :S].unsqueeze(2), NEG_INF)
        logits = torch.cat((logits, g_logits), dim=-1)
    p = _softmax_with_sink(logits, sink)
    out = torch.einsum("bths,bsc->bthc", p[..., :W], wide(keys))
    p_glob = None
    if glob_kv is not None:
        pg = p[..., W:]
        out = out + torch.einsum("bths,bsc->bthc", pg, wide(glob_kv))
        p_glob = pg.gather(-1, idx.clamp(min=0).unsqueeze(2).expand(B, T, H, -1))
        p_glob = p_glob.masked_fill((idx < 0).unsqueeze(2), 0.0)
    return out.to(q.dtype), p_glob


ATTENTION_IMPLS = {"sparse": sparse_attention, "dense": dense_attention}
