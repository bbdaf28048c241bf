"""Prefill, decode and sampling over a DecodeCache.

`generate` returns, per prompt, the new tokens and the log-probability of each under the
distribution it was sampled from (temperature and top-p applied), as RL needs them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from model.transformer import Transformer
from rl.engine.cache import DecodeCache
from rl.engine.prefix import PrefixCache


@dataclass
class Generation:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str = "length"  # length | stop
    policy_version: int = 0
    token_layer_passes: int = 0  # prefill and decode work, in tokens x layers


@torch.no_grad()
def forward_new(model: Transformer, cache: DecodeCache, input_ids: torch.Tensor) -> torch.Tensor:
    """Run input_ids [B, T] after the cached prefix -> logits [B, T, V] (fp32); the cache grows."""
    cache.begin(input_ids)
    logits = model(input_ids, shard=cache).logits
    cache.end(input_ids)
    cache.token_layer_passes += input_ids.shape[1] * len(model.layers)
    return logits


@torch.no_grad()
def prefill_ced(model: Transformer, cache: DecodeCache, input_ids: torch.Tensor, replay: int = 128) -> torch.Tensor:
    """CED prefill of input_ids [B, N] into an empty cache: encoder over all N tokens, decoder over
    the last min(replay, N) (SPEC §2) -> logits [B, R, V] of those positions. Counts token-layer
    passes in cache.token_layer_passes."""
    N = input_ids.shape[1]
    n_enc = model.plan.n_encoder_layers
    cache.begin(input_ids)
    logits = model.forward_ced(input_ids, replay, shard=cache)
    cache.end(input_ids)
    cache.token_layer_passes += N * n_enc + min(replay, N) * (len(model.layers) - n_enc)
    return logits


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator):
    """logits [B, V] -> (token ids [B], their log-probabilities under the sampled distribution [B]).
    temperature 0 is greedy (log-probability of the argmax under the plain softmax)."""
    if temperature <= 0:
        token = logits.argmax(-1)
        return token, logits.log_softmax(-1).gather(-1, token[:, None])[:, 0]
    logp = (logits / temperature).log_softmax(-1)
    if top_p < 1.0:  # keep the smallest prefix of the sorted distribution that reaches top_p
        sorted_logp, order = logp.sort(-1, descending=True)
        keep = sorted_logp.exp().cumsum(-1) - sorted_logp.exp() < top_p
        masked = torch.full_like(logp, float("-inf")).scatter(-1, order, sorted_logp.masked_fill(~keep, float("-inf")))
        logp = masked.log_softmax(-1)
    token = torch.multinomial(logp.exp(), 1, generator=generator)[:, 0]
    return token, logp.gather(-1, token[:, None])[:, 0]


@torch.no_grad()
def generate(model: Transformer, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
             top_p: float = 1.0, stop: Optional[set[int]] = None, seed: int = 0,
             policy_version: int = 0, packed: bool = True, replay: Optional[int] = 128,
             prefix_cache: Optional[PrefixCache] = None) -> list[Generation]:
    """Each prompt is prefilled once, then decoded a token at a time from the cache
    (`packed`: the cache stores FP4 / MXFP4 / FP8, see rl/engine/cache.py). `replay`: CED
    prefill with bounded replay of that many tokens (None: every layer over the whole prompt).
    `prefix_cache`: prompts that extend a finished sequence reuse its global KV (agent loops:
    the same conversation plus new tool output), and every finished sequence is offered to it."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 0")
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    model.eval()
    out = []
    for prompt in prompts:
        if not prompt:
            raise ValueError("an empty prompt: there is no position to predict from")
        ids = torch.tensor([prompt], device=device)
        hit = prefix_cache.longest_prefix(prompt) if prefix_cache is not None else None
        if hit is not None:
            prefix_cache.hits += 1
            cache = prefix_cache.restore(model, hit, replay or 128, packed, device)
            logits = forward_new(model, cache, ids[:, len(hit):])[:, -1]
        else:
            if prefix_cache is not None:
                prefix_cache.misses += 1
            cache = DecodeCache(1, packed=packed)
            if replay is None:
                logits = forward_new(model, cache, ids)[:, -1]
            else:
                logits = prefill_ced(model, cache, ids, replay)[:, -1]
        gen = Generation(policy_version=policy_version)
        for _ in range(max_new_tokens):
            token, logp = sample(logits.float(), temperature, top_p, generator)
            gen.tokens.append(int(token))
            gen.logprobs.append(float(logp))
            if stop and int(token) in stop:
                gen.finish = "stop"
                break
            if len(gen.tokens) == max_new_tokens:  # nothing left to predict: the last token is not fed
                break
            logits = forward_new(model, cache, token[:, None])[:, -1]
        gen.token_layer_passes = cache.token_layer_passes
        if prefix_cache is not None:
            prefix_cache.put((list(prompt) + gen.tokens)[:cache.length], cache)
        out.append(gen)
    return out
