"""Prefill, decode and sampling: prompts are prefilled one by one into a DecodeCache, then decoded
together from a SlotCache (continuous batching).

`generate` returns, per prompt, the new tokens and the log-probability of each under the
distribution it was sampled from (temperature and top-p applied), as RL needs them.
"""
from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from inference.cache import DecodeCache
from inference.graphs import DecodeStep
from inference.prefix import PrefixCache
from inference.slots import SlotCache, to_device
from model.transformer import Transformer
from model.vision import ImageBatch


@dataclass
class Generation:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str = "length"  # length | stop
    policy_version: int = 0
    token_layer_passes: int = 0  # prefill and decode work, in tokens x layers


@torch.no_grad()
def forward_new(model: Transformer, cache: DecodeCache, input_ids: torch.Tensor,
                token_types: Optional[torch.Tensor] = None,
                images: Optional[ImageBatch] = None) -> torch.Tensor:
    """Run input_ids [B, T] after the cached prefix -> logits [B, T, V] (fp32); the cache grows.
    token_types / images: image spans among the new tokens (model.Transformer.forward)."""
    cache.begin(input_ids)
    logits = model(input_ids, shard=cache, token_types=token_types, images=images).logits
    cache.end(input_ids)
    cache.token_layer_passes += input_ids.shape[1] * len(model.layers)
    return logits


@torch.no_grad()
def prefill_ced(model: Transformer, cache: DecodeCache, input_ids: torch.Tensor,
                replay: int = 128) -> torch.Tensor:
    """CED prefill of input_ids [B, N] into an empty cache: encoder over all N tokens, decoder over
    the last min(replay, N) (docs/ARCHITECTURE.md §2) -> logits [B, R, V] of those positions. Counts
    token-layer passes in cache.token_layer_passes."""
    N = input_ids.shape[1]
    n_enc = model.plan.n_encoder_layers
    cache.begin(input_ids)
    logits = model.forward_ced(input_ids, replay, shard=cache)
    cache.end(input_ids)
    cache.token_layer_passes += N * n_enc + min(replay, N) * (len(model.layers) - n_enc)
    return logits


def sampling_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """logits [..., V] -> log-probabilities [..., V] of the distribution sampling draws from at
    temperature > 0 (temperature, then the top_p nucleus)."""
    logp = (logits / temperature).log_softmax(-1)
    if top_p < 1.0:  # keep the smallest prefix of the sorted distribution that reaches top_p
        sorted_logp, order = logp.sort(-1, descending=True)
        keep = sorted_logp.exp().cumsum(-1) - sorted_logp.exp() < top_p
        masked = torch.full_like(logp, float("-inf")).scatter(-1, order,
                                                              sorted_logp.masked_fill(~keep, float("-inf")))
        logp = masked.log_softmax(-1)
    return logp


_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply, full avalanche) of x in [0, 2^32), on int64
    tensors: the multiplier is below 2^28, so no product leaves int64's range."""
    for _ in range(2):
        x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)


def prompt_seeds(seed: int, n: int) -> list[int]:
    """The stream seed of each of n prompts (>= 0, as `uniform_draws` needs): prompt i's draws in
    `generate` and in speculative decoding come from the same stream."""
    return [(seed * 1_000_003 + i) % 2**63 for i in range(n)]


def uniform_draws(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """The counters[b]-th uniform draw of the stream seeded by seeds[b] (int64 [B] each, seeds
    >= 0) -> float64 [B] in (0, 1), 32 bits each. A counter-based generator: a draw depends on
    its row's seed and counter only, so every row of a batch draws in one op, and a sequence's
    draws do not depend on what it is batched with."""
    lo, hi = seeds & _MASK32, (seeds >> 32) & _MASK32
    h = _mix32(lo ^ _mix32(hi ^ _mix32(counters & _MASK32)))
    return (h.double() + 0.5) * 2.0**-32


def sample_rows(logits: torch.Tensor, temperature: float, top_p: float, seeds: torch.Tensor,
                counters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampling for a batch in a fixed number of ops (no per-row loop, no host sync): row b
    inverts the CDF of its sampling distribution at its draw uniform_draws(seeds, counters)[b].
    logits [B, V] -> (token ids [B], their log-probabilities under the sampled distribution [B]).
    temperature 0 is greedy (the log-probability of the argmax under the plain softmax)."""
    if temperature <= 0:
        token = logits.argmax(-1)
        return token, logits.log_softmax(-1).gather(-1, token[:, None])[:, 0]
    logp = sampling_logprobs(logits, temperature, top_p)
    token = invert_cdf(logp.double().exp(), uniform_draws(seeds, counters))
    return token, logp.gather(-1, token[:, None])[:, 0]


def invert_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row b's draw at the uniform u[b] in (0, 1) from the distribution proportional to weights[b]
    (>= 0, [B, V]) -> token ids [B]: the first column whose cumulative weight exceeds u[b] times the
    row's total, so a column of weight 0 never comes. fp64, so the last columns still step."""
    cdf = weights.double().cumsum(-1)  # [B, V]
    token = torch.searchsorted(cdf, (u.double() * cdf[:, -1])[:, None], right=True)[:, 0]
    return token.clamp_(max=weights.shape[-1] - 1)


def _prefill(model: Transformer, prompt: list[int], replay: Optional[int], packed: bool,
             prefix_cache: Optional[PrefixCache], device,
             vision: Optional[tuple[list[int], ImageBatch]] = None,
             replay_prefix: bool = False) -> tuple[DecodeCache, torch.Tensor]:
    """A 1-sequence cache holding `prompt` and the logits [1, V] after its last token: from the
    longest cached prefix when there is one, else CED prefill (or a plain forward: replay=None).
    `vision`: the prompt's token types and images, prefilled by one plain forward over every layer
    (image spans must lie in one forward, and CED's bounded replay reads token ids only).
    `replay_prefix`: a prefix-cache hit also replays the prefix's last `replay` (or 128) tokens
    through every layer, for a caller that reads the layers' outputs there."""
    ids = to_device([prompt], device)
    if vision is not None:
        types, images = vision
        cache = DecodeCache(1, packed=packed)
        return cache, forward_new(model, cache, ids, torch.tensor([types], device=device),
                                  images.to(device))[:, -1]
    hit = prefix_cache.longest_prefix(prompt) if prefix_cache is not None else None
    if hit is not None:
        prefix_cache.hits += 1
        cache = prefix_cache.restore(model, hit, packed, device, (replay or 128) if replay_prefix else None)
        return cache, forward_new(model, cache, ids[:, len(hit):])[:, -1]
    if prefix_cache is not None:
        prefix_cache.misses += 1
    cache = DecodeCache(1, packed=packed)
    if replay is None:
        return cache, forward_new(model, cache, ids)[:, -1]
    return cache, prefill_ced(model, cache, ids, replay)[:, -1]


class SharedPrefills:
    """A prompt that occurs more than once in a call (an RL group's samples of one prompt) is
    prefilled once: its prefill (the cache and the last position's logits) is kept until the
    prompt's last copy has taken it. A slot copies the cache it takes, so the copies decode apart;
    each draws from its own stream. Exact: the copies start from the state a prefill of their own
    would compute."""

    def __init__(self, prompts: list[list[int]], prefill: Callable[[int], Any], enabled: bool = True):
        self.prompts, self.prefill = prompts, prefill
        self.left = Counter(tuple(p) for p in prompts) if enabled else Counter()
        self.kept: dict[tuple[int, ...], Any] = {}

    def take(self, i: int) -> tuple[Any, bool]:
        """(prompt i's prefill, whether an earlier copy's was reused): `prefill(i)` runs for the first."""
        key = tuple(self.prompts[i])
        reused = key in self.kept
        value = self.kept[key] if reused else self.prefill(i)
        self.left[key] -= 1
        if self.left[key] > 0:
            self.kept[key] = value
        else:
            self.kept.pop(key, None)
        return value, reused


def check_generate_args(prompts: list[list[int]], max_new_tokens: int, max_batch: int) -> None:
    """What every decoder refuses (`generate`, inference/speculative.py), in one line each."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 0")
    if max_batch < 1:
        raise ValueError(f"max_batch={max_batch}: must be >= 1")
    if any(not p for p in prompts):
        raise ValueError("an empty prompt: there is no position to predict from")


class _Rows:
    """The sampling state of every slot on the device: the stream each row draws from, how many
    tokens it drew, the token it feeds next, every token it drew (with its log-probability), and
    whether it drew one of the stop ids; read back to the host only when the loop needs them."""

    def __init__(self, slots: int, max_new_tokens: int, temperature: float, top_p: float, device):
        self.temperature, self.top_p, self.width = temperature, top_p, max(max_new_tokens, 1)
        self.seed = torch.zeros(slots, dtype=torch.long, device=device)
        self.drawn = torch.zeros(slots, dtype=torch.long, device=device)
        self.last = torch.zeros(slots, dtype=torch.long, device=device)
        self.tokens = torch.zeros(slots, self.width, dtype=torch.long, device=device)
        self.logps = torch.zeros(slots, self.width, dtype=torch.float32, device=device)
        self.ended = torch.zeros(slots, dtype=torch.bool, device=device)
        self.is_stop: Optional[torch.Tensor] = None  # [V] the call's stop ids (None: none flagged)

    def set_stop(self, stop: Optional[set[int]], vocab: int) -> None:
        """A call's stop ids, as a mask over the vocabulary that each step reads: written in place,
        since captured steps hold it (so it exists before a step is captured)."""
        if self.is_stop is None:
            self.is_stop = torch.zeros(vocab, dtype=torch.bool, device=self.ended.device)
        self.is_stop.zero_()
        ids = [t for t in stop or () if 0 <= t < vocab]  # others are never drawn
        if ids:
            self.is_stop[to_device(ids, self.ended.device)] = True

    def feed(self, rows: torch.Tensor) -> torch.Tensor:
        return self.last[rows][:, None]  # [B, 1]

    def post(self, logits: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw each row's next token from logits [B, V] and record it (rows are distinct)."""
        drawn = self.drawn[rows]
        token, logp = sample_rows(logits.float(), self.temperature, self.top_p, self.seed[rows], drawn)
        col = drawn.clamp(max=self.width - 1)  # padding rows of a step may have drawn any number
        self.tokens[rows, col] = token
        self.logps[rows, col] = logp
        self.drawn[rows] = drawn + 1
        self.last[rows] = token
        if self.is_stop is not None:
            self.ended[rows] = self.ended[rows] | self.is_stop[token]
        return token, logp

    def start(self, slot: int, seed: int, logits: torch.Tensor) -> None:
        """A prefilled sequence takes `slot`: its first token from the prefill's logits [1, V]."""
        self.seed[slot] = seed
        self.drawn[slot] = 0
        self.ended[slot] = False
        rows = torch.full((1,), slot, dtype=torch.long, device=logits.device)
        self.post(logits, rows)


class _EndedWatch:
    """Which slots drew a stop token, known on the host without waiting for each step: after a step,
    a copy of the device's flags goes to pinned memory behind it, and the host takes it once it has
    landed (one copy in flight). On the CPU the flags are read at once.

    The host also stays at most `lead` steps ahead of the device: before it goes on, it waits for
    the step `lead` back to finish. Without that bound a host that only replays CUDA graphs runs
    tens of steps ahead, the flags land that late, and finished sequences keep decoding and hold
    their slots, more steps than polling every 16 would cost. With it a flag is read at most
    lead + 1 steps after its step, while the device still has `lead` steps queued, so it does not
    idle. That wait has a deadline, `hung_s`: a step still queued after it means a hung device,
    which raises instead of holding the rollout worker forever."""

    def __init__(self, ended: torch.Tensor, lead: int = 2, hung_s: float = 300.0):
        self.ended, self.cuda, self.lead, self.hung_s = ended, ended.is_cuda, lead, hung_s
        self.host = torch.zeros(ended.shape, dtype=torch.bool, pin_memory=self.cuda)
        self.copied: Optional[torch.cuda.Event] = None
        self.steps: deque = deque()  # an event after each step still in the queue

    def after_step(self) -> None:
        if not self.cuda:
            return
        copying = self.copied is None
        if copying:
            self.host.copy_(self.ended, non_blocking=True)
        done = torch.cuda.Event()
        done.record()  # after the step, and after the copy when one was queued
        if copying:
            self.copied = done
        self.steps.append(done)
        if len(self.steps) > self.lead:
            self._wait(self.steps.popleft())

    def _wait(self, step: torch.cuda.Event) -> None:
        # polled rather than Event.synchronize(), which has no timeout; a step takes milliseconds
        deadline = time.monotonic() + self.hung_s
        while not step.query():
            if time.monotonic() > deadline:
                raise TimeoutError(f"a decode step queued {self.lead} steps back has not finished on "
                                   f"{self.ended.device} after {self.hung_s:.0f} s: the device looks hung")
            time.sleep(20e-6)

    def take(self) -> list[int]:
        """The slots flagged in the newest copy that has landed (none when none has)."""
        if not self.cuda:
            return self.ended.nonzero()[:, 0].tolist()
        if self.copied is None or not self.copied.query():
            return []
        self.copied = None
        return self.host.nonzero()[:, 0].tolist()


class DecodeEngines:
    """generate()'s decode state, kept across calls by a caller that generates again and again with
    one model (a rollout worker, every policy version): per setting (slots, packed cache, max new
    tokens, temperature, top-p, graphs, compile), the slot cache, the sampling rows and the decode step with
    the CUDA graphs it captured. A call whose setting an earlier call had reuses them, so its steps
    replay those graphs instead of running each shape eagerly and capturing it again. The graphs read
    the weights where they are: load new weights in place (`load_state_dict`), never by replacing
    the parameters. What a setting keeps (its cache pages, rows and graph pool) stays allocated
    until this object goes. A call that raised may leave slots taken: the next call's inserts take
    them over whole (`SlotCache.insert` resets a slot's state, and its pages go back at release)."""

    def __init__(self, model: Transformer):
        self.model = model
        self._kept: dict[tuple, tuple[SlotCache, _Rows, DecodeStep]] = {}

    def take(self, slots: int, packed: bool, max_new_tokens: int, temperature: float, top_p: float,
             graphs: Optional[bool], compile: Optional[str] = None) -> tuple[SlotCache, _Rows, DecodeStep]:
        key = (slots, packed, max(max_new_tokens, 1), temperature, top_p, graphs, compile)
        if key not in self._kept:
            device = next(self.model.parameters()).device
            cache = SlotCache(self.model, slots, packed)
            rows = _Rows(slots, max_new_tokens, temperature, top_p, device)
            step = DecodeStep(self.model, cache, rows.feed, rows.post, graphs=graphs, compile=compile)
            self._kept[key] = (cache, rows, step)
        return self._kept[key]

    def __len__(self) -> int:
        return len(self._kept)


def _cut(tokens: list[int], stop: Optional[set[int]]) -> tuple[int, bool]:
    """How many of tokens a generation keeps: up to and including the first stop token."""
    if stop:
        for k, t in enumerate(tokens):
            if t in stop:
                return k + 1, True
    return len(tokens), False


@torch.no_grad()
def generate(model: Transformer, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
             top_p: float = 1.0, stop: Optional[set[int]] = None, seed: int = 0,
             policy_version: int = 0, packed: bool = True, replay: Optional[int] = 128,
             prefix_cache: Optional[PrefixCache] = None, max_batch: int = 64,
             vision: Optional[list[Optional[tuple[list[int], ImageBatch]]]] = None,
             graphs: Optional[bool] = None, check_every: Optional[int] = None,
             engines: Optional[DecodeEngines] = None, compile: Optional[str] = None) -> list[Generation]:
    """Continuous batching: up to `max_batch` sequences decode together, one token each per
    forward (inference/slots.py); a finished sequence frees its slot for the next waiting prompt,
    which is prefilled on its own first. Prompt i draws from its own counter-based stream (seeded
    by `seed` and i, `sample_rows`), so its tokens do not depend on max_batch or on the other prompts.

    `packed`: the cache stores FP4 / MXFP4 / FP8 (inference/cache.py). `replay`: CED prefill with
    bounded replay of that many tokens (None: every layer over the whole prompt). `prefix_cache`:
    prompts that extend a finished sequence reuse its global KV (agent loops: the same
    conversation plus new tool output), and every finished sequence is offered to it. `vision[i]`:
    prompt i's token types and images (None: text), prefilled by `_prefill`'s plain forward. A text
    prompt given more than once is prefilled once (`SharedPrefills`; its copies count no prefill
    token-layer passes).
    `graphs`: replay each decode step from a CUDA graph (inference/graphs.py); None: on for a CUDA
    model, False runs every step eagerly (the reference the graphs are tested against). `compile`: a
    torch.compile backend ("inductor") the decode step's forward runs through before it is captured.
    `engines`: decode state kept across calls with this model (`DecodeEngines`); None: the call's own.

    Sampled tokens stay on the device. The host reads a sequence's tokens when it reaches
    max_new_tokens (it knows when without looking) and when it drew a stop token: the device flags
    that in the step, the flags go to the host behind each step and are read once they have landed,
    without waiting for the device (`_EndedWatch`), so a sequence runs a step or two past its stop
    token (those tokens are dropped) and its slot goes to the next prompt. `check_every`: it also
    reads every running sequence every that many steps (1: after every token). With both `stop` and
    `prefix_cache` it looks after every token, so the cache offered holds exactly the tokens kept."""
    check_generate_args(prompts, max_new_tokens, max_batch)
    if check_every is not None and check_every < 1:
        raise ValueError(f"check_every={check_every}: must be >= 1")
    device = next(model.parameters()).device
    model.eval()
    n_layers = len(model.layers)
    out = [Generation(policy_version=policy_version) for _ in prompts]
    seeds = prompt_seeds(seed, len(prompts))
    n_slots = min(max_batch, max(len(prompts), 1))
    if engines is None:
        engines = DecodeEngines(model)
    elif engines.model is not model:
        raise ValueError("generate: `engines` holds another model's decode state")
    slots, rows, step = engines.take(n_slots, packed, max_new_tokens, temperature, top_p, graphs, compile)
    if stop and prefix_cache is not None:
        check_every = 1
    rows.set_stop(stop, model.cfg.vocab_size)
    watch = _EndedWatch(rows.ended) if stop and check_every != 1 else None
    free = list(range(n_slots))[::-1]
    running: dict[int, int] = {}  # slot -> prompt index
    drawn = [0] * len(prompts)  # tokens drawn per prompt (the host knows without reading them)
    prefill_passes = [0] * len(prompts)
    waiting = deque(range(len(prompts)))

    def close(slot: int, i: int, tokens: list[int], logps: list[float]) -> bool:
        """Keep what prompt i drew so far if its generation is over (a stop token, or all of
        max_new_tokens); then it leaves its slot. True when it did."""
        keep, stopped = _cut(tokens, stop)
        if not stopped and len(tokens) < max_new_tokens:
            return False
        gen = out[i]
        gen.tokens, gen.logprobs = tokens[:keep], logps[:keep]
        gen.finish = "stop" if stopped else "length"
        gen.token_layer_passes = prefill_passes[i] + (keep - 1) * n_layers
        if prefix_cache is not None:  # the last token was never fed
            cache = slots.extract(slot)
            prefix_cache.put((list(prompts[i]) + gen.tokens)[:cache.length], cache)
        slots.release(slot)
        free.append(slot)
        del running[slot]
        return True

    def check(busy: list[int]) -> None:
        """Read the tokens of the running sequences in slots `busy` (one transfer) and end those
        that are over."""
        if not busy:
            return
        at = torch.tensor(busy, device=device)
        width = max(drawn[running[s]] for s in busy)
        tokens, logps = rows.tokens[at, :width].tolist(), rows.logps[at, :width].tolist()
        for b, s in enumerate(busy):
            n = drawn[running[s]]
            close(s, running[s], tokens[b][:n], logps[b][:n])

    shared = SharedPrefills(prompts, lambda i: _prefill(model, prompts[i], replay, packed, prefix_cache,
                                                        device, vision[i] if vision is not None else None),
                            enabled=vision is None)
    since = 0
    while waiting or running:
        while waiting and free:
            i = waiting.popleft()
            (cache, logits), reused = shared.take(i)
            prefill_passes[i] = out[i].token_layer_passes = 0 if reused else cache.token_layer_passes
            if max_new_tokens == 0:
                if prefix_cache is not None:
                    prefix_cache.put(list(prompts[i])[:cache.length], cache)
                continue
            slot = free.pop()
            rows.start(slot, seeds[i], logits.float())
            drawn[i] = 1
            if max_new_tokens == 1 or check_every == 1:  # look at the first token now
                token, logp = int(rows.tokens[slot, 0]), float(rows.logps[slot, 0])
                stopped = _cut([token], stop)[1]
                if stopped or max_new_tokens == 1:  # over before its first step
                    gen = out[i]
                    gen.tokens, gen.logprobs, gen.finish = [token], [logp], "stop" if stopped else "length"
                    if prefix_cache is not None:
                        prefix_cache.put((list(prompts[i]) + gen.tokens)[:cache.length], cache)
                    free.append(slot)
                    continue
            slots.insert(slot, cache)
            running[slot] = i
        if not running:
            continue
        busy = sorted(running)
        step(busy)
        for s in busy:
            drawn[running[s]] += 1
        since += 1
        if stop and check_every is not None and since >= check_every:
            check(sorted(running))
            since = 0
            continue
        look = {s for s in busy if drawn[running[s]] == max_new_tokens}
        if watch is not None:
            look.update(s for s in watch.take() if s in running)
            watch.after_step()
        check(sorted(look))
    return out
