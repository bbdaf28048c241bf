"""The global KV cache layout (docs/ARCHITECTURE.md §4): which layers store entries, in which packed formats.

Only KV-owner (Full) layers store global KV; Reindex and Reuse layers read theirs. An owner
with compress ratio m stores one entry per m tokens: the main latent as FP4 (E2M1 + E4M3
per 16) and the index key as MXFP4 (E2M1 + E8M0 per 32). Bytes per token are measured
from buffers allocated in this layout, so they follow the plan and the formats, not a
formula typed in beside them. The window KV (FP8) is a fixed-size ring per layer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from conf.model import ModelConfig
from model.plan import LayerPlan
from model.quant import empty_packed

MAIN_KV_FORMAT = "kv_fp4"
INDEX_K_FORMAT = "mxfp4"
WINDOW_KV_FORMAT = "fp8"


@dataclass(frozen=True)
class GlobalKVLayout:
    sources: tuple[tuple[int, int], ...]  # (owner layer, compress ratio)
    kv_dim: int
    index_dim: int

    @classmethod
    def of(cls, cfg: ModelConfig, plan: LayerPlan) -> GlobalKVLayout:
        return cls(tuple((s.layer_id, s.compress_ratio) for s in plan.layers if s.owns_kv),
                   cfg.kv_dim, cfg.index_dim)

    def allocate(self, n_tokens: int, batch: int = 1, device: torch.device | str = "cpu"):
        """Packed buffers for `n_tokens` tokens: {layer: {name: uint8 tensor [batch, entries, bytes]}}."""
        out = {}
        for layer, m in self.sources:
            entries = n_tokens // m
            kv_codes, kv_scales = empty_packed(MAIN_KV_FORMAT, (batch, entries), self.kv_dim, device)
            ik_codes, ik_scales = empty_packed(INDEX_K_FORMAT, (batch, entries), self.index_dim, device)
            out[layer] = {"kv_codes": kv_codes, "kv_scales": kv_scales,
                          "index_k_codes": ik_codes, "index_k_scales": ik_scales}
        return out

    def bytes_per_token(self) -> int | float:
        """Measured on meta buffers for a token count every ratio divides (an int when exact)."""
        n = math.lcm(*(m for _, m in self.sources)) * 1024 if self.sources else 1
        buffers = self.allocate(n, device="meta")
        total = sum(t.numel() * t.element_size() for bufs in buffers.values() for t in bufs.values())
        return total // n if total % n == 0 else total / n


def window_kv_bytes(cfg: ModelConfig, n_layers: int) -> int:
    """Bytes of the per-sequence FP8 window caches of `n_layers` layers (window tokens each)."""
    codes, scales = empty_packed(WINDOW_KV_FORMAT, (n_layers, cfg.window), cfg.kv_dim, device="meta")
    return codes.numel() * codes.element_size() + scales.numel() * scales.element_size()
