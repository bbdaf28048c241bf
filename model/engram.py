"""Engram: hashed n-gram memory applied before layers 1 and 14 (docs/ARCHITECTURE.md §5, §11).

For each position t and each order n in `engram_orders`, the n lookup ids ending at t are hashed and
the hash is reduced modulo the prime of each of `engram_heads` heads, each head owning a prime-sized
range of the layer's table; every head reads one `engram_dim` row. The concatenated rows go through
ONE linear to a key per residual stream and a shared value; a per-stream gate decides how much of the
value each stream takes.

Where the published description leaves details open (docs/ARCHITECTURE.md §5), this module
computes the same function as the public DeepSeek-V4.1-Flash inference code, so that released
Engram tables are read at the rows they were trained with:
* Lookup ids (`build_compression_map`): every token id of the tokenizer, added and special tokens
  included and treated like any other, is decoded alone and keyed by its text after the `tokenizers`
  normalizer chain NFKC -> NFD -> strip accents -> lowercase -> runs of space/tab/CR/LF to one space
  -> strip the ends, except that a text that is exactly one space after the collapse stays " ". So
  " tuple" and "tuple" share an id, while a whitespace-only token keeps one of its own. A decode with
  U+FFFD (a partial UTF-8 byte) is keyed by the raw token string instead, and a text that normalizes
  to nothing by the decoded text. Ids are dense, in order of first occurrence by token id.
* Hash: tok_i = lookup id at t - i (the pad id's class before the sequence start or inside an earlier
  document). hash_n = XOR_{i < n} tok_i * m_i, so the hash of order n extends that of order n - 1,
  and every head of an order takes the same hash modulo its own prime. One odd multiplier per
  (layer, i), shared by heads and orders: numpy's default_rng(10007 * layer) draws integers below
  (int64 max // compressed vocab) // 2, times 2 plus 1, so tok * m < 2^63 and nothing wraps.
  The multipliers are a persistent buffer, so a checkpoint carries the hashing its rows expect.
* Gate: per stream s, d_s = sum_D(h_s * w_s * k_s) * rstd(h_s) * rstd(k_s) / sqrt(D) with
  w_s = hidden_norm_weight[s] * key_norm_weight[s] (two [streams, D] weights, ones at init; only
  their product matters) and gate_s = sigmoid(copysign(sqrt(max(|d_s|, 1e-6)), d_s)), so d = +0
  leans open (sigmoid(+1e-3)); the add h + gate * value is done in fp32 and rounded once.
* Table layout: one [total_rows, engram_dim] matrix per layer, head k owning rows
  [offset_k, offset_k + prime_k), so it can be sharded by rows and live on another device (host
  memory at full scale) than the rest of the model; `EngramTable.lookup` gathers where the table is
  and returns rows where the caller is. The primes are the consecutive primes above
  `engram_min_rows` in (layer, order, head) order: the reference's primes for an
  `engram_vocab_size` of engram_min_rows + 1.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, normalizers
from torch import nn

from conf.model import ModelConfig
from model.numerics import wide

GATE_EPS = 1e-6  # floor of |d| under the signed square root of the gate
REPLACEMENT_CHAR = "\ufffd"  # what the decode of a partial UTF-8 byte sequence contains
ONE_SPACE = "\ue000"  # private use: holds a lone space while the ends are stripped


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


# --------------------------------------------------------------------------- hashing
def engram_hash_multipliers(layer_id: int, max_ngram: int, compressed_vocab: int) -> torch.Tensor:
    """The odd hash multipliers [max_ngram] int64 of a layer, one per lookback i (see the module
    docstring). Bounded so that any lookup id < compressed_vocab times any of them fits int64."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
    draw = np.random.default_rng(10007 * layer_id).integers(0, bound, size=(max_ngram,), dtype=np.int64)
    return torch.from_numpy(draw * 2 + 1)


# --------------------------------------------------------------------------- tokenizer compression
def surface_normalizer() -> normalizers.Normalizer:
    """The `tokenizers` normalizer whose output decides which tokens share a lookup id."""
    return normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), ONE_SPACE),  # Strip would empty it and merge it with ""
        normalizers.Strip(),
        normalizers.Replace(ONE_SPACE, " "),
    ])


def build_compression_map(tokenizer: Tokenizer, vocab_size: int | None = None) -> tuple[torch.Tensor, int]:
    """Token id -> lookup id, dense in order of first occurrence by token id.

    Returns (map LongTensor [vocab_size], number of lookup ids). `vocab_size` may exceed the
    tokenizer's (a padded embedding): those ids never occur in text, so they map to 0 and add no
    lookup id (the count determines the hash multipliers)."""
    n_tok = tokenizer.get_vocab_size(with_added_tokens=True)
    vocab_size = n_tok if vocab_size is None else vocab_size
    if vocab_size < n_tok:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {n_tok}")
    texts = tokenizer.decode_batch([[i] for i in range(n_tok)], skip_special_tokens=False)
    norm = surface_normalizer()
    ids: dict[str, int] = {}
    out = [0] * vocab_size
    for tok, text in enumerate(texts):
        if REPLACEMENT_CHAR in text:
            key = tokenizer.id_to_token(tok)  # partial UTF-8: nothing to normalize
        else:
            key = norm.normalize_str(text) or text
        out[tok] = ids.setdefault(key, len(ids))
    return torch.tensor(out, dtype=torch.long), len(ids)


def compressed_vocab(lookup_map: torch.Tensor) -> int:
    """The number of lookup ids of a compression map (dense from 0): what bounds the multipliers."""
    return int(lookup_map.max()) + 1


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
        rows = F.embedding(addresses.to(self.weight.device), self.weight,
                           sparse=self.sparse_grad)  # [..., dim]
        return rows.to(addresses.device)


def engram_rows(engram: Engram, lookup_ids: torch.Tensor, doc_start: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, history: torch.Tensor | None = None) -> torch.Tensor:
    """`Engram.lookup`: hash the lookup ids' n-grams to table addresses, then gather the rows."""
    return engram.table.lookup(engram.addresses(lookup_ids, doc_start, positions, history))


def engram_gate(h: torch.Tensor, kv: torch.Tensor, w_h: torch.Tensor, w_k: torch.Tensor,
                eps: float) -> torch.Tensor:
    """Engram's gated residual add: h [..., S, D] streams, kv [..., S+1, D] (S keys, then the
    value), w_h/w_k [S, D] the per-stream query and key norm weights -> h + gate * value in h's
    dtype. The gate is sigmoid of the signed square root of the RMS-normed query-key dot product."""
    S, D = h.shape[-2:]
    x, kv = wide(h), wide(kv)
    keys, value = kv[..., :S, :], kv[..., S:, :]  # [..., S, D], [..., 1, D]
    w = wide(w_h) * wide(w_k)  # [S, D]
    rstd = torch.rsqrt(x.square().mean(-1) + eps) * torch.rsqrt(keys.square().mean(-1) + eps)
    d = (x * w * keys).sum(-1) * rstd * D**-0.5  # [..., S]
    gate = torch.sigmoid(torch.copysign(d.abs().clamp_min(GATE_EPS).sqrt(), d))  # d = +0: leans open
    return (x + gate.unsqueeze(-1) * value).to(h.dtype)  # [..., S, D]


class Engram(nn.Module):
    """Hashed n-gram lookup, fused key/value projection and per-stream gated residual add."""

    # the ops; model.ops.KernelPolicy may swap in the Triton hash + gather (model/kernels/engram.py)
    # and gated add (model/kernels/engram_gate.py)
    gather_rows = staticmethod(engram_rows)
    gate = staticmethod(engram_gate)

    def __init__(self, cfg: ModelConfig, layer_id: int, pad_id: int = 0, compressed_vocab: int | None = None,
                 sparse_grad: bool = False):
        """pad_id: the lookup id read before a sequence or document start (the class of the
        tokenizer's pad token); compressed_vocab: the number of lookup ids, which bounds the hash
        multipliers (None: cfg.vocab_size, for an identity map)."""
        super().__init__()
        if layer_id not in cfg.engram_layers:
            raise ValueError(f"layer {layer_id} is not an Engram layer {cfg.engram_layers}")
        self.cfg, self.layer_id, self.pad_id = cfg, layer_id, pad_id
        self.compressed_vocab = cfg.vocab_size if compressed_vocab is None else compressed_vocab
        if self.compressed_vocab is None or self.compressed_vocab < 1:
            raise ValueError(f"compressed_vocab={self.compressed_vocab} (model.vocab_size unset?): "
                             "the number of lookup ids is needed to draw the hash multipliers")
        self.orders = list(cfg.engram_orders)
        self.n_streams, self.dim, self.heads = cfg.hc_mult, cfg.dim, cfg.engram_heads
        self.eps = cfg.norm_eps
        primes = engram_table_primes(cfg)[layer_id]
        n_lookups = len(primes)  # orders * heads
        self.table = EngramTable(sum(primes), cfg.engram_dim, sparse_grad)
        self.proj = nn.Linear(n_lookups * cfg.engram_dim, (self.n_streams + 1) * cfg.dim, bias=False)
        # the gate's weights per stream, fp32 like the other norm weights
        self.hidden_norm_weight = nn.Parameter(torch.empty(self.n_streams, cfg.dim, dtype=torch.float32))
        self.key_norm_weight = nn.Parameter(torch.empty(self.n_streams, cfg.dim, dtype=torch.float32))
        # Hashing state. Filled by _init_buffers (also after a meta build + to_empty).
        self.register_buffer("multipliers", torch.empty(max(self.orders), dtype=torch.long))
        self.register_buffer("primes", torch.empty(n_lookups, dtype=torch.long), persistent=False)
        self.register_buffer("offsets", torch.empty(n_lookups, dtype=torch.long), persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def _init_buffers(self) -> None:
        primes = torch.tensor(engram_table_primes(self.cfg)[self.layer_id], dtype=torch.long)  # [O*H]
        self.primes.copy_(primes)
        self.offsets.copy_(torch.cumsum(primes, 0) - primes)  # [O*H] first row of each head
        mult = engram_hash_multipliers(self.layer_id, max(self.orders), self.compressed_vocab)  # [max_n]
        self.multipliers.copy_(mult)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.proj.weight.is_meta:  # no values to set; to_empty() then reset_parameters() fills them
            return
        self._init_buffers()
        self.table.reset_parameters(self.cfg.init_std)
        nn.init.normal_(self.proj.weight, std=self.cfg.init_std)
        nn.init.ones_(self.hidden_norm_weight)
        nn.init.ones_(self.key_norm_weight)

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
            # near position 0
            history = F.pad(history, (max(keep - history.shape[1], 0), 0), value=self.pad_id)
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
        """lookup_ids [B, T] int64 (< compressed_vocab), doc_start [B, T] or None -> table rows
        [B, T, orders*heads]. Depends on ids only, so it can run ahead of the model (prefetch)."""
        grams = self._context(lookup_ids.long(), doc_start, positions, history)  # [B, T, max_n]
        prod = grams * self.multipliers  # [B, T, max_n] < 2^63 by the multipliers' bound
        rolling, by_order = prod[..., 0], {}  # rolling: the hash of the n-gram ending at t
        for n in range(1, max(self.orders) + 1):
            if n > 1:
                rolling = rolling ^ prod[..., n - 1]  # [B, T]
            by_order[n] = rolling
        # (order, head) columns like primes/offsets: the heads of an order share its hash
        hashed = torch.stack([by_order[n] for n in self.orders for _ in range(self.heads)], dim=-1)
        return hashed % self.primes + self.offsets  # [B, T, O*H]

    def lookup(self, lookup_ids: torch.Tensor, doc_start: torch.Tensor | None = None,
               positions: torch.Tensor | None = None, history: torch.Tensor | None = None) -> torch.Tensor:
        """lookup_ids [B, T] -> table rows [B, T, O*H, E] on the ids' device (the `gather_rows` op)."""
        return self.gather_rows(self, lookup_ids, doc_start, positions, history)

    def forward(self, h: torch.Tensor, lookup_ids: torch.Tensor, doc_start: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, history: torch.Tensor | None = None) -> torch.Tensor:
        """h [B, T, n_streams, D] residual streams -> h + gate * value, same shape and dtype."""
        B, T, S, D = h.shape
        if S != self.n_streams or D != self.dim:
            raise ValueError(f"expected streams [B, T, {self.n_streams}, {self.dim}], got {tuple(h.shape)}")
        rows = self.lookup(lookup_ids, doc_start, positions, history)  # [B, T, O*H, E]
        kv = self.proj(rows.flatten(2).to(self.proj.weight.dtype))  # [B, T, (S+1)*D]
        kv = kv.unflatten(-1, (S + 1, D))  # [B, T, S+1, D]
        return self.gated_residual(h, kv)

    def gated_residual(self, h: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """h [..., S, D] streams, kv [..., S+1, D] (S keys, then the value) -> h + gate * value
        (the `gate` op)."""
        return self.gate(h, kv, self.hidden_norm_weight, self.key_norm_weight, self.eps)

