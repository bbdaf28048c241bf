"""Model configs: the DeepSeek-V4.1-Flash architecture (docs/ARCHITECTURE.md §1-6, §11) at three sizes.

`flash` is the published model; `small` is ~1-2B parameters for single-GPU benchmarks;
`tiny` trains on a CPU in minutes. All three build the same module graph.
"""
from dataclasses import dataclass, field
from typing import Optional

# Token types of an image span, as the public image processor numbers them: every position of a
# sequence has one (TEXT outside spans). A span is IMAGE_START, then per row of the token grid the
# row's IMAGE tokens and one IMAGE_NEW_LINE, then IMAGE_END.
TEXT, IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = -1, 0, 1, 2, 3


@dataclass
class ModelConfig:
    name: str = "flash"
    vocab_size: Optional[int] = 129_280  # None = take the tokenizer's size
    dim: int = 5120
    n_layers: int = 40
    norm_eps: float = 1e-6
    init_std: float = 0.02
    loss_chunk_tokens: int = 0  # >0: the LM loss materialises logits for this many tokens at a time
    attn_chunk_tokens: int = 0  # >0: attention and indexer run this many queries at a time (>= window)
    # sparse: each query attends to its indexer top-k (the model as specified); dense: to every visible
    # entry, the indexer learning toward that attention (the long-context stage's warm-up sets it)
    indexer_mode: str = "sparse"
    # Triton kernels (model/kernels/): attention, indexer, mHC steps and stream mixes, Sinkhorn, ...
    kernels: bool = False
    # Starting weights of a training run (pretrain, long_context's first sub-stage, sft, rl, distill's
    # student): a flashtrain checkpoint (or a run's checkpoints/ dir, or a run dir), or a directory in
    # the public DeepSeek-V4.1-Flash layout (docs/post-train-released-model.md). Weights only; ignored
    # when the run resumes its own checkpoint. None: random init (rl and distill: the built-in SFT
    # makes the starting policy).
    init_from: Optional[str] = None

    # --- CED and the CSA2 layer plan (§2, §3). The plan is derived from these numbers
    # unless `compress_ratios` / `layer_modes` spell it out layer by layer.
    n_encoder_layers: int = 20  # layers [0, n_encoder_layers) are the causal encoder
    n_swa_layers: int = 2  # leading layers with window attention only
    encoder_compress_ratio: int = 2  # m on encoder layers
    decoder_compress_ratio: int = 1  # m on decoder layers
    encoder_group: int = 6  # encoder groups: one Full layer, then Reuse layers
    decoder_group: int = 4  # decoder groups: Full (first group) or Reindex, then Reuse
    compress_ratios: Optional[list[int]] = None  # explicit per-layer m (0 = SWA only)
    layer_modes: Optional[list[str]] = None  # explicit per-layer swa|full|reindex|reuse

    # --- attention (CSA2)
    n_heads: int = 64
    kv_dim: int = 512  # the shared latent, used as both K and V (MQA)
    rope_dim: int = 64  # trailing latent dims that carry RoPE
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    window: int = 128  # sliding-window keys per query, the query itself included
    rope_theta: float = 10_000.0  # SWA-only layers
    rope_theta_compressed: float = 160_000.0  # layers with a global (compressed) KV
    rope_factor: float = 16.0  # YaRN on compressed layers whenever original_seq_len > 0 (0 turns it off)
    original_seq_len: int = 65_536
    beta_fast: int = 32
    beta_slow: int = 1
    max_seq_len: int = 1_048_576
    attn_impl: str = "sparse"  # sparse (gather the selected set) | dense (masked; reference)

    # --- lightning indexer and the hierarchical candidate pool
    index_heads: int = 32
    index_dim: int = 128
    index_topk: int = 512
    pool_block: int = 8  # positions per block when building the layer-20 pool
    pool_blocks: int = 2048  # blocks kept per query
    indexer_loss_coef: float = 1.0  # KL of the indexer towards attention on the selected set

    # --- KV precision (§4)
    kv_quant: str = "off"  # off | qat

    # --- MoE
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    n_activated_experts: int = 6
    moe_inter_dim: int = 2304
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    bias_update_speed: float = 1e-3  # aux-loss-free balancing step
    seq_aux_alpha: float = 1e-4  # small sequence-wise balance loss (DeepSeek-V3)

    # --- mHC (§6)
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # Dtype of the residual streams under mixed precision: True keeps them fp32 (the embedding's dtype),
    # False holds them in the autocast dtype, as Megatron-LM does unless --fp32-residual-connection.
    # Without autocast the streams are in the parameters' dtype either way
    # (bench/reports/2026-12-06-design-history.md).
    fp32_residual: bool = False

    # --- Engram (§5)
    engram_layers: list[int] = field(default_factory=lambda: [1, 14])
    engram_orders: list[int] = field(default_factory=lambda: [2, 3, 4])
    engram_heads: int = 8
    engram_dim: int = 256
    engram_min_rows: int = 16_000_000  # each head's table size is the next unused prime above

    # --- DSpark drafter (§8): trained after the target, which stays frozen (model/dspark.py)
    dspark_layers: int = 3  # blocks, window attention only (over `window` context rows)
    dspark_block: int = 5  # draft positions proposed in parallel
    # target layers whose inputs feed it, the public dspark_target_layer_ids (None: the last 3)
    dspark_taps: Optional[list[int]] = None
    dspark_markov_rank: int = 256  # rank of the previous-token logit bias
    dspark_routed_experts: int = 128
    dspark_activated_experts: int = 3
    dspark_noise_id: Optional[int] = None  # the id of draft positions 1.. (None: the last vocabulary id)
    # --- vision input (§9): a ViT over 14x14 patches, its features grouped 3x3 into channels, an MLP
    # projector (`aligner`) into the backbone. vision_n_layers = 0: no vision tower (text only).
    vision_n_layers: int = 0
    vision_dim: int = 1024
    vision_n_heads: int = 16
    vision_inter_dim: int = 2816
    vision_patch_size: int = 14  # pixels per patch side
    vision_rope_theta: float = 10_000.0
    vision_downsample_ratio: int = 3  # pixel-unshuffle factor: 3x3 patch features -> one token
    vision_max_n_token: int = 1024  # an image's span (grid, newlines, start, end) is at most this long
    vision_min_pixels: int = 544 * 544  # smaller images are scaled up to about this many pixels
    vision_max_wh_ratio: Optional[float] = None  # wider images are stretched, not letterboxed (None: never)
    # the id every position of an image span carries in input_ids (token types tell the positions
    # apart); None: the tokenizer's pad id (a tokenizer trained here has no image token)
    image_token_id: Optional[int] = 129_264


@dataclass
class TinyModelConfig(ModelConfig):
    """CPU-sized: every component present, trains in minutes."""

    name: str = "tiny"
    vocab_size: Optional[int] = None
    dim: int = 128
    n_layers: int = 6  # swa, full, reuse | full, reuse, reindex: every mode, CED split 3/3
    n_encoder_layers: int = 3
    n_swa_layers: int = 1
    encoder_group: int = 2
    decoder_group: int = 2
    n_heads: int = 4
    kv_dim: int = 64
    rope_dim: int = 16
    q_lora_rank: int = 64
    o_groups: int = 2
    o_lora_rank: int = 64
    max_seq_len: int = 4096
    original_seq_len: int = 4096
    attn_impl: str = "dense"  # same function as sparse (tested); faster on a CPU at this size
    index_heads: int = 4
    index_dim: int = 32
    index_topk: int = 32
    pool_blocks: int = 8
    n_routed_experts: int = 8
    n_activated_experts: int = 2
    moe_inter_dim: int = 128
    route_scale: float = 1.0
    bias_update_speed: float = 1e-2  # short runs need faster balancing
    engram_layers: list[int] = field(default_factory=lambda: [1, 2])
    engram_heads: int = 2
    engram_dim: int = 32  # a multiple of 32, as the public FP8 table layout needs
    engram_min_rows: int = 1000
    dspark_markov_rank: int = 16
    dspark_routed_experts: int = 8
    dspark_activated_experts: int = 2
    # vision is opt-in here (model.vision_n_layers=2): the text-only Quickstart keeps its speed
    vision_dim: int = 64
    vision_n_heads: int = 4
    vision_inter_dim: int = 128
    vision_patch_size: int = 7
    vision_max_n_token: int = 64
    vision_min_pixels: int = 0
    image_token_id: Optional[int] = None


@dataclass
class SmallModelConfig(ModelConfig):
    """About 1-2B parameters in total: fits one H200 with room for long sequences."""

    name: str = "small"
    vocab_size: Optional[int] = None
    dim: int = 1024
    n_layers: int = 16
    n_encoder_layers: int = 8
    n_swa_layers: int = 1
    encoder_group: int = 3
    decoder_group: int = 2
    n_heads: int = 16
    kv_dim: int = 512
    rope_dim: int = 64
    q_lora_rank: int = 512
    o_groups: int = 4
    o_lora_rank: int = 512
    max_seq_len: int = 131_072
    original_seq_len: int = 65_536
    # long contexts: attention scores and logits exist for one chunk of queries / tokens at a time
    attn_chunk_tokens: int = 2048
    loss_chunk_tokens: int = 4096
    index_heads: int = 16
    index_dim: int = 128
    index_topk: int = 512
    pool_blocks: int = 512
    n_routed_experts: int = 32
    n_activated_experts: int = 4
    moe_inter_dim: int = 768
    engram_layers: list[int] = field(default_factory=lambda: [1, 5])
    engram_heads: int = 4
    engram_dim: int = 64
    engram_min_rows: int = 200_000
    dspark_markov_rank: int = 64
    dspark_routed_experts: int = 32
    # vision opt-in (model.vision_n_layers=12), so the text benchmarks' figures stay comparable
    vision_dim: int = 512
    vision_n_heads: int = 8
    vision_inter_dim: int = 1408
    image_token_id: Optional[int] = None


@dataclass
class FlashModelConfig(ModelConfig):
    """The published DeepSeek-V4.1-Flash (docs/ARCHITECTURE.md §11)."""

    name: str = "flash"
    norm_eps: float = 1e-20  # what the public reference gives the released model
    attn_chunk_tokens: int = 2048  # 64K-1M contexts: attention scores exist for one query chunk at a time
    loss_chunk_tokens: int = 4096
    vision_n_layers: int = 32  # the published vision tower
    dspark_noise_id: Optional[int] = 128_799  # the release's dspark_noise_token_id
