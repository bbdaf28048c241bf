"""The student's side of distillation: one forward to final hidden states, then per domain the
chunked full-vocabulary reverse KL (rl/distill/kl.py) against that domain's teacher, optionally
plus the RL policy loss (rl/algorithm.py) weighted by distill.reward_weight.

A sample here is an RL sample (rl/policy.py) plus "domain", "teacher" (the teacher's key),
"teacher_kind" ("hidden" | "logprobs") and "teacher_out" ([R, Dt] hidden states or [R, V]
log-probs for its R response tokens). Hidden-state teachers need their LM head: `heads`
maps teacher key -> [V, Dt], sent once per teacher and kept by the trainer. On Ray both arrive as
object references (straight from the teacher worker) and `fetch_teacher_outputs` resolves them.
"""
from __future__ import annotations

from typing import Any

import torch

from rl.algorithm import policy_loss
from rl.distill.kl import TeacherHidden, TeacherLogprobs, chunked_reverse_kl


def response_hidden(model, samples: list[dict], pad_id: int) -> list[torch.Tensor]:
    """Final hidden states that predict each sample's response tokens: [R_i, D] per sample, from
    one right-padded forward of prompt + response (position p - 1 + j predicts token j)."""
    from model.runtime import AttentionRuntime

    seqs = [s["prompt"] + s["response"] for s in samples]
    width = max(len(q) for q in seqs)
    device = next(model.parameters()).device
    ids = torch.tensor([q + [pad_id] * (width - len(q)) for q in seqs], device=device)
    h = model.hidden(ids[:, :-1], AttentionRuntime(len(seqs), width - 1, device))  # [N, L-1, D]
    return [h[i, len(s["prompt"]) - 1:len(s["prompt"]) - 1 + len(s["response"])]
            for i, s in enumerate(samples)]


def fetch_teacher_outputs(samples: list[dict], heads: dict[str, Any]) -> None:
    """In place: "teacher_out" given as (Ray object ref to a teacher call's outputs, index) and
    heads given as object refs become tensors (one ray.get for all of them)."""
    refs = list(dict.fromkeys([s["teacher_out"][0] for s in samples if isinstance(s["teacher_out"], tuple)]
                              + [h for h in heads.values() if not isinstance(h, torch.Tensor)]))
    if not refs:
        return
    import ray

    got = dict(zip(refs, ray.get(refs)))
    for s in samples:
        if isinstance(s["teacher_out"], tuple):
            ref, j = s["teacher_out"]
            s["teacher_out"] = got[ref][j]
    for key, h in heads.items():
        if not isinstance(h, torch.Tensor):
            heads[key] = got[h]


def teacher_view(samples: list[dict], heads: dict[str, torch.Tensor], like: torch.Tensor):
    """The KL's teacher input for samples that share one teacher: their rows concatenated, in
    the dtype and on the device of `like` (the student's hidden states)."""
    out = torch.cat([s["teacher_out"] for s in samples]).to(like.device, like.dtype)
    if samples[0]["teacher_kind"] == "hidden":
        # heads stay in host memory in the wire dtype (41 flash-size heads are 50 GB in bf16);
        # the batch's few teachers are copied over per step
        return TeacherHidden(out, heads[samples[0]["teacher"]].to(like.device, like.dtype))
    return TeacherLogprobs(out)


def distill_objective(model, samples: list[dict], fresh: torch.Tensor, heads: dict[str, torch.Tensor],
                      pad_id: int, distill, rl) -> tuple[torch.Tensor, dict[str, Any]]:
    """kl_weight * (mean reverse KL to each sample's teacher) + reward_weight * RL loss, over the
    samples whose `fresh` [N] is True (the staleness rule). distill.kl_mean: "domain" (the
    default) averages each domain's token mean, so a domain with one-token answers weighs as much
    as one with twelve-token answers; "token" averages over every response token of the batch. Stats: "kl"
    (the token mean, either way) and "kl_by_domain" {domain: [sum of token KLs, tokens]}."""
    hidden = response_hidden(model, samples, pad_id)
    head = model.head.weight  # [V, D]
    keep = [i for i, ok in enumerate(fresh.tolist()) if ok and len(samples[i]["response"])]
    tokens = sum(len(samples[i]["response"]) for i in keep)
    kl_total = head.new_zeros((), dtype=torch.float32)
    domain_means = []
    by_domain: dict[str, list[float]] = {}
    for domain in sorted({samples[i]["domain"] for i in keep}):
        idx = [i for i in keep if samples[i]["domain"] == domain]
        h = torch.cat([hidden[i] for i in idx])  # [M, D]
        kl = chunked_reverse_kl(h, head, teacher_view([samples[i] for i in idx], heads, h),
                                token_chunk=distill.token_chunk, vocab_chunk=distill.vocab_chunk)
        kl_total = kl_total + kl.float() * h.shape[0]
        domain_means.append(kl.float())
        by_domain[domain] = [float(kl.detach()) * h.shape[0], h.shape[0]]
    kl_mean = kl_total / max(tokens, 1)
    if distill.kl_mean == "domain" and domain_means:
        loss = distill.kl_weight * torch.stack(domain_means).mean()
    else:
        loss = distill.kl_weight * kl_mean
    stats: dict[str, Any] = {"kl": float(kl_mean.detach()), "kl_by_domain": by_domain}
    if distill.reward_weight > 0:
        pg, pg_stats = _policy_term(hidden, head, samples, fresh, rl)
        loss = loss + distill.reward_weight * pg
        stats.update(pg_stats, pg_loss=float(pg.detach()))
    return loss, stats


def _policy_term(hidden: list[torch.Tensor], head: torch.Tensor, samples: list[dict], fresh: torch.Tensor,
                 rl):
    """The RL clipped surrogate on the same forward (rl/policy.py's loss): logits of response
    positions only, [sum R_i, V] (the RL trainer builds these for every position)."""
    R = max(len(s["response"]) for s in samples)
    logp = head.new_zeros(len(samples), R, dtype=torch.float32)
    behaviour = torch.zeros_like(logp)
    mask = torch.zeros(len(samples), R, dtype=torch.bool, device=logp.device)
    for i, s in enumerate(samples):
        r = len(s["response"])
        if r == 0:
            continue
        tok = torch.tensor(s["response"], device=logp.device)
        lp = torch.log_softmax((hidden[i] @ head.T).float(), dim=-1).gather(-1, tok[:, None])[:, 0]
        logp = logp.index_put((torch.full((r,), i, device=logp.device), torch.arange(r, device=logp.device)),
                              lp)
        behaviour[i, :r] = torch.tensor(s["behaviour"], dtype=logp.dtype)
        mask[i, :r] = bool(fresh[i])
    adv = torch.tensor([s["advantage"] for s in samples], dtype=logp.dtype, device=logp.device)
    loss, stats = policy_loss(logp, behaviour, adv, mask, rl.clip_low, rl.clip_high, rl.is_cap)
    with torch.no_grad():
        stats["behaviour_kl"] = float(((behaviour - logp.detach()) * mask).sum() / mask.sum().clamp(min=1))
    return loss, stats

