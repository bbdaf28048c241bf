"""Prefill, decode and sampling: prompts are prefilled one by one into a DecodeCache, then decoded
together from a SlotCache (continuous batching).

`generate` returns, per prompt, the new tokens and the log-probability of each under the
distribution it was sampled from (temperature and top-p applied), as RL needs them.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import torch

from inference.cache import DecodeCache
from inference.prefix import PrefixCache
from inference.slots import SlotCache
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
    """logits [..., V] -> log-probabilities [..., V] of the distribution `sample` draws from at
    temperature > 0 (temperature, then the top_p nucleus)."""
    logp = (logits / temperature).log_softmax(-1)
    if top_p < 1.0:  # keep the smallest prefix of the sorted distribution that reaches top_p
        sorted_logp, order = logp.sort(-1, descending=True)
        keep = sorted_logp.exp().cumsum(-1) - sorted_logp.exp() < top_p
        masked = torch.full_like(logp, float("-inf")).scatter(-1, order,
                                                              sorted_logp.masked_fill(~keep, float("-inf")))
        logp = masked.log_softmax(-1)
    return logp


def sample(logits: torch.Tensor, temperature: float, top_p: float, generators: list[torch.Generator]):
    """logits [B, V] -> (token ids [B], their log-probabilities under the sampled distribution [B]).
    Row b draws from generators[b] (a sequence's draws do not depend on what it is batched with).
    temperature 0 is greedy (log-probability of the argmax under the plain softmax)."""
    if temperature <= 0:
        token = logits.argmax(-1)
        return token, logits.log_softmax(-1).gather(-1, token[:, None])[:, 0]
    logp = sampling_logprobs(logits, temperature, top_p)
    probs = logp.exp()
    token = torch.cat([torch.multinomial(probs[b:b + 1], 1, generator=g)[0]
                       for b, g in enumerate(generators)])
    return token, logp.gather(-1, token[:, None])[:, 0]


def _prefill(model: Transformer, prompt: list[int], replay: Optional[int], packed: bool,
             prefix_cache: Optional[PrefixCache], device,
             vision: Optional[tuple[list[int], ImageBatch]] = None) -> tuple[DecodeCache, torch.Tensor]:
    """A 1-sequence cache holding `prompt` and the logits [1, V] after its last token: from the
    longest cached prefix when there is one, else CED prefill (or a plain forward: replay=None).
    `vision`: the prompt's token types and images, prefilled by one plain forward over every layer
    (image spans must lie in one forward, and CED's bounded replay reads token ids only)."""
    ids = torch.tensor([prompt], device=device)
    if vision is not None:
        types, images = vision
        cache = DecodeCache(1, packed=packed)
        return cache, forward_new(model, cache, ids, torch.tensor([types], device=device),
                                  images.to(device))[:, -1]
    hit = prefix_cache.longest_prefix(prompt) if prefix_cache is not None else None
    if hit is not None:
        prefix_cache.hits += 1
        cache = prefix_cache.restore(model, hit, replay or 128, packed, device)
        return cache, forward_new(model, cache, ids[:, len(hit):])[:, -1]
    if prefix_cache is not None:
        prefix_cache.misses += 1
    cache = DecodeCache(1, packed=packed)
    if replay is None:
        return cache, forward_new(model, cache, ids)[:, -1]
    return cache, prefill_ced(model, cache, ids, replay)[:, -1]


def check_generate_args(prompts: list[list[int]], max_new_tokens: int, max_batch: int) -> None:
    """What every decoder refuses (`generate`, inference/speculative.py), in one line each."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 0")
    if max_batch < 1:
        raise ValueError(f"max_batch={max_batch}: must be >= 1")
    if any(not p for p in prompts):
        raise ValueError("an empty prompt: there is no position to predict from")


@torch.no_grad()
def generate(model: Transformer, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
             top_p: float = 1.0, stop: Optional[set[int]] = None, seed: int = 0,
             policy_version: int = 0, packed: bool = True, replay: Optional[int] = 128,
             prefix_cache: Optional[PrefixCache] = None, max_batch: int = 64,
             vision: Optional[list[Optional[tuple[list[int], ImageBatch]]]] = None) -> list[Generation]:
    """Continuous batching: up to `max_batch` sequences decode together, one token each per
    forward (inference/slots.py); a finished sequence frees its slot for the next waiting prompt,
    which is prefilled on its own first. Prompt i samples from its own generator (seeded by
    `seed` and i), so its tokens do not depend on max_batch or on the other prompts.

    `packed`: the cache stores FP4 / MXFP4 / FP8 (inference/cache.py). `replay`: CED prefill with
    bounded replay of that many tokens (None: every layer over the whole prompt). `prefix_cache`:
    prompts that extend a finished sequence reuse its global KV (agent loops: the same
    conversation plus new tool output), and every finished sequence is offered to it. `vision[i]`:
    prompt i's token types and images (None: text), prefilled by `_prefill`'s plain forward."""
    check_generate_args(prompts, max_new_tokens, max_batch)
    device = next(model.parameters()).device
    model.eval()
    n_layers = len(model.layers)
    out = [Generation(policy_version=policy_version) for _ in prompts]
    generators = [torch.Generator(device=device).manual_seed((seed * 1_000_003 + i) % 2**63)
                  for i in range(len(prompts))]
    slots = SlotCache(model, min(max_batch, max(len(prompts), 1)), packed)
    free = list(range(slots.slots))[::-1]
    running: dict[int, int] = {}  # slot -> prompt index
    last: dict[int, int] = {}  # slot -> the sampled token it feeds next
    waiting = deque(range(len(prompts)))

    def took(i: int, token: torch.Tensor, logp: torch.Tensor) -> bool:
        """Record a sampled token of prompt i; True when its generation is over."""
        gen = out[i]
        gen.tokens.append(int(token))
        gen.logprobs.append(float(logp))
        if stop and gen.tokens[-1] in stop:
            gen.finish = "stop"
            return True
        return len(gen.tokens) == max_new_tokens  # nothing left to predict: the last token is not fed

    def offer(i: int, cache: DecodeCache) -> None:
        if prefix_cache is not None:
            prefix_cache.put((list(prompts[i]) + out[i].tokens)[:cache.length], cache)

    while waiting or running:
        while waiting and free:
            i = waiting.popleft()
            cache, logits = _prefill(model, prompts[i], replay, packed, prefix_cache, device,
                                     vision[i] if vision is not None else None)
            out[i].token_layer_passes = cache.token_layer_passes
            if max_new_tokens == 0:
                offer(i, cache)
                continue
            token, logp = sample(logits.float(), temperature, top_p, [generators[i]])
            if took(i, token[0], logp[0]):
                offer(i, cache)
                continue
            slot = free.pop()
            slots.insert(slot, cache)
            running[slot], last[slot] = i, int(token[0])
        if not running:
            continue
        busy = sorted(running)
        ids = torch.tensor([[last[s]] for s in busy], device=device)  # [B, 1]
        slots.begin(busy, ids)
        logits = model(ids, shard=slots).logits[:, -1]
        slots.end(ids)
        tokens, logps = sample(logits.float(), temperature, top_p, [generators[running[s]] for s in busy])
        for b, s in enumerate(busy):
            i = running[s]
            out[i].token_layer_passes += n_layers
            last[s] = int(tokens[b])
            if took(i, tokens[b], logps[b]):
                if prefix_cache is not None:
                    offer(i, slots.extract(s))
                slots.release(s)
                free.append(s)
                del running[s], last[s]
    return out
