"""The DeepSeek-V4.1-Flash language model: CED layer stack with CSA2 attention, MoE, mHC
residual streams and Engram memories (docs/ARCHITECTURE.md §1-6).

Layers [0, n_encoder_layers) are the causal encoder, the rest the decoder. The decoder's
single global KV is written by its first layer (a Full layer) from that layer's input,
which is the encoder output H_20 after the mHC pre-mix and attention norm; every later
decoder layer reads it. So a prompt's global KV needs only the encoder (CED prefill).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from conf.model import ModelConfig
from model.attention import CSA2Attention
from model.engram import Engram, compressed_vocab
from model.indexer import IndexQuery
from model.mhc import HyperConnection, initial_pre, mix_streams, update_streams
from model.moe import MoE, RoutedExperts
from model.numerics import RMSNorm, wide
from model.plan import LayerSpec, build_layer_plan
from model.runtime import AttentionRuntime, SequenceShard
from model.vision import ImageBatch, VisionAttention, VisionInput


@dataclass
class ModelOutput:
    loss: Optional[torch.Tensor] = None  # lm + balance + indexer losses
    lm_loss: Optional[torch.Tensor] = None
    balance_loss: Optional[torch.Tensor] = None
    indexer_loss: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None  # [B, T, V] (only when no labels are given)
    topk_recall: Optional[torch.Tensor] = None  # dense attention mass held by the top-k (collect_recall)
    pool_recall: Optional[torch.Tensor] = None  # ... and by the layer-20 candidate pool
    runtime: Optional[AttentionRuntime] = None  # the forward's top-k and pools (keep_runtime=True)


class Block(nn.Module):
    """One layer: attention and MoE sub-layers, each wrapped in single-pass mHC."""

    # the stream ops; model.ops.KernelPolicy may swap in Triton kernels
    mix_streams = staticmethod(mix_streams)
    update_streams = staticmethod(update_streams)
    # the attention sub-layer's module (the DSpark drafter's blocks attend differently: model/dspark.py)
    attention_cls = CSA2Attention

    def __init__(self, cfg: ModelConfig, spec: LayerSpec):
        super().__init__()
        self.spec = spec
        hc = dict(dim=cfg.dim, n_streams=cfg.hc_mult, sinkhorn_iters=cfg.hc_sinkhorn_iters, eps=cfg.hc_eps,
                  norm_eps=cfg.norm_eps)
        self.attn_hc = HyperConnection(**hc)
        self.attn_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = self.attention_cls(cfg, spec)
        self.ffn_hc = HyperConnection(**hc)
        self.ffn_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.moe = MoE(cfg.dim, cfg.n_routed_experts, cfg.n_shared_experts, cfg.n_activated_experts,
                       cfg.moe_inter_dim, cfg.route_scale, cfg.swiglu_limit, cfg.seq_aux_alpha,
                       vision=cfg.vision_n_layers > 0)

    def forward(self, h: torch.Tensor, pre: torch.Tensor,
                rt: AttentionRuntime) -> tuple[torch.Tensor, torch.Tensor]:
        """h [B, T, n, D] streams, pre [B, T, n] this layer's input mix -> (h', the next layer's pre)."""
        post, comb, ffn_pre = self.attn_hc(h)
        h = self.update_streams(h, self.attention(self.mix_streams(pre, h), rt), post, comb)
        post, comb, next_pre = self.ffn_hc(h)
        return self.update_streams(h, self.ffn(self.mix_streams(ffn_pre, h), rt), post, comb), next_pre

    def attention(self, x: torch.Tensor, rt: AttentionRuntime) -> torch.Tensor:
        """The attention sub-layer: its mixed input x [B, T, D] -> its output [B, T, D]."""
        return self.attn(self.attn_norm(x), rt)

    def ffn(self, x: torch.Tensor, rt: AttentionRuntime) -> torch.Tensor:
        """The MoE sub-layer: x [B, T, D] -> [B, T, D]; its balance loss goes to rt.aux_losses."""
        y, balance = self.moe(self.ffn_norm(x), rt.shard, rt.image_mask)
        rt.aux_losses.append(balance)
        return y


def head_cross_entropy(x: torch.Tensor, head: nn.Linear, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of x [N, D] through `head` against labels [N] (-100 = ignore),
    the logits in fp32."""
    return F.cross_entropy(wide(head(x)), labels, ignore_index=-100)


class Transformer(nn.Module):
    # the ops; model.ops.KernelPolicy may swap in Triton kernels (the head and its loss fused, with
    # the gradients taken in the forward: model/kernels/cross_entropy.py), and model.chunking the
    # loss over chunks of tokens
    mix_streams = staticmethod(mix_streams)
    head_loss = staticmethod(head_cross_entropy)

    def __init__(self, cfg: ModelConfig, lookup_map: Optional[torch.Tensor] = None, lookup_pad_id: int = 0):
        """lookup_map [V]: the tokenizer compression map that turns token ids into Engram lookup
        ids (identity when None)."""
        super().__init__()
        if cfg.vocab_size is None:
            raise ValueError("model.vocab_size is unset: the trainer fills it from the tokenizer")
        self.cfg = cfg
        self.plan = build_layer_plan(cfg)
        V, D = cfg.vocab_size, cfg.dim
        self.embed = nn.Embedding(V, D)
        n_lookup = V if lookup_map is None else compressed_vocab(lookup_map)
        self.engrams = nn.ModuleDict({str(s.layer_id): Engram(cfg, s.layer_id, pad_id=lookup_pad_id,
                                                              compressed_vocab=n_lookup)
                                      for s in self.plan.layers if s.engram})
        self.layers = nn.ModuleList(Block(cfg, spec) for spec in self.plan.layers)
        self.norm = RMSNorm(D, eps=cfg.norm_eps)
        self.head = nn.Linear(D, V, bias=False)
        # the ViT, its projector and the image delimiters (docs/ARCHITECTURE.md §9)
        self.visual = VisionInput(cfg) if cfg.vision_n_layers > 0 else None
        if lookup_map is None:
            lookup_map = torch.arange(V)
        if lookup_map.shape != (V,):
            raise ValueError(f"lookup map has shape {tuple(lookup_map.shape)}, expected ({V},)")
        self.register_buffer("lookup_map", lookup_map.long())
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, init_std) everywhere; projections that write into the residual streams get
        init_std / sqrt(2 * n_layers) so the streams' variance does not grow with depth."""
        std, out_std = self.cfg.init_std, self.cfg.init_std / (2 * self.cfg.n_layers) ** 0.5
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=out_std if name.endswith(("wo_b", "w2", "wo")) else std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, HyperConnection):
                module.reset_parameters()
            elif isinstance(module, RoutedExperts):
                for w in (module.w1, module.w3):
                    nn.init.normal_(w, std=std)
                nn.init.normal_(module.w2, std=out_std)
            elif isinstance(module, CSA2Attention):
                nn.init.normal_(module.wo_a, std=std)
                nn.init.zeros_(module.sink)
            elif isinstance(module, Engram):
                module.reset_parameters()
        for layer in self.layers:
            nn.init.normal_(layer.moe.router.weight, std=std)
        visual = getattr(self, "visual", None)  # the DSpark drafter shares these rules and has no tower
        if visual is not None:
            for delimiter in (visual.image_start, visual.image_end, visual.image_newline):
                nn.init.normal_(delimiter, std=std)

    def routers(self):
        return [layer.moe.router for layer in self.layers]

    def head_splits(self) -> dict[str, int]:
        """Projections whose output rows are per-head blocks: name -> heads (for head-wise Muon)."""
        splits = {}
        for name, module in self.named_modules():
            if isinstance(module, CSA2Attention):
                splits[f"{name}.wq_b.weight"] = module.n_heads
            elif isinstance(module, IndexQuery):
                splits[f"{name}.wq_b.weight"] = module.n_heads
            elif isinstance(module, VisionAttention):  # rows: q, k, v, each n_heads blocks
                splits[f"{name}.wqkv.weight"] = 3 * module.n_heads
        return splits

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                doc_ids: Optional[torch.Tensor] = None, collect_recall: bool = False,
                keep_runtime: bool = False, shard: Optional[SequenceShard] = None,
                indexer_mode: Optional[str] = None, token_types: Optional[torch.Tensor] = None,
                images: Optional[ImageBatch] = None) -> ModelOutput:
        """input_ids [B, T]; labels [B, T] (-100 = ignore); doc_ids [B, T] document index of each
        position (attention never crosses documents). With labels: losses; without: logits.
        `shard`: the tokens are a slice of a longer sequence (context parallelism). indexer_mode:
        "sparse" | "dense" for this call (None: model.indexer_mode). token_types [B, T] (conf.model's
        TEXT or an image-span type) and `images`: the images whose features fill the IMAGE positions."""
        B, T = input_ids.shape
        rt = AttentionRuntime(B, T, input_ids.device, doc_ids,
                              with_indexer_loss=(labels is not None and self.training
                                                 and self.cfg.indexer_loss_coef > 0),
                              indexer_mode=indexer_mode or self.cfg.indexer_mode,
                              collect_recall=collect_recall, shard=shard, token_types=token_types)
        x = self.hidden(input_ids, rt, images)  # [B, T, D]
        rt.seal()  # what an activation-checkpoint recomputation writes later is dropped
        if labels is None:
            return ModelOutput(logits=wide(self.head(x)), runtime=rt if keep_runtime else None)
        lm = self.lm_loss(x, labels)
        balance = torch.stack(rt.aux_losses).sum() if rt.aux_losses else lm.new_zeros(())
        indexer = torch.stack(rt.indexer_losses).mean() if rt.indexer_losses else lm.new_zeros(())
        recall = {k: torch.stack(v).mean() for k, v in rt.recall.items() if v}
        return ModelOutput(loss=lm + balance + indexer, lm_loss=lm, balance_loss=balance,
                           indexer_loss=indexer, topk_recall=recall.get("topk"),
                           pool_recall=recall.get("pool"))

    def lm_loss(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of x [B, T, D] against labels [B, T]."""
        flat_x, flat_y = x.reshape(-1, x.shape[-1]), labels.reshape(-1)  # [N, D], [N]
        return self.head_loss(flat_x, self.head, flat_y)

    def hidden(self, input_ids: torch.Tensor, rt: AttentionRuntime,
               images: Optional[ImageBatch] = None) -> torch.Tensor:
        """input_ids [B, T] -> final normed hidden state [B, T, D]."""
        h, pre = self.embed_streams(input_ids, rt, images)
        h, pre = self.run_layers(h, pre, input_ids, rt, self.layers)
        return self.norm(self.mix_streams(pre, h))

    def embed_streams(self, input_ids: torch.Tensor, rt: Optional[AttentionRuntime] = None,
                      images: Optional[ImageBatch] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [B, T] -> streams h [B, T, n, D] and the first sub-layer's one-hot pre-mix.
        Image spans (rt.token_types) take the vision features and delimiter embeddings instead."""
        h = self.embed(input_ids)  # [B, T, D] in the table's dtype
        if rt is not None and rt.image_mask is not None and bool(rt.image_mask.any()):
            if self.visual is None:
                raise ValueError("the batch has image tokens but the model has no vision tower "
                                 "(model.vision_n_layers=0)")
            h = self.visual.embed(h, rt.token_types, images or ImageBatch([], [], [], []))
        dev = h.device.type
        if not self.cfg.fp32_residual and torch.is_autocast_enabled(dev):
            h = h.to(torch.get_autocast_dtype(dev))  # every residual update keeps the streams' dtype
        h = h.unsqueeze(2).expand(-1, -1, self.cfg.hc_mult, -1).contiguous()  # [B, T, n, D]
        return h, initial_pre(h)

    def run_layers(self, h: torch.Tensor, pre: torch.Tensor, input_ids: torch.Tensor, rt: AttentionRuntime,
                   layers) -> tuple[torch.Tensor, torch.Tensor]:
        """Streams of the tokens input_ids [B, T] through `layers` (each preceded by its Engram)."""
        lookup, history = self.lookup_ids(input_ids, rt)
        for layer in layers:
            if layer.spec.engram:
                h = self.add_engram(layer, h, lookup, rt, history)
            h, pre = layer(h, pre, rt)
        return h, pre

    def add_engram(self, layer, h: torch.Tensor, lookup: torch.Tensor, rt: AttentionRuntime,
                   history: Optional[torch.Tensor]) -> torch.Tensor:
        """The streams h [B, T, n, D] with the Engram memory before `layer` added: n-grams start at
        rt.ngram_start (a document start or the end of an image span), and image-span positions take
        no memory (the public gate is shut there)."""
        out = self.engrams[str(layer.spec.layer_id)](h, lookup, rt.ngram_start, rt.positions, history)
        return out if rt.image_mask is None else torch.where(rt.image_mask[:, :, None, None], h, out)

    def lookup_ids(self, input_ids: torch.Tensor, rt: AttentionRuntime):
        """The Engram lookup ids of input_ids [B, T] and of the shard's history (None without Engrams)."""
        lookup = self.lookup_map[input_ids] if len(self.engrams) else None
        history = rt.shard.history
        if history is not None and lookup is not None:
            history = self.lookup_map[history]
        return lookup, history

    def forward_ced(self, input_ids: torch.Tensor, replay: int,
                    shard: Optional[SequenceShard] = None) -> torch.Tensor:
        """CED prefill with bounded replay (docs/ARCHITECTURE.md §2) -> logits [B, R, V] of the last R =
        min(replay, N) positions of input_ids [B, N] (one document).

        The encoder layers run over all N tokens. The decoder's global KV comes from the encoder
        output, for all N tokens, through the first decoder layer's KV writer. The decoder layers
        run over the last R tokens only: their window sees replayed tokens only, and those
        tokens' deeper-layer state never saw older tokens' decoder state (the approximation the
        boundary makes; exact when N <= replay). `shard`: the decode cache (inference)."""
        B, N = input_ids.shape
        R = min(replay, N)
        n_enc = self.plan.n_encoder_layers
        owner = self.layers[n_enc] if n_enc < len(self.layers) else None
        if owner is None or not owner.spec.owns_kv:
            raise ValueError("CED prefill needs a decoder whose first layer owns the global KV")
        rt = AttentionRuntime(B, N, input_ids.device, shard=shard)
        h, pre = self.embed_streams(input_ids)
        h, pre = self.run_layers(h, pre, input_ids, rt, self.layers[:n_enc])
        owner.attn.write_global_kv(owner.attn_norm(self.mix_streams(pre, h)), rt)  # [B, N] entries from H_enc
        keys = {(owner.spec.layer_id, "kv"): rt.kv[owner.spec.layer_id],
                (owner.spec.layer_id, "index_k"): rt.index_k[owner.spec.layer_id]}
        replay_shard = rt.shard.replay(N - R, N, keys, input_ids)
        rt_dec = AttentionRuntime(B, R, input_ids.device, shard=replay_shard)
        h, pre = self.run_layers(h[:, N - R:], pre[:, N - R:], input_ids[:, N - R:], rt_dec,
                                 self.layers[n_enc:])
        return wide(self.head(self.norm(self.mix_streams(pre, h))))
