"""DSpark drafter (docs/ARCHITECTURE.md §8, §11): a small model trained after the target, which stays
frozen, that proposes `dspark_block` next tokens at once for the target to verify in one forward.

Inputs at a decode step whose newest token (the anchor) sits at position p:
  context  the inputs of the target's tap layers (the streams entering each, after its Engram; by
           default the last three layers) at positions < p, averaged over the mHC streams,
           concatenated in layer order, projected to the model width and normed: one row per
           position, the last `window` of them visible. These are the public code's
           `dspark_target_layer_ids` reads, so a released drafter runs here unchanged
  block    K rows: the anchor's embedding, then K-1 copies of a noise token's embedding, at positions
           p .. p+K-1 (the target's embedding table)
Three blocks (mHC streams, window-only attention, their own MoE) run the K block rows at once: every
block row attends to the visible context rows and to all K block rows. Row i's hidden state, through
the drafter's norm and the target's LM head, gives the base logits of the token at p+i+1.
  Markov head   adds a bias from the previous token (the anchor for row 0, draft i-1 for row i):
                w2(w1[prev]), rank `dspark_markov_rank`; the rows are therefore sampled in order
  confidence    sigmoid(proj([hidden_i, w1[prev]])): the chance that draft i is accepted given the
                drafts before it were; trained on detached inputs, so it never shapes the drafts

Training (`draft_loss`): per anchor, the KL from the target's next-token distribution at p+i (the
frozen target's forward over the same sequence) to the drafter's, with the true token at p+i as the
Markov head's previous token; the confidence head learns 1 - TV(target, draft), which is the chance
that speculative sampling accepts a draft at that position.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from conf.model import ModelConfig
from model.attention import CSA2Attention, grouped_projection
from model.mhc import initial_pre, mix_streams
from model.numerics import RMSNorm, wide
from model.plan import build_layer_plan
from model.transformer import Block, Transformer


def draft_config(cfg: ModelConfig) -> ModelConfig:
    """The drafter's blocks as a model config: the target's widths, `dspark_layers` window-only
    layers, its own MoE, no Engram."""
    n = cfg.dspark_layers
    return dataclasses.replace(cfg, name=f"{cfg.name}-dspark", n_layers=n, n_encoder_layers=n, n_swa_layers=n,
                               compress_ratios=[0] * n, layer_modes=["swa"] * n, engram_layers=[],
                               n_routed_experts=cfg.dspark_routed_experts,
                               n_activated_experts=cfg.dspark_activated_experts, indexer_loss_coef=0.0)


def tap_layers(cfg: ModelConfig) -> list[int]:
    """The target layers whose inputs feed the drafter, in layer order (default: the last three).
    Layer order because the public code concatenates them so, whatever order its config lists."""
    taps = list(cfg.dspark_taps) if cfg.dspark_taps is not None else list(range(cfg.n_layers))[-3:]
    if not taps or len(set(taps)) != len(taps) or any(not 0 <= t < cfg.n_layers for t in taps):
        raise ValueError(f"dspark_taps={taps}: expected distinct target layer ids in [0, {cfg.n_layers})")
    return sorted(taps)


class DraftRuntime:
    """What the draft blocks read besides their streams (it stands where the target's blocks take an
    AttentionRuntime): the context rows and which of them each anchor sees."""

    def __init__(self, context: torch.Tensor, visible: torch.Tensor, context_pos: torch.Tensor,
                 anchor_pos: torch.Tensor):
        self.context = context  # [B, S, D] projected tap rows
        self.visible = visible  # [B, A, S] bool: context row s is in anchor a's window
        self.context_pos = context_pos  # [B, S]
        self.anchor_pos = anchor_pos  # [B, A]
        self.shard = None
        self.image_mask = None  # the drafter reads no images: every row routes as text
        self.aux_losses: list[torch.Tensor] = []


class DraftAttention(CSA2Attention):
    """The window attention of a draft block (the same projections as a target SWA layer): each
    block row's queries over the visible context rows' and its block's K rows' latents, with the
    per-head sink in one softmax; values carry RoPE, taken back out by the query position."""

    def forward(self, x: torch.Tensor, rt: DraftRuntime) -> torch.Tensor:
        """x [B, A*K, D] (normed; A anchors of K rows) -> [B, A*K, D]."""
        B, AK, _ = x.shape
        A = rt.anchor_pos.shape[1]
        K, H, C = AK // A, self.n_heads, self.kv_dim
        pos = rt.anchor_pos[:, :, None] + torch.arange(K, device=x.device)  # [B, A, K]
        angles = self.rotary.angles(pos)  # [B, A, K, R/2]
        q = self.wq_b(self.q_norm(self.wq_a(x))).view(B, A, K, H, C)
        q = self.rotary(q, angles.unsqueeze(-2))
        k_block = self.rotary(self.kv_norm(self.wkv(x)).view(B, A, K, C), angles)  # [B, A, K, C]
        ctx_angles = self.rotary.angles(rt.context_pos)
        k_ctx = self.rotary(self.kv_norm(self.wkv(rt.context)), ctx_angles)  # [B, S, C]
        s_ctx = wide(torch.einsum("bakhc,bsc->bakhs", q, k_ctx)) * self.scale
        s_ctx = s_ctx.masked_fill(~rt.visible[:, :, None, None, :], float("-inf"))
        s_block = wide(torch.einsum("bakhc,bajc->bakhj", q, k_block)) * self.scale
        sink = wide(self.sink).view(1, 1, 1, H, 1).expand(B, A, K, H, 1)
        p = torch.cat((s_ctx, s_block, sink), dim=-1).softmax(-1)  # [B, A, K, H, S + K + 1]
        S = k_ctx.shape[1]
        out = (torch.einsum("bakhs,bsc->bakhc", p[..., :S].to(q.dtype), k_ctx)
               + torch.einsum("bakhj,bajc->bakhc", p[..., S:S + K].to(q.dtype), k_block))
        out = self.rotary(out, angles.unsqueeze(-2), inverse=True)
        grouped = out.reshape(B, AK, H * C).unflatten(-1, (self.wo_a.shape[0], -1))  # [B, AK, G, H/G*C]
        return self.wo_b(grouped_projection(grouped, self.wo_a).flatten(2))


class DraftBlock(Block):
    """A target block whose attention is the draft block's (same parameters and names)."""

    attention_cls = DraftAttention


class MarkovHead(nn.Module):
    """bias(prev) = w2(w1[prev]): a rank-r previous-token logit bias; w1[prev] also feeds the
    confidence head. w2 starts at zero, so the drafter starts from its base logits."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.w1 = nn.Embedding(vocab, rank)
        self.w2 = nn.Linear(rank, vocab, bias=False)

    def forward(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """prev [...] token ids -> (logit bias [..., V] fp32, embedding [..., r])."""
        e = self.w1(prev)
        return wide(self.w2(e)), e


class ConfidenceHead(nn.Module):
    def __init__(self, dim: int, rank: int):
        super().__init__()
        self.proj = nn.Linear(dim + rank, 1, bias=False)

    def forward(self, hidden: torch.Tensor, markov: torch.Tensor) -> torch.Tensor:
        """hidden [..., D], markov embedding [..., r] -> acceptance logit [...] (fp32)."""
        return wide(self.proj(torch.cat((hidden, markov.to(hidden.dtype)), dim=-1)))[..., 0]


@dataclass
class DraftLoss:
    loss: torch.Tensor  # kl + confidence + balance
    kl: torch.Tensor  # mean KL(target || draft) per position
    confidence: torch.Tensor  # BCE of the confidence head against 1 - TV
    balance: torch.Tensor
    accept: torch.Tensor  # [K] mean 1 - TV(target, draft) per draft position (acceptance at T=1)
    top1: torch.Tensor  # [K] share of positions where the draft's argmax is the target's (greedy)
    positions: torch.Tensor  # [K] positions counted per draft position


class DSpark(nn.Module):
    def __init__(self, target_cfg: ModelConfig):
        super().__init__()
        if target_cfg.vocab_size is None:
            raise ValueError("model.vocab_size is unset: the trainer fills it from the tokenizer")
        self.target_cfg = target_cfg
        self.cfg = draft_config(target_cfg)
        self.plan = build_layer_plan(self.cfg)
        self.taps = tap_layers(target_cfg)
        self.block = target_cfg.dspark_block
        V, D = target_cfg.vocab_size, target_cfg.dim
        noise = target_cfg.dspark_noise_id
        self.noise_id = V - 1 if noise is None else noise
        if not 0 <= self.noise_id < V or self.block < 1:
            raise ValueError(f"dspark_noise_id={noise} / dspark_block={self.block}: need an id in [0, {V}) "
                             "and at least one draft position")
        self.main_proj = nn.Linear(len(self.taps) * D, D, bias=False)
        self.main_norm = RMSNorm(D, eps=target_cfg.norm_eps)
        self.layers = nn.ModuleList(DraftBlock(self.cfg, spec) for spec in self.plan.layers)
        self.norm = RMSNorm(D, eps=target_cfg.norm_eps)
        self.markov = MarkovHead(V, target_cfg.dspark_markov_rank)
        self.confidence = ConfidenceHead(D, target_cfg.dspark_markov_rank)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        Transformer.reset_parameters(self)  # the target's initialisation rules, by module type
        nn.init.zeros_(self.markov.w2.weight)
        nn.init.zeros_(self.confidence.proj.weight)

    def routers(self):
        return [layer.moe.router for layer in self.layers]

    def context(self, taps: torch.Tensor) -> torch.Tensor:
        """taps [B, T, n_taps * D] -> context rows [B, T, D]."""
        return self.main_norm(self.main_proj(taps))

    def hidden(self, embed: nn.Embedding, context: torch.Tensor, visible: torch.Tensor,
               context_pos: torch.Tensor, anchor_ids: torch.Tensor, anchor_pos: torch.Tensor) -> torch.Tensor:
        """The block rows' final hidden states [B, A, K, D] (before the norm) for anchors anchor_ids
        [B, A] at anchor_pos [B, A]; context [B, S, D] at context_pos [B, S], visible [B, A, S]."""
        B, A = anchor_ids.shape
        K = self.block
        ids = torch.full((B, A, K), self.noise_id, dtype=torch.long, device=anchor_ids.device)
        ids[..., 0] = anchor_ids
        h = embed(ids.view(B, A * K)).to(context.dtype)  # [B, AK, D]
        h = h.unsqueeze(2).expand(-1, -1, self.cfg.hc_mult, -1).contiguous()  # [B, AK, n, D]
        pre = initial_pre(h)
        rt = DraftRuntime(context, visible, context_pos, anchor_pos)
        for layer in self.layers:
            h, pre = layer(h, pre, rt)
        self._balance = torch.stack(rt.aux_losses).sum() if rt.aux_losses else h.new_zeros(())
        return mix_streams(pre, h).view(B, A, K, -1)

    def base_logits(self, head: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., D] -> logits [..., V] fp32 through the drafter's norm and the target's head."""
        return wide(head(self.norm(hidden)))

    def draft_loss(self, target: Transformer, taps: torch.Tensor, input_ids: torch.Tensor,
                   target_logits: torch.Tensor, doc_ids: Optional[torch.Tensor] = None,
                   anchor_stride: int = 1, anchor_offset: int = 0) -> DraftLoss:
        """taps [B, N, n_taps * D] and target_logits [B, N, V] of the frozen target's forward over
        input_ids [B, N]; anchors at positions 1 + anchor_offset, every anchor_stride."""
        B, N = input_ids.shape
        K, W, dev = self.block, self.cfg.window, input_ids.device
        if doc_ids is None:
            doc_ids = torch.zeros_like(input_ids)
        anchors = torch.arange(1 + anchor_offset % anchor_stride, N - 1, anchor_stride, device=dev)  # [A]
        if anchors.numel() == 0:
            raise ValueError(f"sequences of {N} tokens leave no anchor with a next token")
        A = anchors.numel()
        anchor_pos = anchors.expand(B, A)
        ctx_pos = torch.arange(N, device=dev).expand(B, N)
        doc_at = doc_ids[:, anchors]  # [B, A]
        s, a = ctx_pos[:, None, :], anchor_pos[..., None]
        visible = (s < a) & (s >= a - W) & (doc_ids[:, None, :] == doc_at[..., None])  # [B, A, N]
        hidden = self.hidden(target.embed, self.context(taps), visible, ctx_pos, input_ids[:, anchors],
                             anchor_pos)
        # row i predicts the token at anchor + i + 1; its previous token (the Markov head's input)
        # is the one at anchor + i, the true token while training
        at = (anchors[:, None] + torch.arange(K, device=dev)).clamp(max=N - 1)  # [A, K]
        valid = (anchors[:, None] + torch.arange(K, device=dev) + 1 < N).expand(B, A, K) & (
            doc_ids[:, (at + 1).clamp(max=N - 1)] == doc_at[..., None])  # [B, A, K]
        prev = input_ids[:, at]  # [B, A, K]
        bias, markov_e = self.markov(prev)
        logq = (self.base_logits(target.head, hidden) + bias).log_softmax(-1)  # [B, A, K, V]
        p = wide(target_logits[:, at]).softmax(-1)  # [B, A, K, V]
        w = valid.to(logq.dtype)
        count = w.sum().clamp(min=1)
        kl_rows = (p * (p.clamp(min=1e-30).log() - logq)).sum(-1)
        kl = (kl_rows * w).sum() / count
        with torch.no_grad():
            accept = 1 - 0.5 * (p - logq.exp()).abs().sum(-1)  # [B, A, K]
            top1 = (logq.argmax(-1) == p.argmax(-1)).to(w.dtype)
        conf_logit = self.confidence(hidden.detach(), markov_e.detach())
        conf = (F.binary_cross_entropy_with_logits(conf_logit, accept, reduction="none") * w).sum() / count
        per_pos = w.sum((0, 1))
        balance = self._balance
        return DraftLoss(loss=kl + conf + balance, kl=kl, confidence=conf, balance=balance,
                         accept=(accept * w).sum((0, 1)) / per_pos.clamp(min=1),
                         top1=(top1 * w).sum((0, 1)) / per_pos.clamp(min=1), positions=per_pos)


class TapRecorder:
    """Records the inputs of the target's tap layers (the streams entering each block, after its
    Engram), averaged over the mHC streams, in every forward the target runs while inside
    (training, prefill, decode and verification alike): forward pre-hooks, so the target's code
    does not change. The forwards between two `take`s must run over consecutive positions (a
    prefix cache's replay of a prefix's last tokens, then the rest of the prompt)."""

    def __init__(self, target: Transformer, taps: list[int]):
        self.target, self.taps = target, taps
        self.outputs: dict[int, list[torch.Tensor]] = {}
        self._handles = []

    def __enter__(self) -> TapRecorder:
        for t in self.taps:
            def hook(module, args, t=t):
                h = args[0]  # streams [B, T, n, D]
                pending = args[3] if len(args) > 3 else None
                if pending is not None:  # the fused schedule (model/fused_mhc.py) hands a block the
                    h = module.update_streams(h, *pending)  # streams before the last MoE update
                self.outputs.setdefault(t, []).append(h.mean(2))  # [B, T, D]
            self._handles.append(self.target.layers[t].register_forward_pre_hook(hook))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def take(self) -> torch.Tensor:
        """The taps of the forwards since the last take, their positions in order, concatenated in
        tap order: [B, T, n_taps * D]."""
        missing = [t for t in self.taps if t not in self.outputs]
        if missing:
            raise RuntimeError(f"the target forward ran none of the tap layers {missing}")
        out = torch.cat([torch.cat(self.outputs[t], dim=1) for t in self.taps], dim=-1)
        self.outputs = {}
        return out
