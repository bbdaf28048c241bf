"""The CSA2 layer plan (docs/ARCHITECTURE.md §3): which layer computes, re-scores or reuses the global KV.

Modes:
  swa      window attention only, no global KV
  full     owns a compressed global KV and index keys, scores them, selects its top-k
  reindex  reads the KV and index keys of its Full layer, scores only inside that layer's
           candidate pool with its own indexer query, selects its own top-k
  reuse    reads the KV and the top-k of the latest Full/Reindex layer

The plan is derived from a handful of config numbers (or given layer by layer) and is
fixed per model, never chosen per request.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from conf.errors import ConfigError
from conf.model import ModelConfig

MODES = ("swa", "full", "reindex", "reuse")


@dataclass(frozen=True)
class LayerSpec:
    layer_id: int
    mode: str
    compress_ratio: int  # m of the global KV this layer reads; 0 for swa
    kv_source: Optional[int]  # the Full layer that owns the global KV read here
    index_source: Optional[int]  # the Full/Reindex layer whose top-k this layer uses
    is_decoder: bool
    builds_pool: bool  # a Full layer whose candidate pool Reindex layers score inside
    engram: bool  # an Engram module is applied before this layer

    @property
    def owns_kv(self) -> bool:
        return self.mode == "full"

    @property
    def has_indexer_query(self) -> bool:
        return self.mode in ("full", "reindex")


@dataclass(frozen=True)
class LayerPlan:
    layers: tuple[LayerSpec, ...]
    n_encoder_layers: int

    def __getitem__(self, i: int) -> LayerSpec:
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def kv_sources(self) -> list[int]:
        return [s.layer_id for s in self.layers if s.owns_kv]

    @property
    def index_sources(self) -> list[int]:
        return [s.layer_id for s in self.layers if s.has_indexer_query]

    @property
    def pool_builders(self) -> list[int]:
        return [s.layer_id for s in self.layers if s.builds_pool]

    def describe(self) -> str:
        return " ".join(f"{s.layer_id}:{s.mode}/m{s.compress_ratio}" for s in self.layers)


def _derived_modes_and_ratios(cfg: ModelConfig) -> tuple[list[str], list[int]]:
    modes, ratios = [], []
    for layer in range(cfg.n_layers):
        if layer < cfg.n_swa_layers:
            modes.append("swa")
            ratios.append(0)
        elif layer < cfg.n_encoder_layers:
            pos = (layer - cfg.n_swa_layers) % cfg.encoder_group
            modes.append("full" if pos == 0 else "reuse")
            ratios.append(cfg.encoder_compress_ratio)
        else:
            group, pos = divmod(layer - cfg.n_encoder_layers, cfg.decoder_group)
            modes.append(("full" if group == 0 else "reindex") if pos == 0 else "reuse")
            ratios.append(cfg.decoder_compress_ratio)
    return modes, ratios


def build_layer_plan(cfg: ModelConfig) -> LayerPlan:
    """Derive the per-layer plan and check that every reader has a source."""
    modes, ratios = _derived_modes_and_ratios(cfg)
    if cfg.layer_modes is not None:
        modes = list(cfg.layer_modes)
    if cfg.compress_ratios is not None:
        ratios = list(cfg.compress_ratios)
    if len(modes) != cfg.n_layers or len(ratios) != cfg.n_layers:
        raise ConfigError(f"layer plan has {len(modes)} modes and {len(ratios)} compress ratios "
                         f"for {cfg.n_layers} layers")
    if not 0 <= cfg.n_encoder_layers <= cfg.n_layers:
        raise ConfigError(f"n_encoder_layers={cfg.n_encoder_layers} outside [0, {cfg.n_layers}]")

    engram = set(cfg.engram_layers)
    if any(not 0 <= e < cfg.n_layers for e in engram):
        raise ConfigError(f"engram_layers {sorted(engram)} outside [0, {cfg.n_layers})")
    reindex_sources: set[int] = set()
    kv_src: Optional[int] = None
    idx_src: Optional[int] = None
    specs = []
    for layer, (mode, m) in enumerate(zip(modes, ratios)):
        if mode not in MODES:
            raise ConfigError(f"layer {layer}: unknown mode {mode!r} (expected one of {MODES})")
        if (mode == "swa") != (m == 0):
            raise ConfigError(f"layer {layer}: mode {mode} with compress ratio {m}")
        if mode == "full":
            kv_src = idx_src = layer
        elif mode in ("reindex", "reuse"):
            if kv_src is None:
                raise ConfigError(f"layer {layer}: {mode} layer before any full layer")
            if ratios[kv_src] != m:
                raise ConfigError(f"layer {layer}: compress ratio {m} differs from its KV source "
                                 f"layer {kv_src} (m={ratios[kv_src]})")
            if mode == "reindex":
                idx_src = layer
                reindex_sources.add(kv_src)
        specs.append(dict(layer_id=layer, mode=mode, compress_ratio=m,
                          kv_source=kv_src if mode != "swa" else None,
                          index_source=idx_src if mode != "swa" else None,
                          is_decoder=layer >= cfg.n_encoder_layers, engram=layer in engram))
    layers = tuple(LayerSpec(builds_pool=s["layer_id"] in reindex_sources, **s) for s in specs)
    return LayerPlan(layers=layers, n_encoder_layers=cfg.n_encoder_layers)
