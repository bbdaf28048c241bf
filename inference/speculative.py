"""Speculative decoding with the DSpark drafter (model/dspark.py, docs/DESIGN.md "Speculative decoding").

One step, for a batch of sequences of equal length L whose newest sampled token (the anchor) is not
in the cache yet:
  1. the drafter proposes K_max tokens per row from its context rows (projected taps of the target
     over the sequence so far), with the distribution q_i each was drawn from and a confidence c_i
  2. `choose_draft_length` picks k <= K_max from the confidences and the batch size
  3. one target forward over [anchor, d_1 .. d_k] (the cache marked), giving the target's sampling
     distributions p_0 .. p_k
  4. `accept_drafts`: per row, d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i)) until the
     first rejection, which is replaced by a draw from the residual max(p_i - q_i, 0) (normalised);
     a row that accepts all k draws its next token from p_k. Greedy: d_i is accepted when it is p_i's
     argmax, and the next token is that argmax
  5. the batch keeps a = min over rows of the accepted count: each row emits d_1 .. d_a and then its
     own token at position a (the residual or p_k draw of the row that stopped there, the accepted
     d_{a+1} of a row that went further); the cache rolls back to L + a + 1 and the emitted tokens'
     taps join the drafter's context
Every emitted token is, given the tokens before it, distributed as the target's sampling
distribution (the rule in 4; cutting a row at a point decided by the rows before that point, or by
other rows, keeps this), so the output is distributed as plain sampling; greedy output is the same
tokens. The log-probability recorded for each token is the target's, as `generate` records it.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

import torch

from inference.cache import DecodeCache
from inference.generate import (
    Generation,
    check_generate_args,
    forward_new,
    prefill_ced,
    sample,
    sampling_logprobs,
)
from model.dspark import DSpark, TapRecorder
from model.transformer import Transformer


@dataclass
class SpeculativeStats:
    verifications: int = 0  # target forwards that verified drafts (k >= 1)
    plain_steps: int = 0  # target forwards of the anchor alone (k = 0)
    drafted: int = 0  # draft tokens verified, summed over rows
    accepted: int = 0  # of them emitted, summed over rows
    rows: int = 0  # row-steps (a row in one target forward)

    def tokens_per_forward(self) -> float:
        """Tokens a row gains per target forward: 1 + accepted drafts per row-step."""
        return 1 + self.accepted / max(self.rows, 1)

    def as_dict(self) -> dict[str, float]:
        return {"verifications": self.verifications, "plain_steps": self.plain_steps, "drafted": self.drafted,
                "accepted": self.accepted, "acceptance_rate": self.accepted / max(self.drafted, 1),
                "tokens_per_forward": self.tokens_per_forward()}


def choose_draft_length(confidence: torch.Tensor, capacity: float, draft_cost: float) -> int:
    """The k in 0..K that maximises expected tokens per unit of step cost for a batch.

    confidence [B, K]: row b's chance that draft i is accepted given the drafts before it were. The
    batch keeps the smallest accepted count, so (rows independent) P(all rows accept >= i) =
    prod_b prod_{j<=i} c_bj, and a forward of k drafts gains 1 + sum_{i<=k} of that. Its cost is 1 (the
    weights read once) + B (k + 1) / capacity (tokens past the roofline knee, `capacity` tokens a
    forward) + draft_cost when drafting."""
    B, K = confidence.shape
    log_all = torch.log(confidence.double().clamp(min=1e-12)).cumsum(1).sum(0)  # [K]
    gain = torch.cat((torch.ones(1, dtype=torch.float64), 1 + log_all.exp().cumsum(0)))  # [K + 1]
    k = torch.arange(K + 1, dtype=torch.float64)
    cost = 1 + B * (k + 1) / capacity + draft_cost * (k > 0)
    return int((gain / cost).argmax())


def accept_drafts(p: torch.Tensor, q: Optional[torch.Tensor], drafts: torch.Tensor,
                  generators: list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """The speculative-sampling rule. p [B, k+1, V]: the target's sampling distributions at the anchor
    and each draft; q [B, k, V]: the distributions the drafts were drawn from (None: greedy, p and q
    are then logits or probabilities whose argmax decides); drafts [B, k].
    -> (accepted count n [B], the token that follows the n accepted drafts [B])."""
    B, k = drafts.shape
    if q is None:
        best = p.argmax(-1)  # [B, k+1]
        match = (best[:, :k] == drafts).long()
        n = match.cumprod(1).sum(1)  # [B]
        return n, best.gather(1, n[:, None])[:, 0]
    n = torch.empty(B, dtype=torch.long)
    token = torch.empty(B, dtype=torch.long, device=drafts.device)
    for b, g in enumerate(generators):
        u = torch.rand(k, generator=g, device=g.device, dtype=torch.float64)
        pd = p[b, torch.arange(k), drafts[b]].double()
        qd = q[b, torch.arange(k), drafts[b]].double()
        ok = (u * qd < pd).long().cumprod(0)
        n[b] = a = int(ok.sum())
        if a == k:
            dist = p[b, k]
        else:
            dist = (p[b, a] - q[b, a]).clamp(min=0)
            if not dist.sum() > 0:  # q = p there: nothing to correct (rejection has probability 0)
                dist = p[b, a]
        token[b] = torch.multinomial(dist.float(), 1, generator=g)[0]
    return n.to(drafts.device), token


@torch.no_grad()
def propose(drafter: DSpark, target: Transformer, context: torch.Tensor, context_pos: torch.Tensor,
            anchor: torch.Tensor, position: int, temperature: float, top_p: float,
            generators: list[torch.Generator]):
    """Drafts for anchors [B] at `position`: (drafts [B, K], their distributions q [B, K, V] or None
    when greedy, conditional confidences [B, K])."""
    B, K = anchor.shape[0], drafter.block
    pos = torch.full((B, 1), position, device=anchor.device)
    visible = ((context_pos < position) & (context_pos >= position - drafter.cfg.window))[:, None]  # [B,1,S]
    hidden = drafter.hidden(target.embed, context, visible, context_pos, anchor[:, None], pos)[:, 0]  # B,K,D
    base = drafter.base_logits(target.head, hidden)  # [B, K, V]
    prev, drafts, qs, conf = anchor, [], [], []
    for i in range(K):
        bias, markov = drafter.markov(prev)
        logits = base[:, i] + bias
        conf.append(torch.sigmoid(drafter.confidence(hidden[:, i], markov)))
        if temperature <= 0:
            prev = logits.argmax(-1)
        else:
            q = sampling_logprobs(logits, temperature, top_p).exp()
            prev = torch.cat([torch.multinomial(q[b:b + 1], 1, generator=g)[0]
                              for b, g in enumerate(generators)])
            qs.append(q)
        drafts.append(prev)
    return torch.stack(drafts, 1), (torch.stack(qs, 1) if qs else None), torch.stack(conf, 1)


@torch.no_grad()
def generate_speculative(model: Transformer, drafter: DSpark, prompts: list[list[int]], max_new_tokens: int,
                         temperature: float = 1.0, top_p: float = 1.0, stop: Optional[set[int]] = None,
                         seed: int = 0, policy_version: int = 0, packed: bool = True,
                         replay: Optional[int] = 128, max_batch: int = 64, draft_length: Optional[int] = None,
                         capacity: float = 256.0, draft_cost: float = 0.1,
                         stats: Optional[SpeculativeStats] = None) -> list[Generation]:
    """`generate`'s contract (inference/generate.py) with speculative decoding: prompts of equal length
    decode together, up to max_batch at a time. draft_length: verify this many drafts every step
    (None: `choose_draft_length` with `capacity` and `draft_cost`). Greedy output equals `generate`'s;
    sampled output has its distribution but not its per-prompt draws (a row's randomness is spent on
    drafts and acceptance tests)."""
    check_generate_args(prompts, max_new_tokens, max_batch)
    if draft_length is not None and not 0 <= draft_length <= drafter.block:
        raise ValueError(f"draft_length={draft_length}: expected 0..{drafter.block}")
    device = next(model.parameters()).device
    model.eval()
    drafter.eval()
    stats = stats if stats is not None else SpeculativeStats()
    out = [Generation(policy_version=policy_version) for _ in prompts]
    generators = [torch.Generator(device=device).manual_seed((seed * 1_000_003 + i) % 2**63)
                  for i in range(len(prompts))]
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(prompts):
        by_length[len(p)].append(i)
    for group in by_length.values():
        for at in range(0, len(group), max_batch):
            rows = group[at:at + max_batch]
            _decode_group(model, drafter, [prompts[i] for i in rows], [out[i] for i in rows],
                          [generators[i] for i in rows], max_new_tokens, temperature, top_p, stop, packed,
                          replay, draft_length, capacity, draft_cost, stats)
    return out


def _decode_group(model, drafter, prompts, gens, generators, max_new_tokens, temperature, top_p, stop, packed,
                  replay, draft_length, capacity, draft_cost, stats: SpeculativeStats) -> None:
    device = generators[0].device
    ids = torch.tensor(prompts, device=device)  # [B, N]
    B, N = ids.shape
    n_layers, W = len(model.layers), drafter.cfg.window
    cache = DecodeCache(B, packed=packed)
    with TapRecorder(model, drafter.taps) as rec:
        logits = forward_new(model, cache, ids) if replay is None else prefill_ced(model, cache, ids, replay)
        taps = rec.take()  # the positions whose decoder layers ran: the last R
        context = drafter.context(taps.to(drafter.main_proj.weight.dtype))[:, -W:]
        context_pos = torch.arange(N - context.shape[1], N, device=device).expand(B, -1)
        for g in gens:
            g.token_layer_passes = cache.token_layer_passes  # a batched forward counts one sequence
        if max_new_tokens == 0:
            return
        token, logp = sample(logits[:, -1].float(), temperature, top_p, generators)
        live = []  # indices into the group of rows still decoding
        for b in range(B):
            if not _took(gens[b], int(token[b]), float(logp[b]), stop, max_new_tokens):
                live.append(b)
        last = token
        if len(live) < B:
            keep = torch.tensor(live, device=device, dtype=torch.long)
            cache.select_rows(keep)
            context, context_pos, last = context[keep], context_pos[keep], last[keep]
        while live:
            rows = len(live)
            left = min(max_new_tokens - len(gens[b].tokens) for b in live)
            drafts, q, conf = propose(drafter, model, context, context_pos, last, cache.length, temperature,
                                      top_p, [generators[b] for b in live])
            k = choose_draft_length(conf, capacity, draft_cost) if draft_length is None else draft_length
            k = min(k, left - 1)
            fed = torch.cat((last[:, None], drafts[:, :k]), dim=1)  # [rows, k + 1]
            cache.mark()
            logits = forward_new(model, cache, fed).float()  # [rows, k + 1, V]
            taps = rec.take()
            if temperature <= 0:
                n, nxt = accept_drafts(logits, None, drafts[:, :k], [])
                logps = logits.log_softmax(-1)
            else:
                logps = sampling_logprobs(logits, temperature, top_p)
                n, nxt = accept_drafts(logps.exp(), q[:, :k] if k else q[:, :0], drafts[:, :k],
                                       [generators[b] for b in live])
            a = int(n.min())
            own = torch.where(n > a, drafts[:, a], nxt) if a < k else nxt  # the token at position a
            emitted = torch.cat((drafts[:, :a], own[:, None]), dim=1)  # [rows, a + 1]
            cache.rollback(a + 1, fed)
            stats.verifications += k > 0
            stats.plain_steps += k == 0
            stats.drafted += k * rows
            stats.accepted += a * rows
            stats.rows += rows
            new_rows = drafter.context(taps[:, :a + 1].to(drafter.main_proj.weight.dtype))
            context = torch.cat((context, new_rows), dim=1)[:, -W:]
            new_pos = torch.arange(cache.length - a - 1, cache.length, device=device).expand(rows, -1)
            context_pos = torch.cat((context_pos, new_pos), dim=1)[:, -W:]
            still = []
            for r, b in enumerate(live):
                gens[b].token_layer_passes += (k + 1) * n_layers
                tokens = emitted[r].tolist()
                lps = logps[r, torch.arange(a + 1), emitted[r]].tolist()
                if not any(_took(gens[b], t, lp, stop, max_new_tokens) for t, lp in zip(tokens, lps)):
                    still.append(r)
            last = emitted[:, -1]
            if len(still) < rows:
                keep = torch.tensor(still, device=device, dtype=torch.long)
                cache.select_rows(keep)
                context, context_pos, last = context[keep], context_pos[keep], last[keep]
                live = [live[r] for r in still]


def _took(gen: Generation, token: int, logp: float, stop: Optional[set[int]], max_new_tokens: int) -> bool:
    """Record a token; True when the generation is over (later tokens of the step are dropped)."""
    gen.tokens.append(token)
    gen.logprobs.append(logp)
    if stop and token in stop:
        gen.finish = "stop"
        return True
    return len(gen.tokens) == max_new_tokens
