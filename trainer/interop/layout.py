"""flashtrain's parameter names and layouts <-> the public checkpoint's (docs/DESIGN.md,
"Checkpoint interop", has the table and the decisions).

The layout is a list of parts: the top-level tensors, then one part per layer and one per Engram
module. A part is the unit of streaming (import and export hold one part at a time) and of work
sharing (part k goes to rank k % world); on export each part is one safetensors shard.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

from conf.errors import ConfigError
from conf.model import ModelConfig
from model.engram import engram_table_primes
from model.plan import LayerPlan

# Public tensors of modules the target model may not have: the DSpark drafter (`mtp.*`, a separate
# flashtrain module: `build_drafter_layout` maps it where a drafter is imported or exported), and the
# vision tower with its per-layer routing bias for image tokens, when the model has none
# (model.vision_n_layers=0). Where no layout maps them, import keeps them as they are and export
# writes them back unchanged; a model with a vision tower maps the vision tensors into it.
CARRIED = re.compile(r"^mtp\.|^vision\.|^aligner\.|^image_(start|end|newline)$|\.ffn\.gate\.bias_vl$")
DRAFTER_PREFIX = "mtp."  # the public drafter's namespace: block i is mtp.<i>, with the target layers' names
VISION_PREFIX = "visual."  # flashtrain's module holding the public top-level vision tensors

# The reference ModelArgs' defaults of the fields flashtrain compares on import: a config.json that
# leaves a field out means this value to the public code. dtype fp8 and expert_dtype fp4 are the
# storage the layout has (FP8 linears, FP4 experts).
REFERENCE_DEFAULTS: dict[str, Any] = {
    "dtype": "fp8", "expert_dtype": "fp4", "vocab_size": 129280, "dim": 1024, "moe_inter_dim": 1024,
    "n_layers": 5, "n_heads": 16, "n_routed_experts": 8, "n_shared_experts": 1, "n_activated_experts": 2,
    "score_func": "sqrtsoftplus", "gate_temp": 1.0, "norm_topk_prob": True, "route_scale": 1.0,
    "swiglu_limit": 0.0, "q_lora_rank": 256, "head_dim": 128, "rope_head_dim": 32, "norm_eps": 1e-20,
    "o_groups": 8, "o_lora_rank": 256, "window_size": 128, "compress_ratios": [0, 2, 2, 1, 1, 0],
    "kv_source_layers": [1, 3], "index_source_layers": [1, 3], "compress_rope_theta": 40000.0,
    "original_seq_len": 0, "rope_theta": 10000.0, "rope_factor": 40.0, "beta_fast": 32, "beta_slow": 1,
    "index_n_heads": 16, "index_head_dim": 64, "index_topk": 64, "candidate_source_layer": -1,
    "candidate_topk_blocks": 0, "candidate_block_size": 0, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6, "engram_layer_ids": [], "engram_num_embeddings": [], "engram_max_ngram_size": 1,
    "engram_vocab_size": 0, "engram_n_heads": 0, "engram_head_dim": 0, "engram_pad_id": 2,
    "engram_compressed_vocab_size": 0, "n_mtp_layers": 1, "max_seq_len": 4096,
    "vision_n_layers": 0, "vision_dim": 1024, "vision_n_heads": 16, "vision_inter_dim": 2816,
    "vision_patch_size": 14, "vision_rope_theta": 10000.0, "vision_downsample_ratio": 3,
    "vision_max_n_token": 1024, "vision_min_pixels": 544 * 544, "vision_max_wh_ratio": None,
    "image_token_id": 129264,
    "dspark_block_size": 0, "dspark_noise_token_id": 0, "dspark_target_layer_ids": [],
    "dspark_markov_rank": 256, "dspark_n_routed_experts": 0, "dspark_n_activated_experts": 0,
}
# the drafter's fields of config.json (the public code builds the mtp.* blocks when dspark_block_size
# is not 0; dspark_n_*_experts = 0 means the backbone's counts)
DRAFTER_KEYS = ("n_mtp_layers", "dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids",
                "dspark_markov_rank", "dspark_n_routed_experts", "dspark_n_activated_experts")


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


def _add(part: Part, shapes: dict[str, tuple[int, ...]], public: str, source: str, encoding: str,
         shape=None) -> None:
    part.entries.append(Entry(public, source, encoding, tuple(shape or shapes[source])))


def _add_block(p: Part, cfg: ModelConfig, spec, shapes: dict[str, tuple[int, ...]], f: str, t: str) -> None:
    """One block's entries: flashtrain prefix f (`layers.<i>.`), public prefix t (`layers.<i>.`, or
    `mtp.<i>.` for a drafter block, which has the target layers' names)."""
    fp8 = "fp8_block"
    add = lambda public, source, encoding, shape=None: _add(p, shapes, public, source, encoding, shape)  # noqa: E731
    add(t + "attn_norm.weight", f + "attn_norm.weight", "bf16")
    add(t + "ffn_norm.weight", f + "ffn_norm.weight", "bf16")
    for sub, hc in (("attn", "attn_hc"), ("ffn", "ffn_hc")):
        for field_ in ("fn", "base", "scale"):
            add(f"{t}hc_{sub}_{field_}", f"{f}{hc}.{field_}", "fp32")
    a, fa = t + "attn.", f + "attn."
    add(a + "attn_sink", fa + "sink", "fp32")
    for name in ("wq_a", "wq_b", "wkv", "wo_b"):
        add(a + name + ".weight", fa + name + ".weight", fp8)
    add(a + "q_norm.weight", fa + "q_norm.weight", "bf16")
    add(a + "kv_norm.weight", fa + "kv_norm.weight", "bf16")
    groups, rank, group_in = shapes[fa + "wo_a"]  # flashtrain [G, Ro, H/G*C] -> public [G*Ro, H*C/G]
    add(a + "wo_a.weight", fa + "wo_a", "bf16", (groups * rank, group_in))
    if spec.owns_kv:
        comp = "fp32" if spec.compress_ratio > 1 else "bf16"
        add(a + "compressor.wkv.weight", fa + "compressor.wkv.weight", comp)
        if spec.compress_ratio > 1:
            add(a + "compressor.wgate.weight", fa + "compressor.wgate.weight", comp)
        add(a + "compressor.norm.weight", fa + "compressor.norm.weight", "bf16")
        add(a + "indexer.wk.weight", fa + "index_key.wk.weight", "bf16")
        add(a + "indexer.k_norm.weight", fa + "index_key.k_norm.weight", "bf16")
    if spec.has_indexer_query:
        add(a + "indexer.wq_b.weight", fa + "index_query.wq_b.weight", fp8)
        add(a + "indexer.weights_proj.weight", fa + "index_query.weights_proj.weight", "bf16")
    m, fm = t + "ffn.", f + "moe."
    add(m + "gate.weight", fm + "router.weight", "bf16")
    add(m + "gate.bias", fm + "router.bias", "fp32")
    p.derived[fm + "router.load"] = "zeros"  # a load counter, emptied at every step
    if cfg.vision_n_layers > 0:  # image-span tokens' selection bias
        add(m + "gate.bias_vl", fm + "router.bias_vl", "fp32")
        p.derived[fm + "router.load_vl"] = "zeros"
    n_experts, *_ = shapes[fm + "experts.w1"]
    for j in range(n_experts):
        for w in ("w1", "w2", "w3"):
            _, rows, cols = shapes[fm + f"experts.{w}"]
            p.entries.append(Entry(f"{m}experts.{j}.{w}.weight", f"{fm}experts.{w}", "fp4_expert",
                                   (rows, cols), expert=j))
    if cfg.n_shared_experts > 0:
        for w in ("w1", "w2", "w3"):
            add(f"{m}shared_experts.{w}.weight", f"{fm}shared.{w}.weight", fp8)


def _check_encodable(parts: list[Part]) -> None:
    for part in parts:
        for entry in part.entries:
            if entry.encoding == "fp4_expert" and entry.shape[1] % 32:
                raise ConfigError(f"{entry.public}: input dim {entry.shape[1]} is not a multiple of 32, "
                                  "which the FP4 expert layout needs")


def build_layout(cfg: ModelConfig, plan: LayerPlan, shapes: dict[str, tuple[int, ...]]) -> list[Part]:
    """The parts of a model; `shapes` is its state dict's key -> shape (a meta-device build)."""
    top = Part("top")
    for name in ("embed.weight", "norm.weight", "head.weight"):
        _add(top, shapes, name, name, "bf16")
    parts = [top]
    for spec in plan.layers:
        i, p = spec.layer_id, Part(f"layer{spec.layer_id}")
        _add_block(p, cfg, spec, shapes, f"layers.{i}.", f"layers.{i}.")  # the same names for layers
        parts.append(p)
        if spec.engram:
            e, fe = f"layers.{i}.engram.", f"engrams.{i}."
            g = Part(f"engram{i}")
            _add(g, shapes, e + "embed.weight", fe + "table.weight", "fp8_row")
            _add(g, shapes, e + "wkv.weight", fe + "proj.weight", "fp8_block")
            _add(g, shapes, e + "q_weight", fe + "hidden_norm_weight", "bf16")
            _add(g, shapes, e + "k_weight", fe + "key_norm_weight", "bf16")
            # a function of the layer and the compressed vocabulary (config.json), as the public code
            # draws them
            g.derived[fe + "multipliers"] = "engram_multipliers"
            parts.append(g)
    if cfg.vision_n_layers > 0:  # the ViT, aligner and delimiters: the public names, unquantised
        v = Part("vision")
        for key in sorted(k for k in shapes if k.startswith(VISION_PREFIX)):
            _add(v, shapes, key[len(VISION_PREFIX):], key, "bf16")
        parts.append(v)
    _check_encodable(parts)
    if plan.layers and any(s.engram for s in plan.layers) and cfg.engram_dim % 32:
        raise ConfigError(f"model.engram_dim={cfg.engram_dim}: the public Engram table stores one scale per "
                          "32 values of a row, so it must be a multiple of 32")
    return parts


def build_drafter_layout(draft_cfg: ModelConfig, plan: LayerPlan,
                         shapes: dict[str, tuple[int, ...]]) -> list[Part]:
    """The DSpark drafter's parts (model/dspark.py; `shapes` from a DSpark's state dict), one per
    block: block i is `mtp.<i>.*` with a target layer's names; the first block also holds the
    context projection and its norm, the last the drafter's norm, the Markov head (an embedding
    [V, r] and a projection stored as [V, r], the reference's ParallelEmbedding / ParallelHead
    weights as they are) and the confidence head (bf16 in the release, fp32 in the reference
    module). Encodings as the reference's modules declare them: main_proj is a default Linear
    (FP8), the rest bf16."""
    parts, last = [], len(plan.layers) - 1
    for spec in plan.layers:
        i, p = spec.layer_id, Part(f"mtp{spec.layer_id}")
        t = f"{DRAFTER_PREFIX}{i}."
        _add_block(p, draft_cfg, spec, shapes, f"layers.{i}.", t)
        if i == 0:
            _add(p, shapes, t + "main_proj.weight", "main_proj.weight", "fp8_block")
            _add(p, shapes, t + "main_norm.weight", "main_norm.weight", "bf16")
        if i == last:
            _add(p, shapes, t + "norm.weight", "norm.weight", "bf16")
            _add(p, shapes, t + "markov_head.embed.weight", "markov.w1.weight", "bf16")
            _add(p, shapes, t + "markov_head.head.weight", "markov.w2.weight", "bf16")
            _add(p, shapes, t + "confidence_head.proj.weight", "confidence.proj.weight", "bf16")
        parts.append(p)
    _check_encodable(parts)
    return parts


# ------------------------------------------------------------------ config.json
def _check_expressible(plan: LayerPlan) -> None:
    """The public config names one candidate-pool layer and applies its pool to every indexer after
    it; a plan outside that shape has no public config."""
    builders = plan.pool_builders
    if len(builders) > 1:
        raise ConfigError(f"layers {builders} each build a candidate pool; the public config has one")
    if builders:
        later_full = [s.layer_id for s in plan.layers if s.layer_id > builders[0] and s.mode == "full"]
        if later_full:
            raise ConfigError(f"full layers {later_full} follow the candidate-pool layer {builders[0]}; the "
                              "public code would restrict their indexers to its pool")


def public_config(cfg: ModelConfig, plan: LayerPlan, vocab_size: int,
                  engram: dict[str, int]) -> dict[str, Any]:
    """config.json in the reference ModelArgs' field names and meanings. `engram`: the
    tokenizer-derived fields (engram_compressed_vocab_size, engram_pad_id, a raw token id)."""
    _check_expressible(plan)
    orders = sorted(cfg.engram_orders)
    if cfg.engram_layers and orders != list(range(2, orders[-1] + 1)):
        raise ConfigError(f"model.engram_orders={cfg.engram_orders}: the public config can only say 2..N")
    primes = engram_table_primes(cfg) if cfg.engram_layers else {}
    layers = sorted(cfg.engram_layers)
    builders = plan.pool_builders
    config = {
        "vocab_size": vocab_size, "dim": cfg.dim, "n_layers": cfg.n_layers, "n_mtp_layers": 0,
        "max_seq_len": cfg.max_seq_len, "norm_eps": cfg.norm_eps,
        "n_heads": cfg.n_heads, "head_dim": cfg.kv_dim, "rope_head_dim": cfg.rope_dim,
        "q_lora_rank": cfg.q_lora_rank, "o_lora_rank": cfg.o_lora_rank, "o_groups": cfg.o_groups,
        "moe_inter_dim": cfg.moe_inter_dim, "n_routed_experts": cfg.n_routed_experts,
        "n_activated_experts": cfg.n_activated_experts, "n_shared_experts": cfg.n_shared_experts,
        "score_func": "sqrtsoftplus", "gate_temp": 1.0, "norm_topk_prob": True,  # model/moe.py's router
        "route_scale": cfg.route_scale, "swiglu_limit": cfg.swiglu_limit,
        "window_size": cfg.window, "compress_ratios": [s.compress_ratio for s in plan.layers],
        "kv_source_layers": plan.kv_sources, "index_source_layers": plan.index_sources,
        "index_n_heads": cfg.index_heads, "index_head_dim": cfg.index_dim, "index_topk": cfg.index_topk,
        "candidate_source_layer": builders[0] if builders else -1,
        "candidate_topk_blocks": cfg.pool_blocks, "candidate_block_size": cfg.pool_block,
        "rope_theta": cfg.rope_theta, "compress_rope_theta": cfg.rope_theta_compressed,
        "original_seq_len": cfg.original_seq_len, "rope_factor": cfg.rope_factor,
        "beta_fast": cfg.beta_fast, "beta_slow": cfg.beta_slow,
        "hc_mult": cfg.hc_mult, "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters, "hc_eps": cfg.hc_eps,
        "engram_layer_ids": layers,
        "engram_num_embeddings": [sum(primes[i]) for i in layers],
        "engram_max_ngram_size": orders[-1] if layers else 1,
        # the public code hands out the primes >= engram_vocab_size, flashtrain those > engram_min_rows
        "engram_vocab_size": cfg.engram_min_rows + 1 if layers else 0,
        "engram_n_heads": cfg.engram_heads if layers else 0,
        "engram_head_dim": cfg.engram_dim if layers else 0,
    }
    config.update({k: engram[k] for k in TOKENIZER_KEYS if k in engram})
    if cfg.vision_n_layers > 0:
        config.update({k: getattr(cfg, k) for k in (
            "vision_n_layers", "vision_dim", "vision_n_heads", "vision_inter_dim", "vision_patch_size",
            "vision_rope_theta", "vision_downsample_ratio", "vision_max_n_token", "vision_min_pixels",
            "vision_max_wh_ratio")})
        # None: the tokenizer's pad id (conf/model.py), which config.json states as engram_pad_id
        image_token = cfg.image_token_id if cfg.image_token_id is not None else engram.get("engram_pad_id")
        if image_token is not None:
            config["image_token_id"] = image_token
    # `dtype` (fp8) and `expert_dtype` (fp4) are the public defaults and stay out: transformers'
    # AutoTokenizer reads config.json as a model config, where "fp8" is not a torch dtype
    return config


# fields the tokenizer decides; flashtrain builds its compression map from the run's tokenizer and
# compares the class count separately (trainer/interop/convert.py)
TOKENIZER_KEYS = ("engram_pad_id", "engram_compressed_vocab_size")
# runtime sizes, not the model: the public code sizes its caches from them
RUNTIME_KEYS = ("max_seq_len", "max_batch_size", "temperature")


def drafter_config(cfg: ModelConfig, taps: list[int], noise_id: int) -> dict[str, Any]:
    """config.json's drafter fields for the DSpark drafter `cfg` sizes (taps and noise id resolved,
    model/dspark.py); the drafter's entries of compress_ratios (window only) follow the backbone's."""
    return {"n_mtp_layers": cfg.dspark_layers, "dspark_block_size": cfg.dspark_block,
            "dspark_noise_token_id": noise_id, "dspark_target_layer_ids": list(taps),
            "dspark_markov_rank": cfg.dspark_markov_rank,
            "dspark_n_routed_experts": cfg.dspark_routed_experts,
            "dspark_n_activated_experts": cfg.dspark_activated_experts}


# config.json's drafter field -> the model config key that sets it
DRAFTER_SETTINGS = {"n_mtp_layers": "dspark_layers", "dspark_block_size": "dspark_block",
                    "dspark_noise_token_id": "dspark_noise_id", "dspark_target_layer_ids": "dspark_taps",
                    "dspark_markov_rank": "dspark_markov_rank",
                    "dspark_n_routed_experts": "dspark_routed_experts",
                    "dspark_n_activated_experts": "dspark_activated_experts"}


def drafter_mismatches(expected: dict[str, Any], found: dict[str, Any]) -> list[str]:
    """config.json's drafter fields that disagree with the drafter the model config sizes, one line
    each, read as the public code reads them: an absent field is the reference's default, an expert
    count of 0 the backbone's, and the target layers are concatenated in layer order."""
    def value(key):
        got = found.get(key, REFERENCE_DEFAULTS[key])
        if key == "dspark_n_routed_experts" and not got:
            got = found.get("n_routed_experts", REFERENCE_DEFAULTS["n_routed_experts"])
        elif key == "dspark_n_activated_experts" and not got:
            got = found.get("n_activated_experts", REFERENCE_DEFAULTS["n_activated_experts"])
        elif key == "dspark_target_layer_ids":
            got = sorted(got)
        return got

    problems = []
    for key in DRAFTER_KEYS:
        got, want = value(key), expected[key]
        if _normalise(got) != _normalise(want):
            where = "" if key in found else " (absent: the public default)"
            problems.append(f"config.json {key}={got!r}{where} but the drafter has {want!r} "
                            f"(model.{DRAFTER_SETTINGS[key]})")
    n_layers = found.get("n_layers", REFERENCE_DEFAULTS["n_layers"])
    ratios = list(found.get("compress_ratios", REFERENCE_DEFAULTS["compress_ratios"]))[n_layers:]
    if ratios != [0] * expected["n_mtp_layers"]:
        problems.append(f"config.json compress_ratios past n_layers={n_layers} are {ratios}, but the "
                        f"drafter's {expected['n_mtp_layers']} blocks attend over the window only (0 each)")
    return problems


def config_mismatches(expected: dict[str, Any], found: dict[str, Any]) -> list[str]:
    """Fields of config.json that disagree with the model config, one line each. An absent field
    means the reference's default; compress_ratios may go on past n_layers (the drafter's layers)."""
    problems = []
    for key, want in expected.items():
        if key in TOKENIZER_KEYS or key in RUNTIME_KEYS or key == "n_mtp_layers":
            continue
        if key not in found and key not in REFERENCE_DEFAULTS:
            problems.append(f"config.json lacks {key}")
            continue
        got = found.get(key, REFERENCE_DEFAULTS.get(key))
        if key == "compress_ratios" and isinstance(got, list):
            got = got[:len(want)]
        if _normalise(got) != _normalise(want):
            where = "" if key in found else " (absent: the public default)"
            problems.append(f"config.json {key}={got!r}{where} but the model has {want!r}")
    for key in ("dtype", "expert_dtype"):  # storage: the layout has FP8 linears and FP4 experts
        if found.get(key, REFERENCE_DEFAULTS[key]) != REFERENCE_DEFAULTS[key]:
            problems.append(f"config.json {key}={found[key]!r} but the layout stores "
                            f"{REFERENCE_DEFAULTS[key]!r}")
    return problems


def _normalise(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return [_normalise(x) for x in v]
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    return float(v)
