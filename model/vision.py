"""Vision input (docs/ARCHITECTURE.md §9): a ViT over image patches, a 3x3 pixel-unshuffle and an MLP
projector ("aligner") into the language backbone; the model writes the projected features over an
image's placeholder positions.

Names, shapes and the function follow the public DeepSeek-V4.1-Flash inference code, so that released
vision weights load one to one (`vision.*`, `aligner.*`, `image_start/end/newline`):
* Patches: each image is cut into `patch_size` x `patch_size` RGB patches in raster order, a patch
  flattened channel-major ([3, p, p] -> 3p^2); `patch_embed.proj` is a linear with bias (not a conv).
* Blocks: pre-RMSNorm (eps 1e-6); attention with a fused `wqkv` and `wo`, both with bias, full and
  bidirectional over the patches of one image; a bias-free SwiGLU MLP whose `w1` holds [gate | up].
* Position: 2-D RoPE only (no class token, no absolute embedding). Of a head's head_dim / 2 rotary
  frequencies theta^(-2i/(head_dim/2)), the first half rotate by the patch's row and the second half by
  its column; the rotation pairs dim d with d + head_dim / 2 (rotate-half), in fp32.
* Pixel-unshuffle: the [n_h, n_w, C] feature grid is zero-padded to multiples of r, and each r x r
  block becomes one token of C * r^2 channels ordered channel-major (c * r^2 + row * r + col, as
  F.unfold orders them), raster order over blocks.
* Aligner: w2(gelu(w1(x))), exact (erf) GELU, both linears with bias, into the backbone's dim.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from conf.model import IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START, ModelConfig
from model.numerics import RMSNorm

VISION_NORM_EPS = 1e-6  # the public vision tower's RMSNorm eps, whatever the backbone's norm_eps


@dataclass
class ImageBatch:
    """The images of a batch. Image i's patches [n_h_i * n_w_i, 3, p, p] fill, in raster order of its
    aligner grid, the IMAGE positions of row rows[i] of the batch from position starts[i] on; images
    are listed in (row, start) order, the order their IMAGE positions occur in the batch."""
    patches: list[torch.Tensor]
    grids: list[tuple[int, int]]  # (n_h, n_w) patch grid of each image
    rows: list[int]
    starts: list[int]

    def __len__(self) -> int:
        return len(self.patches)

    @classmethod
    def from_batch(cls, batch: dict) -> ImageBatch | None:
        """Takes the image_{patches,grids,rows,starts} lists out of a collated batch (data/images.py);
        None when the batch has none."""
        if "image_patches" not in batch:
            return None
        return cls(batch.pop("image_patches"), [tuple(g) for g in batch.pop("image_grids")],
                   batch.pop("image_rows"), batch.pop("image_starts"))

    def to(self, device) -> ImageBatch:
        return ImageBatch([p.to(device) for p in self.patches], self.grids, self.rows, self.starts)


def vision_rope(n_h: int, n_w: int, head_dim: int, theta: float,
                device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n_h * n_w, 1, head_dim / 2] of the patches in raster order: the first head_dim / 4
    angles are row * freq, the rest column * freq."""
    half = head_dim // 2
    freqs = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float32, device=device) / half))  # [half/2]
    rows = torch.arange(n_h, device=device, dtype=torch.float32).repeat_interleave(n_w)  # [N]
    cols = torch.arange(n_w, device=device, dtype=torch.float32).repeat(n_h)  # [N]
    angles = torch.cat((rows[:, None] * freqs, cols[:, None] * freqs), dim=-1)  # [N, half]
    return angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., N, H, Dh] rotated pairwise (d, d + Dh/2) by angles [N, 1, Dh/2], in fp32."""
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1).to(x.dtype)


def pixel_unshuffle(x: torch.Tensor, n_h: int, n_w: int, r: int) -> torch.Tensor:
    """Features x [B, n_h * n_w, C] in raster order -> [B, ceil(n_h/r) * ceil(n_w/r), C * r * r]: each
    r x r block of the zero-padded grid moved into channels, channel-major (F.unfold's order)."""
    B, _, C = x.shape
    grid = x.view(B, n_h, n_w, C)
    grid = F.pad(grid, (0, 0, 0, -n_w % r, 0, -n_h % r))  # [B, H', W', C]
    H, W = grid.shape[1] // r, grid.shape[2] // r
    blocks = grid.view(B, H, r, W, r, C).permute(0, 1, 3, 5, 2, 4)  # [B, H, W, C, r, r]
    return blocks.reshape(B, H * W, C * r * r)


class PatchEmbed(nn.Module):
    def __init__(self, patch_size: int, dim: int):
        super().__init__()
        self.proj = nn.Linear(3 * patch_size * patch_size, dim)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """[B, N, 3, p, p] -> [B, N, dim]"""
        return self.proj(patches.flatten(2).to(self.proj.weight.dtype))


class VisionAttention(nn.Module):
    """Full attention over one image's patches, 2-D RoPE on queries and keys."""

    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        if dim % n_heads or (dim // n_heads) % 4:
            raise ValueError(f"vision_dim={dim}, vision_n_heads={n_heads}: the head dim must be a multiple "
                             "of 4 (half of it rotates by row, half by column)")
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wqkv = nn.Linear(dim, 3 * dim)
        self.wo = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, N, dim] (B images of one grid size) -> [B, N, dim]"""
        B, N, _ = x.shape
        q, k, v = self.wqkv(x).view(B, N, 3, self.n_heads, self.head_dim).unbind(2)  # [B, N, H, Dh]
        q, k = rotate_half(q, cos, sin), rotate_half(k, cos, sin)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(o.transpose(1, 2).reshape(B, N, -1))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, inter_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, 2 * inter_dim, bias=False)  # [gate | up]
        self.w2 = nn.Linear(inter_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, inter_dim: int):
        super().__init__()
        self.norm1 = RMSNorm(dim, eps=VISION_NORM_EPS)
        self.attn = VisionAttention(dim, n_heads)
        self.norm2 = RMSNorm(dim, eps=VISION_NORM_EPS)
        self.mlp = VisionMLP(dim, inter_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim, self.theta = cfg.vision_dim // cfg.vision_n_heads, cfg.vision_rope_theta
        self.patch_embed = PatchEmbed(cfg.vision_patch_size, cfg.vision_dim)
        self.blocks = nn.ModuleList(VisionBlock(cfg.vision_dim, cfg.vision_n_heads, cfg.vision_inter_dim)
                                    for _ in range(cfg.vision_n_layers))
        self.norm = RMSNorm(cfg.vision_dim, eps=VISION_NORM_EPS)

    def forward(self, patches: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        """patches [B, n_h * n_w, 3, p, p] of B images with one grid -> features [B, n_h * n_w, dim]"""
        x = self.patch_embed(patches)
        cos, sin = vision_rope(n_h, n_w, self.head_dim, self.theta, x.device)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)


class Aligner(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ratio = cfg.vision_downsample_ratio
        self.w1 = nn.Linear(cfg.vision_dim * self.ratio ** 2, cfg.dim)
        self.w2 = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        """ViT features [B, n_h * n_w, C] -> tokens [B, ceil(n_h/r) * ceil(n_w/r), dim]"""
        return self.w2(F.gelu(self.w1(pixel_unshuffle(x, n_h, n_w, self.ratio))))


class VisionInput(nn.Module):
    """The vision tower, its projector and the learned embeddings of the span delimiters; `embed`
    writes an image batch over the placeholder positions of the token embeddings."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.vision = ViT(cfg)
        self.aligner = Aligner(cfg)
        self.image_start = nn.Parameter(torch.empty(cfg.dim))
        self.image_end = nn.Parameter(torch.empty(cfg.dim))
        self.image_newline = nn.Parameter(torch.empty(cfg.dim))

    def encode(self, images: ImageBatch) -> torch.Tensor:
        """Aligner tokens of every image, concatenated in the batch's order -> [sum_i tokens_i, dim].
        Images of one grid size go through the ViT together."""
        out: list[torch.Tensor | None] = [None] * len(images)
        by_grid: dict[tuple[int, int], list[int]] = {}
        for i, grid in enumerate(images.grids):
            by_grid.setdefault(tuple(grid), []).append(i)
        for (n_h, n_w), idx in by_grid.items():
            patches = torch.stack([images.patches[i] for i in idx])  # [B, N, 3, p, p]
            tokens = self.aligner(self.vision(patches, n_h, n_w), n_h, n_w)  # [B, n, dim]
            for j, i in enumerate(idx):
                out[i] = tokens[j]
        return torch.cat(out)

    def embed(self, h: torch.Tensor, token_types: torch.Tensor, images: ImageBatch) -> torch.Tensor:
        """h [B, T, D] token embeddings, token_types [B, T] -> h with every image span written over:
        IMAGE positions take the aligner tokens in order, the delimiters their learned embeddings."""
        kind = token_types.unsqueeze(-1)
        for t, value in ((IMAGE_START, self.image_start), (IMAGE_NEW_LINE, self.image_newline),
                         (IMAGE_END, self.image_end)):
            h = torch.where(kind == t, value.to(h.dtype), h)
        rows, cols = (token_types == IMAGE).nonzero(as_tuple=True)  # row-major: the batch's image order
        tokens = self.encode(images) if len(images) else h.new_zeros(0, h.shape[-1])
        if tokens.shape[0] != rows.numel():
            raise ValueError(f"the batch has {rows.numel()} IMAGE positions but its {len(images)} images "
                             f"make {tokens.shape[0]} tokens")
        return h.index_put((rows, cols), tokens.to(h.dtype))


def image_token_grid(n_h: int, n_w: int, ratio: int) -> tuple[int, int]:
    """The aligner's token grid of an n_h x n_w patch grid."""
    return math.ceil(n_h / ratio), math.ceil(n_w / ratio)
