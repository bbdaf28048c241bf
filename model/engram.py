"""Engram: hashed n-gram memory applied before layers 1 and 14 (SPEC §5, §11).

For each position t and each order n in `engram_orders`, the n lookup ids ending at t are hashed by
`engram_heads` independent heads, each into its own prime-sized table; every head reads one
`engram_dim` row. The 6,144-d concatenation goes through ONE linear to a key per residual stream and
a shared value; a per-stream gate decides how much of the value each stream takes.

Decisions the spec leaves open:
* Lookup ids come from the tokenizer compression map: NFKC -> NFD -> drop combining marks (Unicode
  category Mn) -> lowercase -> whitespace runs to ONE space. Leading/trailing whitespace is collapsed,
  never stripped, so " hello" (word start) stays distinct from "hello" (word piece). Tokens decoding to
  U+FFFD (partial UTF-8 bytes), added/special tokens and tokens whose canonical form is empty keep ids
  of their own.
* Multipliers: odd int64 in [1, 2^31), drawn from a CPU `torch.Generator` seeded with
  `engram_seed * 1_000_003 + layer_id`, shape [orders, heads, max_order] (entries i >= n unused).
  They are a persistent buffer, so a checkpoint carries the hashing its table rows were trained with.
* Gate norms: RMS norms with learnable weights (ones at init), one for the hidden streams and one for
  the keys, each shared by all streams (the per-stream keys already make the gates differ).
* Table layout: one [total_rows, engram_dim] matrix per layer, head k owning rows
  [offset_k, offset_k + prime_k), so it can be sharded by rows and live on another device (host
  memory at full scale) than the rest of the model; `EngramTable.lookup` gathers where the table is
  and returns rows where the caller is.
"""
from __future__ import annotations

import math
import re
import unicodedata

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import nn

from conf.model import ModelConfig
from model.numerics import RMSNorm, wide

GATE_EPS = 1e-6  # floor of |d| under the signed square root of the gate
REPLACEMENT_CHAR = "\ufffd"
_WHITESPACE = re.compile(r"\s+")


# --------------------------------------------------------------------------- table sizes
def _primes_upto(n: int) -> np.ndarray:
    """All primes <= n (plain sieve; only used for the base primes <= sqrt(hi))."""
    sieve = np.ones(n + 1, dtype=bool)
    sieve[:2] = False
    for p in range(2, math.isqrt(n) + 1):
        if sieve[p]:
            sieve[p * p::p] = False
    return np.flatnonzero(sieve)


def _primes_above(lo: int, count: int) -> list[int]:
    """The `count` smallest primes > lo: a sieve of the window (lo, lo + span], doubled until enough."""
    span = 2 * count * max(1, round(math.log(lo + 2))) + 64  # ~2x the expected gap sum
    while True:
        hi = lo + span
        is_prime = np.ones(span, dtype=bool)  # index k <-> the integer lo + 1 + k
        is_prime[: max(0, 2 - (lo + 1))] = False  # 0 and 1 are not prime
        for p in _primes_upto(math.isqrt(hi)).tolist():
            first = max(p * p, -(-(lo + 1) // p) * p)  # first multiple of p in the window, p itself kept
            is_prime[first - lo - 1::p] = False
        found = np.flatnonzero(is_prime)[:count] + lo + 1
        if len(found) == count:
            return found.tolist()
        span *= 2


def engram_table_primes(cfg: ModelConfig) -> dict[int, list[int]]:
    """Layer -> the row counts of its tables in (order, head) order: the consecutive primes above
    `engram_min_rows`, handed out layer by layer in increasing layer order, none reused."""
    per_layer = len(cfg.engram_orders) * cfg.engram_heads
    layers = sorted(cfg.engram_layers)
    primes = _primes_above(cfg.engram_min_rows, per_layer * len(layers))
    return {layer: primes[i * per_layer:(i + 1) * per_layer] for i, layer in enumerate(layers)}


def engram_table_params(cfg: ModelConfig) -> int:
    """Parameters of all Engram tables (196.6B at full scale), without building anything."""
    return sum(sum(p) for p in engram_table_primes(cfg).values()) * cfg.engram_dim


def _draw_multipliers(cfg: ModelConfig, layer_id: int) -> torch.Tensor:
    """Odd hash multipliers [orders, heads, max_order] in [1, 2^31), the same on every machine."""
    gen = torch.Generator(device="cpu").manual_seed(cfg.engram_seed * 1_000_003 + layer_id)
    shape = (len(cfg.engram_orders), cfg.engram_heads, max(cfg.engram_orders))
    return torch.randint(0, 2**30, shape, generator=gen, dtype=torch.int64, device="cpu") * 2 + 1


# --------------------------------------------------------------------------- tokenizer compression
def canonical_surface(text: str) -> str:
    """The canonical form that decides which tokens share a lookup id (see the module docstring)."""
    text = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    text = "".join(c for c in text if unicodedata.category(c) != "Mn")
    return _WHITESPACE.sub(" ", text.lower())


def build_compression_map(tokenizer: Tokenizer, vocab_size: int | None = None) -> tuple[torch.Tensor, int]:
    """Token id -> lookup id, dense in order of first occurrence by token id.

    Returns (map LongTensor [vocab_size], number of lookup ids). `vocab_size` may exceed the
    tokenizer's (a padded embedding); the extra ids keep ids of their own."""
    n_tok = tokenizer.get_vocab_size(with_added_tokens=True)
    vocab_size = n_tok if vocab_size is None else vocab_size
    if vocab_size < n_tok:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {n_tok}")
    surfaces = tokenizer.decode_batch([[i] for i in range(n_tok)], skip_special_tokens=False)
    added = set(tokenizer.get_added_tokens_decoder())
    lookup: dict[object, int] = {}  # canonical string, or ("own", token id) for unmergeable tokens
    out = []
    for tok in range(vocab_size):
        text = surfaces[tok] if tok < n_tok else ""
        canon = "" if tok in added or REPLACEMENT_CHAR in text else canonical_surface(text)
        out.append(lookup.setdefault(canon or ("own", tok), len(lookup)))
    return torch.tensor(out, dtype=torch.long), len(lookup)


# --------------------------------------------------------------------------- modules
class EngramTable(nn.Module):
    """One layer's rows of all hash heads in one [rows, dim] matrix. Lookups gather on the table's
    device and hand rows to the caller's, so the table may sit in host memory beside a GPU model."""

    def __init__(self, rows: int, dim: int, sparse_grad: bool = False):
        super().__init__()
        self.sparse_grad = sparse_grad  # sparse row gradients: a dense grad of a host table is ~table size
        self.weight = nn.Parameter(torch.empty(rows, dim))

    @property
    def num_params(self) -> int:
        return self.weight.numel()

    def reset_parameters(self, std: float) -> None:
        nn.init.normal_(self.weight, std=std)

    def lookup(self, addresses: torch.Tensor) -> torch.Tensor:
        """addresses [...] int64 -> rows [..., dim] on the addresses' device."""
        rows = F.embedding(addresses.to(self.weight.device), self.weight, sparse=self.sparse_grad)  # [..., dim]
        return rows.to(addresses.device)


class Engram(nn.Module):
    """Hashed n-gram lookup, fused key/value projection and per-stream gated residual add."""

    def __init__(self, cfg: ModelConfig, layer_id: int, pad_id: int = 0, sparse_grad: bool = False):
        super().__init__()
        if layer_id not in cfg.engram_layers:
            raise ValueError(f"layer {layer_id} is not an Engram layer {cfg.engram_layers}")
        self.cfg, self.layer_id, self.pad_id = cfg, layer_id, pad_id
        self.orders = list(cfg.engram_orders)
        self.n_streams, self.dim, self.heads = cfg.hc_mult, cfg.dim, cfg.engram_heads
        primes = engram_table_primes(cfg)[layer_id]
        n_lookups = len(primes)  # orders * heads
        self.table = EngramTable(sum(primes), cfg.engram_dim, sparse_grad)
        self.proj = nn.Linear(n_lookups * cfg.engram_dim, (self.n_streams + 1) * cfg.dim, bias=False)
        self.hidden_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.key_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        # Hashing state. Filled by _init_buffers (also after a meta build + to_empty).
        self.register_buffer("multipliers", torch.empty(len(self.orders), self.heads, max(self.orders),
                                                        dtype=torch.long))
        self.register_buffer("primes", torch.empty(n_lookups, dtype=torch.long), persistent=False)
        self.register_buffer("offsets", torch.empty(n_lookups, dtype=torch.long), persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def _init_buffers(self) -> None:
        primes = torch.tensor(engram_table_primes(self.cfg)[self.layer_id], dtype=torch.long)  # [O*H]
        self.primes.copy_(primes)
        self.offsets.copy_(torch.cumsum(primes, 0) - primes)  # [O*H] first row of each head
        self.multipliers.copy_(_draw_multipliers(self.cfg, self.layer_id))  # [O, H, max_n]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.proj.weight.is_meta:  # no values to set; to_empty() then reset_parameters() fills them
            return
        self._init_buffers()
        self.table.reset_parameters(self.cfg.init_std)
        nn.init.normal_(self.proj.weight, std=self.cfg.init_std)
        nn.init.ones_(self.hidden_norm.weight)
        nn.init.ones_(self.key_norm.weight)

    def _context(self, lookup_ids: torch.Tensor, doc_start: torch.Tensor | None,
                 positions: torch.Tensor | None = None, history: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T] -> [B, T, max_n] with [..., i] the id at t - i, or pad_id before the sequence
        start or inside an earlier document. positions [B, T]: global positions of the ids (a
        context-parallel slice); history [B, >= max_n-1]: the ids just before the slice."""
        T = lookup_ids.shape[1]
        pos = torch.arange(T, device=lookup_ids.device) if positions is None else positions  # [T] or [B, T]
        keep = max(self.orders) - 1
        if history is None:
            ctx = F.pad(lookup_ids, (keep, 0), value=self.pad_id)  # [B, keep + T]
        else:
            history = F.pad(history, (max(keep - history.shape[1], 0), 0), value=self.pad_id)  # near position 0
            ctx = torch.cat((history[:, history.shape[1] - keep:].to(lookup_ids.dtype), lookup_ids), dim=1)
        cols = []
        for i in range(max(self.orders)):
            shifted = ctx[:, keep - i:keep - i + T]  # [B, T] id at t - i
            if doc_start is not None:
                shifted = shifted.masked_fill(pos - i < doc_start, self.pad_id)  # [B, T]
            cols.append(shifted)
        return torch.stack(cols, dim=-1)  # [B, T, max_n]

    def addresses(self, lookup_ids: torch.Tensor, doc_start: torch.Tensor | None = None,
                  positions: torch.Tensor | None = None, history: torch.Tensor | None = None) -> torch.Tensor:
        """lookup_ids [B, T] int64 (compressed, < 2^20), doc_start [B, T] or None -> table rows
        [B, T, orders*heads]. Depends on ids only, so it can run ahead of the model (prefetch)."""
        grams = self._context(lookup_ids.long(), doc_start, positions, history)  # [B, T, max_n]
        hashes = []
        for o, n in enumerate(self.orders):
            prod = grams[:, :, None, :n] * self.multipliers[o, :, :n]  # [B, T, H, n] < 2^51: no overflow
            acc = prod[..., 0]  # [B, T, H]
            for i in range(1, n):
                acc = acc ^ prod[..., i]  # [B, T, H]
            hashes.append(acc)
        hashed = torch.cat(hashes, dim=-1)  # [B, T, O*H], (order, head) order like primes/offsets
        return hashed % self.primes + self.offsets  # [B, T, O*H]

    def lookup(self, lookup_ids: torch.Tensor, doc_start: torch.Tensor | None = None,
               positions: torch.Tensor | None = None, history: torch.Tensor | None = None) -> torch.Tensor:
        """lookup_ids [B, T] -> table rows [B, T, O*H, E] on the ids' device. model.kernels: the hash
        and the gather as Triton kernels (model/kernels/engram.py; a host table is gathered by the
        CPU from GPU-computed addresses); not under torch.compile, nor for a ZeRO-3 partitioned
        table (its weight exists only inside a gathered forward), which take the reference."""
        weight = self.table.weight
        if self.cfg.kernels and not torch.compiler.is_compiling() and not hasattr(weight, "ds_id"):
            from model.kernels.engram import engram_lookup_triton  # Triton only when the kernels are on

            return engram_lookup_triton(self, lookup_ids, doc_start, positions, history)
        return self.table.lookup(self.addresses(lookup_ids, doc_start, positions, history))

    def forward(self, h: torch.Tensor, lookup_ids: torch.Tensor, doc_start: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, history: torch.Tensor | None = None) -> torch.Tensor:
        """h [B, T, n_streams, D] residual streams -> h + gate * value, same shape and dtype."""
        B, T, S, D = h.shape
        if S != self.n_streams or D != self.dim:
            raise ValueError(f"expected streams [B, T, {self.n_streams}, {self.dim}], got {tuple(h.shape)}")
        rows = self.lookup(lookup_ids, doc_start, positions, history)  # [B, T, O*H, E]
        kv = self.proj(rows.flatten(2).to(self.proj.weight.dtype))  # [B, T, (S+1)*D]
        kv = kv.unflatten(-1, (S + 1, D))  # [B, T, S+1, D]
        if self.cfg.kernels and h.dtype != torch.float64 and not torch.compiler.is_compiling():
            from model.kernels.engram_gate import engram_gate_triton  # one pass each way

            return engram_gate_triton(h, kv, self.hidden_norm, self.key_norm)
        return self.gated_residual(h, kv)

    def gated_residual(self, h: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """h [B, T, S, D] streams, kv [B, T, S+1, D] (S keys, then the value) -> h + gate * value."""
        S, D = h.shape[-2:]
        kv = wide(kv)
        keys, value = kv[:, :, :S], kv[:, :, S:]  # [B, T, S, D], [B, T, 1, D]
        hn = F.rms_norm(wide(h), (D,), wide(self.hidden_norm.weight), self.hidden_norm.eps)  # [B, T, S, D]
        kn = F.rms_norm(keys, (D,), wide(self.key_norm.weight), self.key_norm.eps)  # [B, T, S, D]
        d = (hn * kn).sum(-1) * D**-0.5  # [B, T, S]
        gate = torch.sigmoid(d.sign() * d.abs().clamp_min(GATE_EPS).sqrt())  # [B, T, S]
        return h + (gate.unsqueeze(-1) * value).to(h.dtype)  # [B, T, S, D]
