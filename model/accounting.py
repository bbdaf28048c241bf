"""Parameter and FLOP accounting, read off a built model (the meta device is enough).

Parameters fall into four kinds:
  embedding  the token embedding: a lookup, no FLOPs
  engram     Engram tables: lookups, counted apart from the backbone (docs/ARCHITECTURE.md §1)
  routed     routed experts: a token touches n_activated / n_routed of them
  vision     the vision tower, projector and image delimiters (§9): run on image patches, not per token
  dense      everything else, touched by every token
"""
from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from model.engram import EngramTable
from model.moe import RoutedExperts


def parameter_kinds(model: nn.Module) -> dict[str, dict[str, int]]:
    """{scope: {kind: count}}; scope is 'layers.<i>' / 'engrams.<i>' inside the stack, else the
    top-level attribute name ('embed', 'head', 'norm')."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for mod_name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            parts = full.split(".")
            scope = ".".join(parts[:2]) if parts[0] in ("layers", "engrams") else parts[0]
            if parts[0] == "visual":
                kind = "vision"
            elif isinstance(module, EngramTable):
                kind = "engram"
            elif isinstance(module, RoutedExperts):
                kind = "routed"
            elif isinstance(module, nn.Embedding):
                kind = "embedding"
            else:
                kind = "dense"
            out[scope][kind] += p.numel()
    return {k: dict(v) for k, v in out.items()}


def active_matmul_params(model: nn.Module, layers: range | None = None, with_head: bool = True) -> float:
    """Weights one token multiplies through in `layers` (default: all), experts at k/E."""
    cfg = model.cfg
    frac = cfg.n_activated_experts / cfg.n_routed_experts
    layers = range(cfg.n_layers) if layers is None else layers
    keep = {f"layers.{i}" for i in layers} | {f"engrams.{i}" for i in layers}
    if with_head:
        keep |= {"head", "norm"}
    total = 0.0
    for scope, kinds in parameter_kinds(model).items():
        if scope in keep:
            total += kinds.get("dense", 0) + frac * kinds.get("routed", 0)
    return total


def _visible_entries(seq_len: int, compress_ratio: int) -> torch.Tensor:
    """Compressed entries visible to each query position of a causal sequence: [seq_len] fp64."""
    t = torch.arange(1, seq_len + 1, dtype=torch.float64)
    return torch.div(t, compress_ratio, rounding_mode="floor")


def attention_flops_per_token(cfg, plan, seq_len: int) -> float:
    """Forward FLOPs of attention scores and value mixing per token (window + selected entries),
    averaged over the positions of a causal sequence of seq_len tokens."""
    t = torch.arange(1, seq_len + 1, dtype=torch.float64)  # keys visible to query t-1
    window = t.clamp(max=cfg.window).mean().item()
    total = 0.0
    for spec in plan.layers:
        keys = window
        if spec.mode != "swa":
            keys += _visible_entries(seq_len, spec.compress_ratio).clamp(max=cfg.index_topk).mean().item()
        total += 2 * 2 * cfg.n_heads * cfg.kv_dim * keys  # QK^T and PV
    return total


def indexer_train_flops_per_token(cfg, plan, seq_len: int) -> float:
    """Training FLOPs of the lightning indexers per token. The scoring of every visible entry
    (Full) or of the pool (Reindex) runs once: the top-k selection takes no gradient. The indexer
    trains through its KL at the selected entries, whose backward (dq, dk, dw) is twice the
    forward there; that forward recomputes scores the selection already made, so it is not
    counted again (as activation recomputation is not, in MFU)."""
    per_key = 2 * cfg.index_heads * cfg.index_dim  # sum_h w * relu(q_h . k)
    total = 0.0
    for spec in plan.layers:
        if spec.mode not in ("full", "reindex"):
            continue  # Reuse layers take another layer's selection; swa has none
        visible = _visible_entries(seq_len, spec.compress_ratio)
        scored = visible if spec.mode == "full" else visible.clamp(max=cfg.pool_blocks * cfg.pool_block)
        total += per_key * scored.mean().item()
        total += 2 * per_key * visible.clamp(max=cfg.index_topk).mean().item()
    return total


def train_flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Model FLOPs per trained token, forward + backward: matmuls and attention at 3x their
    forward, plus the indexers' (`indexer_train_flops_per_token`)."""
    return train_flops(model.cfg, model.plan, active_matmul_params(model), seq_len)


def train_flops(cfg, plan, active_params: float, seq_len: int) -> float:
    """`train_flops_per_token` from the config, the layer plan and the active matmul weights, for
    callers that keep those rather than the model (the planner)."""
    forward = 2 * active_params + attention_flops_per_token(cfg, plan, seq_len)
    return 3 * forward + indexer_train_flops_per_token(cfg, plan, seq_len)


def ced_kv_writer_params(model: nn.Module) -> int:
    """Parameters the CED prefill runs in the first decoder layer to write the decoder's
    global KV from the encoder output: its attention mHC coefficients, attention norm,
    compressor and index keys (docs/ARCHITECTURE.md §2)."""
    first = model.cfg.n_encoder_layers
    if first >= model.cfg.n_layers:
        return 0
    prefix = (f"layers.{first}.attn_hc.", f"layers.{first}.attn_norm.", f"layers.{first}.attn.compressor.",
              f"layers.{first}.attn.index_key.")
    return sum(p.numel() for n, p in model.named_parameters() if n.startswith(prefix))


def model_summary(model: nn.Module) -> dict[str, float]:
    """The numbers ARCHITECTURE.md §1/§4 state for the model: parameters by kind, active parameters of
    the CED prefill (encoder layers + the decoder KV writer) and of decode (every layer and
    the head), and global-KV bytes per token from the cache layout."""
    from model.kv_layout import GlobalKVLayout, window_kv_bytes

    cfg = model.cfg
    totals: dict[str, int] = defaultdict(int)
    for kinds in parameter_kinds(model).values():
        for kind, n in kinds.items():
            totals[kind] += n
    engram, vision = totals.get("engram", 0), totals.get("vision", 0)
    backbone = sum(totals.values()) - engram - vision
    return {
        # the backbone: Engram tables and the vision tower are counted apart (docs/ARCHITECTURE.md §1, §9)
        "total_params": backbone,
        "engram_params": engram,
        "vision_params": vision,
        "all_params": backbone + engram + vision,
        "embedding_params": totals.get("embedding", 0),
        "routed_expert_params": totals.get("routed", 0),
        "active_prefill_params": active_matmul_params(model, range(cfg.n_encoder_layers), with_head=False)
        + ced_kv_writer_params(model),
        "active_decode_params": active_matmul_params(model),
        "kv_bytes_per_token": GlobalKVLayout.of(cfg, model.plan).bytes_per_token(),
        "window_kv_bytes_per_sequence": window_kv_bytes(cfg, cfg.n_layers),
    }
