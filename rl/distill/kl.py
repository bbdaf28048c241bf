"""Full-vocabulary reverse KL for on-policy distillation, in bounded memory.

Per response token n, with s_n the student's logits and log p_t the teacher's log-probs over the
whole vocabulary V:

    KL_n = KL(p_s || p_t) = sum_v p_s(v) (log p_s(v) - log p_t(v)),   loss = mean of KL_n over masked n.

Why chunking: at full scale V = 129,280, so the [N, V] fp32 logits of a 16k-token micro-batch take
8.5 GB, and autograd would keep several such tensors (logits, log-softmax, probs) alive for the
backward. `chunked_reverse_kl` instead takes the student's final hidden states [N, D] and LM head
[V, D] (and the teacher's, when the teacher sends hidden states rather than log-probs) and only
ever builds [token_chunk, vocab_chunk] blocks of logits:

  pass 1, per vocab chunk: online log-sum-exp -> lse_s [T] (and lse_t [T] for a hidden teacher);
  pass 2, per vocab chunk: KL_n += sum_v p_s (log p_s - log p_t), with log p = logits - lse.

Two passes rather than one online pass of sum e^s (s - t): the one-pass form subtracts two
O(log V) numbers to get a KL that can be ~1e-6, losing fp32 precision; the two-pass form sums
p_s * (log p_s - log p_t) directly. It costs one extra logits matmul in the forward.

The backward recomputes the logits chunk by chunk too (nothing [N, V] is saved; only lse_s, lse_t
and KL_n, [N] each). The gradient, for token n with logits s (teacher fixed):

    dKL_n / ds_v = p_s(v) * ((log p_s(v) - log p_t(v)) - KL_n)

(from d log p_s(u) / ds_v = [u == v] - p_s(v) and sum_u p_s(u) = 1), so with g = dL/dKL_n and
G = g * dKL_n/ds for a chunk: dL/dh_n += G @ W_s[chunk], dL/dW_s[chunk] += G^T @ h. The teacher gets
no gradient.

Log-probs of -inf (e.g. a teacher that masks padded vocabulary entries) are clamped to the dtype's
most negative finite value, so a token the student gives zero probability contributes 0 * finite
= 0 to the KL and its gradient instead of NaN; a token the student gives positive probability
then contributes a huge (correctly "infinite-ish") KL.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor


@dataclass(frozen=True)
class TeacherLogprobs:
    """The teacher's full-vocabulary log-probs, already normalised."""
    logprobs: Tensor  # [N, V]


@dataclass(frozen=True)
class TeacherHidden:
    """The teacher's final hidden states; the student side applies the teacher's LM head:
    log p_t = log_softmax(hidden @ head_weight^T / temperature)."""
    hidden: Tensor       # [N, Dt]
    head_weight: Tensor  # [V, Dt]
    temperature: float = 1.0


Teacher = Union[TeacherLogprobs, TeacherHidden]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 math for bf16/fp16/fp32 inputs, fp64 stays fp64."""
    return torch.promote_types(dtype, torch.float32)


def reverse_kl_reference(student_logits: Tensor, teacher_logprobs: Tensor,
                         mask: Optional[Tensor] = None) -> Tensor:
    """Mean over masked tokens of KL(p_s || p_t), unchunked (materialises [N, V]); the oracle
    for `chunked_reverse_kl`. student_logits [N, V], teacher_logprobs [N, V], mask [N] bool
    (None: every token). No masked token -> 0."""
    cd = _compute_dtype(student_logits.dtype)
    if mask is None:
        mask = torch.ones(student_logits.shape[0], dtype=torch.bool, device=student_logits.device)
    s = student_logits[mask].to(cd)                                          # [M, V]
    log_pt = teacher_logprobs[mask].detach().to(cd).clamp_min(torch.finfo(cd).min)
    log_ps = torch.log_softmax(s, dim=-1)
    kl = (log_ps.exp() * (log_ps - log_pt)).sum(-1)                          # [M]
    return kl.sum() / max(int(mask.sum()), 1)


class _ChunkedReverseKL(torch.autograd.Function):
    """loss = sum over selected rows n of KL_n / M. Inputs: h [N, D], w [V, D], rows [M] (indices of
    masked tokens), and the teacher as (t_a, t_b): (logprobs [N, V], None) or (hidden [N, Dt],
    head [V, Dt]) with `temperature`."""

    @staticmethod
    def forward(ctx, h, w, rows, t_a, t_b, temperature, denom, token_chunk, vocab_chunk):
        cd = _compute_dtype(h.dtype)
        V = w.shape[0]
        lse_s = torch.empty(rows.numel(), dtype=cd, device=h.device)         # [M]
        lse_t = torch.empty_like(lse_s) if t_b is not None else None          # [M]
        kl = torch.zeros_like(lse_s)                                          # [M]
        for r0 in range(0, rows.numel(), token_chunk):
            r = rows[r0:r0 + token_chunk]                                     # [T]
            hr = h.index_select(0, r)                                         # [T, D]
            tr = t_a.index_select(0, r) if t_b is not None else None          # [T, Dt]
            # Pass 1: online log-sum-exp over vocab chunks.
            m_s, z_s = _lse_init(r.numel(), cd, h.device)
            m_t, z_t = _lse_init(r.numel(), cd, h.device)
            for v0 in range(0, V, vocab_chunk):
                m_s, z_s = _lse_step(m_s, z_s, _logits(hr, w, v0, vocab_chunk, cd))
                if tr is not None:
                    m_t, z_t = _lse_step(m_t, z_t, _logits(tr, t_b, v0, vocab_chunk, cd) / temperature)
            ls = m_s + z_s.log()
            lse_s[r0:r0 + r.numel()] = ls
            lt = None
            if tr is not None:
                lt = m_t + z_t.log()
                lse_t[r0:r0 + r.numel()] = lt
            # Pass 2: KL_n = sum_v p_s (log p_s - log p_t).
            acc = torch.zeros(r.numel(), dtype=cd, device=h.device)
            for v0 in range(0, V, vocab_chunk):
                log_ps, log_pt = _chunk_logprobs(hr, w, ls, tr, t_b, lt, t_a, r, temperature, v0, vocab_chunk,
                                                 cd)
                acc += (log_ps.exp() * (log_ps - log_pt)).sum(-1)
            kl[r0:r0 + r.numel()] = acc
        ctx.save_for_backward(h, w, rows, t_a, t_b, lse_s, lse_t, kl)
        ctx.temperature, ctx.denom = temperature, denom
        ctx.token_chunk, ctx.vocab_chunk = token_chunk, vocab_chunk
        return kl.sum() / denom

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        h, w, rows, t_a, t_b, lse_s, lse_t, kl = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        cd = lse_s.dtype
        V, tc, vc = w.shape[0], ctx.token_chunk, ctx.vocab_chunk
        g = grad_out.to(cd) / ctx.denom                                       # dL/dKL_n, same for every n
        grad_h = torch.zeros(h.shape, dtype=cd, device=h.device) if need_h else None   # [N, D]
        grad_w = torch.zeros(w.shape, dtype=cd, device=w.device) if need_w else None   # [V, D]
        for r0 in range(0, rows.numel(), tc):
            r = rows[r0:r0 + tc]
            n = r.numel()
            hr = h.index_select(0, r)                                         # [T, D]
            tr = t_a.index_select(0, r) if t_b is not None else None
            ls = lse_s[r0:r0 + n]
            lt = lse_t[r0:r0 + n] if t_b is not None else None
            kr = kl[r0:r0 + n, None]                                          # [T, 1]
            gh = torch.zeros(n, h.shape[1], dtype=cd, device=h.device) if need_h else None  # [T, D]
            for v0 in range(0, V, vc):
                log_ps, log_pt = _chunk_logprobs(hr, w, ls, tr, t_b, lt, t_a, r, ctx.temperature, v0, vc, cd)
                # dKL_n/ds_v = p_s(v) ((log p_s(v) - log p_t(v)) - KL_n)
                gs = (log_ps.exp() * ((log_ps - log_pt) - kr) * g).to(w.dtype)   # [T, vc]
                if need_h:
                    gh += (gs @ w[v0:v0 + vc]).to(cd)
                if need_w:
                    grad_w[v0:v0 + vc] += (gs.T @ hr).to(cd)
            if need_h:
                grad_h.index_add_(0, r, gh)
        return (grad_h.to(h.dtype) if need_h else None, grad_w.to(w.dtype) if need_w else None,
                None, None, None, None, None, None, None)


def _lse_init(n: int, dtype: torch.dtype, device) -> tuple[Tensor, Tensor]:
    return (torch.full((n,), float("-inf"), dtype=dtype, device=device),
            torch.zeros(n, dtype=dtype, device=device))


def _lse_step(m: Tensor, z: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    """Online log-sum-exp: (running max m [T], sum z [T] of exp(x - m)) updated with a chunk x [T, c]."""
    m_new = torch.maximum(m, x.amax(-1))
    z = z * torch.exp(m - m_new) + torch.exp(x - m_new[:, None]).sum(-1)
    return m_new, z


def _logits(x: Tensor, w: Tensor, v0: int, vc: int, cd: torch.dtype) -> Tensor:
    """x [T, D] @ w[v0:v0+vc]^T -> [T, vc] in the compute dtype (matmul in the inputs' dtype)."""
    return (x @ w[v0:v0 + vc].T).to(cd)


def _chunk_logprobs(hr, w, ls, tr, t_b, lt, t_a, r, temperature, v0, vc, cd) -> tuple[Tensor, Tensor]:
    """(log p_s, log p_t) for token rows r and vocab chunk [v0, v0+vc): [T, vc] each."""
    log_ps = _logits(hr, w, v0, vc, cd) - ls[:, None]
    if t_b is not None:
        log_pt = _logits(tr, t_b, v0, vc, cd) / temperature - lt[:, None]
    else:  # slice the vocab columns first (a view), then gather rows: a [T, vc] copy
        log_pt = t_a[:, v0:v0 + vc].index_select(0, r).to(cd)
    return log_ps, log_pt.clamp_min(torch.finfo(cd).min)


def chunked_reverse_kl(student_hidden: Tensor, student_head_weight: Tensor, teacher: Teacher,
                       mask: Optional[Tensor] = None, token_chunk: int = 1024,
                       vocab_chunk: int = 8192) -> Tensor:
    """Mean over masked tokens of KL(p_s || p_t) with p_s = softmax(student_hidden @ head^T), equal
    to `reverse_kl_reference` in value and gradient, in memory O(token_chunk * vocab_chunk) for
    logits (plus [N] statistics and the [V, D] head gradient).

    student_hidden [N, D], student_head_weight [V, D], teacher: TeacherLogprobs([N, V]) or
    TeacherHidden([N, Dt], [V, Dt], temperature); mask [N] bool (None: every token; masked-out
    rows are never read, so they may hold anything). Gradients flow to student_hidden and
    student_head_weight only. No masked token -> 0 (zero gradients).
    """
    if token_chunk < 1 or vocab_chunk < 1:
        raise ValueError(f"chunks must be >= 1, got token_chunk={token_chunk}, vocab_chunk={vocab_chunk}")
    N, D = student_hidden.shape
    V, Dw = student_head_weight.shape
    if Dw != D:
        raise ValueError(f"student head is [{V}, {Dw}] but hidden states are [{N}, {D}]")
    if isinstance(teacher, TeacherLogprobs):
        t_a, t_b, temperature = teacher.logprobs.detach(), None, 1.0
        if tuple(t_a.shape) != (N, V):
            raise ValueError(f"teacher log-probs must be [{N}, {V}], got {list(t_a.shape)}")
    elif isinstance(teacher, TeacherHidden):
        t_a, t_b, temperature = (teacher.hidden.detach(), teacher.head_weight.detach(),
                                 float(teacher.temperature))
        if t_a.shape[0] != N or t_b.shape[0] != V or t_a.shape[1] != t_b.shape[1]:
            raise ValueError(f"teacher hidden {list(t_a.shape)} / head {list(t_b.shape)} do not match "
                             f"N={N}, V={V}")
        if temperature <= 0:
            raise ValueError(f"teacher temperature must be > 0, got {temperature}")
    else:
        raise TypeError(f"teacher must be TeacherLogprobs or TeacherHidden, got {type(teacher).__name__}")
    if mask is None:
        rows = torch.arange(N, device=student_hidden.device)
    else:
        if tuple(mask.shape) != (N,):
            raise ValueError(f"mask must be [{N}], got {list(mask.shape)}")
        rows = mask.nonzero().squeeze(1)                                      # [M]
    denom = max(rows.numel(), 1)
    return _ChunkedReverseKL.apply(student_hidden, student_head_weight, rows, t_a, t_b, temperature, denom,
                                   token_chunk, vocab_chunk)


def bytes_per_token(vocab: int, teacher_dim: int, dtype_bytes: int) -> dict:
    """What a teacher sends per student token: full-vocab log-probs (V * bytes) or final hidden
    states (Dt * bytes, plus its LM head, V * Dt * bytes, once per teacher load). break_even_tokens:
    tokens after which hidden states + head cost less than log-probs."""
    logprobs = vocab * dtype_bytes
    hidden = teacher_dim * dtype_bytes
    head_once = vocab * teacher_dim * dtype_bytes
    return {"logprobs": logprobs, "hidden": hidden, "head_once": head_once,
            "ratio": logprobs / hidden, "break_even_tokens": head_once / (logprobs - hidden)}
