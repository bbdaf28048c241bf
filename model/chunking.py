"""Query-chunked attention and token-chunked LM loss: a memory policy applied from outside.

The plain model computes attention scores for every query and logits for every token at once.
At long contexts those are the largest tensors of the step: [B, T, H, k + W] scores per layer,
[B*T, V] logits. `apply_chunking(model, attn_chunk_tokens, loss_chunk_tokens)` (called by
`trainer.pretrain.build_model` from `model.attn_chunk_tokens` / `model.loss_chunk_tokens`)
rebinds each attention layer's `attend_queries` and the model's `head_loss` to the chunked
forms below. They compute the same function: each query's selection and attention depend only
on the whole-sequence KV, and the loss is a sum over tokens. Each chunk is recomputed in the
backward, so its scores or logits live only while it runs.

Apply it after `model.ops.KernelPolicy.apply`: it wraps whichever `head_loss` the model holds
(every loss op takes the chunk as its fourth argument; the fused one keeps its own working set
to a chunk of tokens and needs no recomputation).
"""
from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from model.attention import CSA2Attention
from model.numerics import wide
from model.transformer import Transformer, head_cross_entropy


def chunked_head_loss(x: torch.Tensor, head: nn.Linear, labels: torch.Tensor, chunk: int = 0) -> torch.Tensor:
    """Mean next-token cross-entropy of x [N, D] through `head` against labels [N] (-100 =
    ignore). With 0 < chunk < N, logits exist for one chunk of tokens at a time, in the forward
    and (recomputed) in the backward, so memory does not grow with vocab x sequence length."""
    if chunk <= 0 or chunk >= labels.numel():
        return head_cross_entropy(x, head, labels)
    total = x.new_zeros((), dtype=wide(x[:1]).dtype)
    for start in range(0, labels.numel(), chunk):
        total = total + torch.utils.checkpoint.checkpoint(
            _summed_ce, head, x[start:start + chunk], labels[start:start + chunk], use_reentrant=False)
    return total / (labels != -100).sum().clamp(min=1)


def _summed_ce(head: nn.Linear, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(wide(head(x)), y, ignore_index=-100, reduction="sum")


class _LossInChunks:
    """head_loss(x, head, labels) = op(x, head, labels, chunk): the loss op (reference or fused
    kernel) told how many tokens' logits may exist at once."""

    def __init__(self, op, chunk: int):
        self.op, self.chunk = op, chunk

    def __call__(self, x: torch.Tensor, head: nn.Linear, labels: torch.Tensor) -> torch.Tensor:
        return self.op(x, head, labels, self.chunk)


def chunked_attend_queries(attn, q, angles, win, halo, glob, iq, iw, rt, *, chunk: int) -> torch.Tensor:
    """`CSA2Attention.attend_queries` over chunks of `chunk` queries. A chunk needs its own rows,
    the W-1 window rows before it and the global KV; its indexer loss is weighted by its share
    of the queries."""
    T = q.shape[1]
    if chunk >= T:
        return type(attn).attend_queries(attn, q, angles, win, halo, glob, iq, iw, rt)
    # RoPE is applied outside the chunks: an `attend` that rotates q in place would rotate a
    # checkpointed chunk's q again when the backward recomputes it
    q = attn.rotary(q, angles.unsqueeze(-2))
    outs, topk, pools, recalls, loss = [], [], [], [], None
    for lo in range(0, T, chunk):
        hi = min(lo + chunk, T)
        rows = slice(lo, hi)
        chunk_halo = halo if lo == 0 else win[:, lo - attn.window + 1:lo]
        idx, pool = attn.select_rows(iq, iw, glob, rt, rows)
        args = (q[:, rows], win[:, rows], chunk_halo, None if iq is None else iq[:, rows],
                None if iw is None else iw[:, rows], glob, idx, rt, rows)
        if torch.is_grad_enabled():
            out, kl = torch.utils.checkpoint.checkpoint(attn.attend_rows, *args, use_reentrant=False)
        else:
            out, kl = attn.attend_rows(*args)
        outs.append(out)
        topk.append(idx)
        pools.append(pool)
        if kl is not None:
            loss = kl * ((hi - lo) / T) if loss is None else loss + kl * ((hi - lo) / T)
        recalls.append(attn.recall_rows(q[:, rows], win[:, rows], chunk_halo, glob, iq, idx, pool, rt, rows))
    attn.publish(rt, topk, pools, loss, recalls)
    return attn.rotary(torch.cat(outs, dim=1), angles.unsqueeze(-2), inverse=True)


def apply_chunking(model: nn.Module, attn_chunk_tokens: int = 0, loss_chunk_tokens: int = 0) -> nn.Module:
    """Run `model`'s attention layers over chunks of attn_chunk_tokens queries and its LM loss over
    chunks of loss_chunk_tokens tokens (0: all at once, the plain forward). In place; applying it
    again replaces the earlier chunk sizes."""
    for module in model.modules():
        if isinstance(module, CSA2Attention):
            if 0 < attn_chunk_tokens < module.window:
                raise ValueError(f"attn_chunk_tokens={attn_chunk_tokens} must be 0 or at least "
                                 f"window={module.window}")
            module.__dict__.pop("attend_queries", None)
            if attn_chunk_tokens > 0:
                module.attend_queries = types.MethodType(
                    functools.partial(chunked_attend_queries, chunk=attn_chunk_tokens), module)
        elif isinstance(module, Transformer):
            op = module.__dict__.pop("head_loss", None)  # a fused kernel's (KernelPolicy), else none
            op = op.op if isinstance(op, _LossInChunks) else op
            if loss_chunk_tokens > 0:
                module.head_loss = _LossInChunks(op or chunked_head_loss, loss_chunk_tokens)
            elif op is not None and op is not chunked_head_loss:
                module.head_loss = op
    return model
