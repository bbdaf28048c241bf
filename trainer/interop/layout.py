"""flashtrain's parameter names and layouts <-> the public checkpoint's (docs/DESIGN.md,
"Checkpoint interop", has the table and the decisions).

The layout is a list of parts: the top-level tensors, then one part per layer and one per Engram
module. A part is the unit of streaming (import and export hold one part at a time) and of work
sharing (part k goes to rank k % world); on export each part is one safetensors shard.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from conf.errors import ConfigError
from conf.model import ModelConfig
from model.plan import LayerPlan

SCORE_FUNC = "sqrtsoftplus"  # model/moe.py's router: sqrt(softplus(Wx))
DSPARK_PREFIX = "mtp."  # the public DSpark drafter's tensors; flashtrain has no drafter


@dataclass(frozen=True)
class Entry:
    """One public tensor (with its scale, for quantised encodings) and where it lives in flashtrain."""
    public: str  # e.g. layers.3.attn.wq_a.weight
    source: str  # flashtrain state-dict key, e.g. layers.3.attn.wq_a.weight
    encoding: str  # trainer/interop/codec.py
    shape: tuple[int, ...]  # the public (dequantised) shape
    expert: Optional[int] = None  # index into the stacked expert dim of `source`

    def name(self, suffix: str) -> str:
        """The public name of a stored tensor: suffix "" -> the tensor, "scale" -> its scale."""
        return self.public if not suffix else self.public.rsplit(".", 1)[0] + "." + suffix


@dataclass
class Part:
    name: str
    entries: list[Entry] = field(default_factory=list)
    # flashtrain state the public layout does not hold: key -> how import fills it
    derived: dict[str, str] = field(default_factory=dict)

    def shard_file(self, index: int, total: int) -> str:
        return f"model-{index + 1:05d}-of-{total:05d}.safetensors"


def build_layout(cfg: ModelConfig, plan: LayerPlan, shapes: dict[str, tuple[int, ...]]) -> list[Part]:
    """The parts of a model; `shapes` is its state dict's key -> shape (a meta-device build)."""
    def add(part: Part, public: str, source: str, encoding: str, shape=None) -> None:
        part.entries.append(Entry(public, source, encoding, tuple(shape or shapes[source])))

    top = Part("top")
    add(top, "embed.weight", "embed.weight", "bf16")
    add(top, "norm.weight", "norm.weight", "bf16")
    add(top, "head.weight", "head.weight", "bf16")
    parts = [top]
    fp8 = "fp8_block"
    for spec in plan.layers:
        i, p = spec.layer_id, Part(f"layer{spec.layer_id}")
        f = t = f"layers.{i}."  # f: flashtrain prefix, t: public prefix (the same for layers)
        add(p, t + "attn_norm.weight", f + "attn_norm.weight", "bf16")
        add(p, t + "ffn_norm.weight", f + "ffn_norm.weight", "bf16")
        for sub, hc in (("attn", "attn_hc"), ("ffn", "ffn_hc")):
            for field_ in ("fn", "base", "scale"):
                add(p, f"{t}hc_{sub}_{field_}", f"{f}{hc}.{field_}", "fp32")
        a, fa = t + "attn.", f + "attn."
        add(p, a + "attn_sink", fa + "sink", "fp32")
        for name in ("wq_a", "wq_b", "wkv", "wo_b"):
            add(p, a + name + ".weight", fa + name + ".weight", fp8)
        add(p, a + "q_norm.weight", fa + "q_norm.weight", "bf16")
        add(p, a + "kv_norm.weight", fa + "kv_norm.weight", "bf16")
        groups, rank, group_in = shapes[fa + "wo_a"]  # flashtrain [G, Ro, H/G*C] -> public [G*Ro, H*C/G]
        add(p, a + "wo_a.weight", fa + "wo_a", "bf16", (groups * rank, group_in))
        if spec.owns_kv:
            comp = "fp32" if spec.compress_ratio > 1 else "bf16"
            add(p, a + "compressor.wkv.weight", fa + "compressor.wkv.weight", comp)
            if spec.compress_ratio > 1:
                add(p, a + "compressor.wgate.weight", fa + "compressor.wgate.weight", comp)
            add(p, a + "compressor.norm.weight", fa + "compressor.norm.weight", "bf16")
            add(p, a + "indexer.wk.weight", fa + "index_key.wk.weight", "bf16")
            add(p, a + "indexer.k_norm.weight", fa + "index_key.k_norm.weight", "bf16")
        if spec.has_indexer_query:
            add(p, a + "indexer.wq_b.weight", fa + "index_query.wq_b.weight", fp8)
            add(p, a + "indexer.weights_proj.weight", fa + "index_query.weights_proj.weight", "bf16")
        m, fm = t + "ffn.", f + "moe."
        add(p, m + "gate.weight", fm + "router.weight", "bf16")
        add(p, m + "gate.bias", fm + "router.bias", "fp32")
        p.derived[fm + "router.load"] = "zeros"  # a load counter, emptied at every step
        n_experts, *_ = shapes[fm + "experts.w1"]
        for j in range(n_experts):
            for w in ("w1", "w2", "w3"):
                _, rows, cols = shapes[fm + f"experts.{w}"]
                p.entries.append(Entry(f"{m}experts.{j}.{w}.weight", f"{fm}experts.{w}", "fp4_expert",
                                       (rows, cols), expert=j))
        if cfg.n_shared_experts > 0:
            for w in ("w1", "w2", "w3"):
                add(p, f"{m}shared_experts.{w}.weight", f"{fm}shared.{w}.weight", fp8)
        parts.append(p)
        if spec.engram:
            e, fe = t + "engram.", f"engrams.{i}."
            g = Part(f"engram{i}")
            add(g, e + "embed.weight", fe + "table.weight", "fp8_row")
            add(g, e + "wkv.weight", fe + "proj.weight", fp8)
            add(g, e + "q_weight", fe + "hidden_norm.weight", "bf16")
            add(g, e + "k_weight", fe + "key_norm.weight", "bf16")
            g.derived[fe + "multipliers"] = "engram_multipliers"  # drawn from model.engram_seed
            parts.append(g)
    for part in parts:
        for entry in part.entries:
            if entry.encoding == "fp4_expert" and entry.shape[1] % 32:
                raise ConfigError(f"{entry.public}: input dim {entry.shape[1]} is not a multiple of 32, "
                                  "which the FP4 expert layout needs")
    return parts


# ------------------------------------------------------------------ config.json
def public_config(cfg: ModelConfig, plan: LayerPlan, vocab_size: int, engram: dict[str, int]) -> dict[str, Any]:
    """config.json in the reference ModelArgs' field names. `engram`: the tokenizer-derived
    fields (engram_compressed_vocab_size, engram_pad_id)."""
    orders = sorted(cfg.engram_orders)
    if cfg.engram_layers and orders != list(range(2, orders[-1] + 1)):
        raise ConfigError(f"model.engram_orders={cfg.engram_orders}: the public config can only say 2..N")
    ratios = [s.compress_ratio for s in plan.layers]
    return {
        "vocab_size": vocab_size, "dim": cfg.dim, "n_layers": cfg.n_layers, "norm_eps": cfg.norm_eps,
        "dtype": "fp8",
        "n_heads": cfg.n_heads, "head_dim": cfg.kv_dim, "rope_head_dim": cfg.rope_dim,
        "q_lora_rank": cfg.q_lora_rank, "o_lora_rank": cfg.o_lora_rank, "o_groups": cfg.o_groups,
        "moe_inter_dim": cfg.moe_inter_dim, "n_routed_experts": cfg.n_routed_experts,
        "n_activated_experts": cfg.n_activated_experts, "n_shared_experts": cfg.n_shared_experts,
        "score_func": SCORE_FUNC, "route_scale": cfg.route_scale, "swiglu_limit": cfg.swiglu_limit,
        "window_size": cfg.window, "compress_ratios": ratios,
        "kv_source_layers": plan.kv_sources, "index_source_layers": plan.index_sources,
        "index_n_heads": cfg.index_heads, "index_head_dim": cfg.index_dim, "index_topk": cfg.index_topk,
        "candidate_source_layer": plan.pool_builders[0] if plan.pool_builders else None,
        "candidate_topk_blocks": cfg.pool_blocks, "candidate_block_size": cfg.pool_block,
        "rope_theta": cfg.rope_theta, "compress_rope_theta": cfg.rope_theta_compressed,
        "original_seq_len": cfg.original_seq_len, "rope_factor": cfg.rope_factor,
        "beta_fast": cfg.beta_fast, "beta_slow": cfg.beta_slow,
        "hc_mult": cfg.hc_mult, "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters, "hc_eps": cfg.hc_eps,
        "engram_layer_ids": sorted(cfg.engram_layers), "engram_num_embeddings": cfg.engram_min_rows,
        "engram_max_ngram_size": orders[-1] if orders else 0, "engram_vocab_size": vocab_size,
        "engram_n_heads": cfg.engram_heads, "engram_head_dim": cfg.engram_dim,
        "engram_pad_id": engram["engram_pad_id"],
        "engram_compressed_vocab_size": engram["engram_compressed_vocab_size"],
    }


# fields the tokenizer decides (flashtrain builds its compression map from its tokenizer), the
# storage dtype, and the drafter's: not compared on import
UNCHECKED = ("dtype", "engram_pad_id", "engram_compressed_vocab_size", "engram_vocab_size")


def config_mismatches(expected: dict[str, Any], found: dict[str, Any]) -> list[str]:
    """Fields of config.json that are missing or disagree with the model config, one line each."""
    problems = []
    for key, want in expected.items():
        if key in UNCHECKED:
            continue
        if key not in found:
            problems.append(f"config.json lacks {key}")
        elif _normalise(found[key]) != _normalise(want):
            problems.append(f"config.json {key}={found[key]!r} but the model has {want!r}")
    return problems


def _normalise(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return [_normalise(x) for x in v]
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    return float(v)
