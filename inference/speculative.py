"""Speculative decoding with the DSpark drafter (model/dspark.py, docs/DESIGN.md "Speculative decoding").

Sequences decode together from a SlotCache (inference/slots.py), each at its own length, as in
`generate`: a prompt is prefilled on its own, takes a free slot, and leaves it when it is done. One
step, over the busy slots, each of whose newest sampled token (the anchor) is not in the cache yet:
  1. the drafter proposes K_max tokens per row from its context rows (projected taps of the target
     over the row's sequence so far), with the distribution q_i each was drawn from and a
     confidence c_i
  2. `choose_draft_length` picks one k <= K_max for the step from the confidences and the batch size
  3. one target forward over [anchor, d_1 .. d_k] of every row, giving the target's sampling
     distributions p_0 .. p_k
  4. `accept_drafts`: per row, d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i)) until the
     first rejection, which is replaced by a draw from the residual max(p_i - q_i, 0) (normalised);
     a row that accepts all k draws its next token from p_k. Greedy: d_i is accepted when it is p_i's
     argmax, and the next token is that argmax
  5. row r emits its n_r accepted drafts and that next token: its slot keeps n_r + 1 of the k + 1
     tokens fed (`SlotCache.end(.., keep)`), and their taps join its drafter context
Every emitted token is, given the tokens before it, distributed as the target's sampling
distribution (the rule in 4, row by row), so the output is distributed as plain sampling; greedy
output is the same tokens. The log-probability recorded for each token is the target's, as
`generate` records it.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional

import torch

from inference.generate import (
    Generation,
    SharedPrefills,
    _prefill,
    check_generate_args,
    invert_cdf,
    prompt_seeds,
    sample_rows,
    sampling_logprobs,
    uniform_draws,
)
from inference.graphs import decode_experts
from inference.prefix import PrefixCache
from inference.slots import SlotCache, to_device
from model.dspark import DSpark, TapRecorder
from model.transformer import Transformer


@dataclass
class SpeculativeStats:
    verifications: int = 0  # target forwards that verified drafts (k >= 1)
    plain_steps: int = 0  # target forwards of the anchor alone (k = 0)
    drafted: int = 0  # draft tokens verified, summed over rows
    accepted: int = 0  # of them accepted, summed over rows (each row its own count)
    rows: int = 0  # row-steps (a row in one target forward)

    def tokens_per_forward(self) -> float:
        """Tokens a row gains per target forward: 1 + accepted drafts per row-step."""
        return 1 + self.accepted / max(self.rows, 1)

    def as_dict(self) -> dict[str, float]:
        return {"verifications": self.verifications, "plain_steps": self.plain_steps, "drafted": self.drafted,
                "accepted": self.accepted, "acceptance_rate": self.accepted / max(self.drafted, 1),
                "acceptance_length": self.accepted / max(self.rows, 1),
                "tokens_per_forward": self.tokens_per_forward()}


def choose_draft_length(confidence: torch.Tensor, capacity: float, draft_cost: float) -> int:
    """The k in 0..K (one for the whole step: a forward feeds every row k + 1 tokens) that maximises
    expected tokens per unit of step cost.

    confidence [B, K]: row b's chance that draft i is accepted given the drafts before it were. Each
    row keeps its own accepted count, so row b gains 1 + sum_{i<=k} prod_{j<=i} c_bj tokens, and the
    step the mean of that over rows (per row, as the cost). Its cost is 1 (the weights read once) +
    B (k + 1) / capacity (tokens past the roofline knee, `capacity` tokens a forward) + draft_cost
    when drafting."""
    B, K = confidence.shape
    reach = torch.log(confidence.double().clamp(min=1e-12)).cumsum(1).exp().mean(0)  # [K] E[rows past i]
    gain = torch.cat((torch.ones(1, dtype=torch.float64), 1 + reach.cumsum(0)))  # [K + 1]
    k = torch.arange(K + 1, dtype=torch.float64)
    cost = 1 + B * (k + 1) / capacity + draft_cost * (k > 0)
    return int((gain / cost).argmax())


def accept_drafts(p: torch.Tensor, q: Optional[torch.Tensor], drafts: torch.Tensor,
                  uniforms: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The speculative-sampling rule, for every row at once. p [B, k+1, V]: the target's sampling
    distributions at the anchor and each draft; q [B, k, V]: the distributions the drafts were drawn
    from (None: greedy, p and q are then logits or probabilities whose argmax decides); drafts [B, k];
    uniforms [B, k+1] in (0, 1): row b's acceptance tests, then its draw of the following token.
    -> (accepted count n [B], the token that follows the n accepted drafts [B])."""
    B, k = drafts.shape
    if q is None:
        best = p.argmax(-1)  # [B, k+1]
        match = (best[:, :k] == drafts).long()
        n = match.cumprod(1).sum(1)  # [B]
        return n, best.gather(1, n[:, None])[:, 0]
    pd = p[:, :k].gather(-1, drafts[..., None])[..., 0].double()  # [B, k] p_i(d_i)
    qd = q.gather(-1, drafts[..., None])[..., 0].double()  # [B, k] q_i(d_i)
    n = (uniforms[:, :k] * qd < pd).long().cumprod(1).sum(1)  # accepted while u_i q_i(d_i) < p_i(d_i)
    rows = torch.arange(B, device=drafts.device)
    pn = p[rows, n]  # [B, V]
    if k == 0:
        dist = pn
    else:  # after a rejection the residual max(p - q, 0); a row that accepted all k draws from p_k
        qn = torch.where((n < k)[:, None], q[rows, n.clamp(max=k - 1)], torch.zeros_like(pn))
        dist = (pn - qn).clamp(min=0)
        # q = p there: a rejection had probability 0, nothing to correct
        dist = torch.where((dist.sum(-1) > 0)[:, None], dist, pn)
    return n, invert_cdf(dist, uniforms[:, k])


@torch.no_grad()
def propose(drafter: DSpark, target: Transformer, context: torch.Tensor, context_pos: torch.Tensor,
            anchor: torch.Tensor, position: torch.Tensor, temperature: float, top_p: float,
            uniforms: Optional[torch.Tensor]):
    """Drafts for anchors [B] at positions [B] (context [B, S, D] at context_pos [B, S]), draft i of
    row b drawn at uniforms[b, i] ([B, K]; None when greedy): (drafts [B, K], their distributions
    q [B, K, V] or None when greedy, conditional confidences [B, K])."""
    pos = position[:, None]  # [B, 1]
    visible = ((context_pos < pos) & (context_pos >= pos - drafter.cfg.window))[:, None]  # [B, 1, S]
    hidden = drafter.hidden(target.embed, context, visible, context_pos, anchor[:, None], pos)[:, 0]  # B,K,D
    base = drafter.base_logits(target.head, hidden)  # [B, K, V]
    prev, drafts, qs, conf = anchor, [], [], []
    for i in range(drafter.block):
        bias, markov = drafter.markov(prev)
        logits = base[:, i] + bias
        conf.append(torch.sigmoid(drafter.confidence(hidden[:, i], markov)))
        if temperature <= 0:
            prev = logits.argmax(-1)
        else:
            q = sampling_logprobs(logits, temperature, top_p).exp()
            prev = invert_cdf(q, uniforms[:, i])
            qs.append(q)
        drafts.append(prev)
    return torch.stack(drafts, 1), (torch.stack(qs, 1) if qs else None), torch.stack(conf, 1)


class DraftContext:
    """The drafter's context rows of every slot: a ring [slots, R, D] (the row of position p at p % R)
    and each entry's position [slots, R] (NOWHERE where there is none), R = the drafter's window plus
    the most tokens a step feeds, so a step's rows never overwrite each other or a row the next
    step reads. Only kept positions are written: a rejected draft's row never enters the ring."""

    NOWHERE = -(1 << 40)  # a position no anchor's window reaches

    def __init__(self, slots: int, window: int, lookahead: int):
        self.slots, self.ring = slots, window + lookahead
        self.rows: Optional[torch.Tensor] = None
        self.pos: Optional[torch.Tensor] = None

    def start(self, slot: int, rows: torch.Tensor, length: int) -> None:
        """A prefilled sequence of `length` tokens takes `slot`: rows [n, D] are its last n positions."""
        if self.rows is None:
            self.rows = rows.new_zeros(self.slots, self.ring, rows.shape[-1])
            self.pos = torch.full((self.slots, self.ring), self.NOWHERE, dtype=torch.long, device=rows.device)
        rows = rows[-self.ring:]
        at = torch.arange(length - rows.shape[0], length, device=rows.device)
        self.pos[slot] = self.NOWHERE
        self.pos[slot, at % self.ring] = at
        self.rows[slot, at % self.ring] = rows.to(self.rows.dtype)

    def add(self, slots: torch.Tensor, rows: torch.Tensor, first: torch.Tensor, keep: torch.Tensor) -> None:
        """rows [B, T, D] of positions first [B] + 0 .. T-1 of `slots` [B]; only the first keep [B]
        of each row are kept."""
        T = rows.shape[1]
        at = first[:, None] + torch.arange(T, device=rows.device)  # [B, T]
        kept = torch.arange(T, device=rows.device) < keep[:, None]  # [B, T]
        ring = at % self.ring
        self.rows[slots[:, None], ring] = torch.where(kept[..., None], rows.to(self.rows.dtype),
                                                      self.rows[slots[:, None], ring])
        self.pos[slots[:, None], ring] = torch.where(kept, at, self.pos[slots[:, None], ring])

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows[slots], self.pos[slots]


@torch.no_grad()
def generate_speculative(model: Transformer, drafter: DSpark, prompts: list[list[int]], max_new_tokens: int,
                         temperature: float = 1.0, top_p: float = 1.0, stop: Optional[set[int]] = None,
                         seed: int = 0, policy_version: int = 0, packed: bool = True,
                         replay: Optional[int] = 128, max_batch: int = 64, draft_length: Optional[int] = None,
                         capacity: float = 256.0, draft_cost: float = 0.1,
                         stats: Optional[SpeculativeStats] = None,
                         prefix_cache: Optional[PrefixCache] = None) -> list[Generation]:
    """`generate`'s contract (inference/generate.py) with speculative decoding: up to max_batch
    sequences decode together from slots, each keeping its own accepted drafts, and a finished
    sequence hands its slot to the next prompt. draft_length: verify this many drafts every step
    (None: `choose_draft_length` with `capacity` and `draft_cost`, one k per step for all rows).
    Greedy output equals `generate`'s; sampled output has its distribution but not its per-prompt
    draws (a row's randomness, its own counter-based stream as in `generate`, is spent on drafts and
    acceptance tests: 2K + 1 draws a step, drawn for every row in one op; with draft_length given, a
    prompt's draws do not depend on its batch neighbours). `prefix_cache` as in `generate`: a prompt
    starts from the longest cached prefix (the drafter's context from the prefix's replayed last
    tokens on), and a finished sequence leaves the tokens its cache consumed (accepted drafts past a
    stop token included)."""
    check_generate_args(prompts, max_new_tokens, max_batch)
    K = drafter.block
    if draft_length is not None and not 0 <= draft_length <= K:
        raise ValueError(f"draft_length={draft_length}: expected 0..{K}")
    device = next(model.parameters()).device
    model.eval()
    drafter.eval()
    stats = stats if stats is not None else SpeculativeStats()
    n_layers = len(model.layers)
    out = [Generation(policy_version=policy_version) for _ in prompts]
    seeds = torch.tensor(prompt_seeds(seed, len(prompts)), dtype=torch.long, device=device)
    n_slots = min(max_batch, max(len(prompts), 1))
    draws = 2 * K + 1  # a step's uniforms per row: K drafts, up to K acceptance tests, the next token
    slot_seed = torch.zeros(n_slots, dtype=torch.long, device=device)  # the seed of each slot's prompt
    slot_draws = torch.zeros(n_slots, dtype=torch.long, device=device)  # draws its prompt has used
    slots = SlotCache(model, n_slots, packed, lookahead=K + 1)
    context = DraftContext(n_slots, drafter.cfg.window, K + 1)
    last = torch.zeros(n_slots, dtype=torch.long, device=device)  # each slot's anchor
    free = list(range(n_slots))[::-1]
    running: dict[int, int] = {}  # slot -> prompt index
    waiting = deque(range(len(prompts)))
    dtype = drafter.main_proj.weight.dtype
    def prefill(i: int) -> tuple:
        """Prompt i's cache, last logits and drafter context rows."""
        cache, logits = _prefill(model, prompts[i], replay, packed, prefix_cache, device, replay_prefix=True)
        # the positions whose decoder layers ran: the last min(replay, N), or from a cached prefix's
        # replayed tokens to the end
        return cache, logits, drafter.context(rec.take().to(dtype))[0]

    shared = SharedPrefills(prompts, prefill)

    with TapRecorder(model, drafter.taps) as rec:
        while waiting or running:
            while waiting and free:
                i = waiting.popleft()
                (cache, logits, context_rows), reused = shared.take(i)
                out[i].token_layer_passes = 0 if reused else cache.token_layer_passes
                if max_new_tokens == 0:
                    if prefix_cache is not None:
                        prefix_cache.put(list(prompts[i]), cache)
                    continue
                token, logp = sample_rows(logits.float(), temperature, top_p, seeds[i:i + 1],
                                          torch.zeros(1, dtype=torch.long, device=device))
                if _took(out[i], int(token[0]), float(logp[0]), stop, max_new_tokens):
                    if prefix_cache is not None:
                        prefix_cache.put(list(prompts[i]), cache)
                    continue
                slot = free.pop()
                slots.insert(slot, cache)
                context.start(slot, context_rows, cache.length)
                last[slot] = token[0]
                slot_seed[slot], slot_draws[slot] = seeds[i], 1
                running[slot] = i
            if not running:
                continue
            busy = sorted(running)
            rows = to_device(busy, device)
            u = None
            if temperature > 0:  # [B, 2K + 1]: each row's next draws from its own stream
                counters = slot_draws[rows][:, None] + torch.arange(draws, device=device)
                u = uniform_draws(slot_seed[rows][:, None], counters)
                slot_draws[rows] += draws
            position = slots.pos[rows]  # [B]
            ctx, ctx_pos = context.read(rows)
            if draft_length == 0:  # plain decoding through this path: nothing to propose
                drafts, q, k = last[rows][:, None], None, 0
            else:
                drafts, q, conf = propose(drafter, model, ctx, ctx_pos, last[rows], position, temperature,
                                          top_p, None if u is None else u[:, :K])
                k = choose_draft_length(conf, capacity, draft_cost) if draft_length is None else draft_length
            k = min(k, max(max_new_tokens - len(out[running[s]].tokens) for s in busy) - 1)
            fed = torch.cat((last[rows][:, None], drafts[:, :k]), dim=1)  # [B, k + 1]
            slots.begin(busy, fed)
            with decode_experts(model):
                logits = model(fed, shard=slots).logits.float()  # [B, k + 1, V]
            taps = rec.take()
            if temperature <= 0:
                n, nxt = accept_drafts(logits, None, drafts[:, :k], None)
                logps = logits.log_softmax(-1)
            else:
                logps = sampling_logprobs(logits, temperature, top_p)
                probs = logps.exp()
                n, nxt = accept_drafts(probs, probs[:, :0] if q is None else q[:, :k], drafts[:, :k],
                                       u[:, K:K + k + 1])
            keep = n + 1
            emitted = torch.cat((drafts[:, :k], nxt[:, None]), dim=1)  # row r emits its first n_r, then nxt
            emitted.scatter_(1, n[:, None], nxt[:, None])
            lps = logps.gather(-1, emitted[..., None])[..., 0]  # [B, k + 1]
            # one read back per step: the host needs each row's length (pages, read widths)
            host = torch.cat((keep[:, None], emitted), dim=1).tolist()
            kept_host = [h[0] for h in host]
            slots.end(fed, kept_host)
            context.add(rows, drafter.context(taps.to(dtype)), position, keep)
            last[rows] = nxt
            stats.verifications += k > 0
            stats.plain_steps += k == 0
            stats.drafted += k * len(busy)
            stats.accepted += sum(kept_host) - len(busy)
            stats.rows += len(busy)
            for s, kept, tokens, logp in zip(busy, kept_host, (h[1:] for h in host), lps.tolist()):
                gen = out[running[s]]
                gen.token_layer_passes += (k + 1) * n_layers
                before = len(gen.tokens)
                if any(_took(gen, t, lp, stop, max_new_tokens) for t, lp in zip(tokens[:kept], logp[:kept])):
                    if prefix_cache is not None:  # the cache holds the kept drafts, a stop cut or not
                        cache = slots.extract(s)
                        fed = list(prompts[running[s]]) + gen.tokens[:before] + tokens[:kept]
                        prefix_cache.put(fed[:cache.length], cache)
                    slots.release(s)
                    free.append(s)
                    del running[s]
    return out


def _took(gen: Generation, token: int, logp: float, stop: Optional[set[int]], max_new_tokens: int) -> bool:
    """Record a token; True when the generation is over (later tokens of the step are dropped)."""
    gen.tokens.append(token)
    gen.logprobs.append(logp)
    if stop and token in stop:
        gen.finish = "stop"
        return True
    return len(gen.tokens) == max_new_tokens
