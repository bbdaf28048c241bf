"""Manifold-constrained hyper-connections with the single-pass schedule (docs/ARCHITECTURE.md §6, §11).

The residual is n parallel streams h [B, T, n, D]. Around every sub-layer (attention or
MoE) three coefficient sets act:
  pre  [n]     mixes the streams into the sub-layer input        x  = sum_s pre[s] h[s]
  post [n]     spreads the sub-layer output back                 h' = post[d] y + ...
  comb [n, n]  doubly stochastic stream mixing                   ... + sum_s comb[s, d] h[s]

Single-pass mHC: a sub-layer computes (post, comb) for itself and `pre` for the NEXT
sub-layer, all from its own input streams. So the input mix of sub-layer k+1 is known
before sub-layer k's residual update runs, and a fused kernel can do update, next input
mix and next coefficients in one read of the streams. The first sub-layer uses the
one-hot pre-mix [1, 0, ..., 0].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.numerics import wide


def sinkhorn_comb(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[..., n, n] logits -> (nearly) doubly stochastic matrix. Round 1 is a row softmax plus eps
    followed by a column normalisation; each of the other `iters - 1` rounds normalises rows, then
    columns. Every normalisation divides by (sum + eps), as DeepSeek's inference kernel does, so
    a checkpoint sees the same comb here as there; sums stay 1 to within ~eps."""
    comb = logits.softmax(dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


class _SinkhornExplicit(torch.autograd.Function):
    """`sinkhorn_comb`'s forward with a hand-written backward. Each normalisation y = x / (x.sum(a) + eps)
    has the vector-Jacobian product (g - sum_a(g * y)) / (sum_a(x) + eps): four tensor ops, where autograd
    runs a DivBackward (both operands, a broadcast reduction), a SumBackward and a gradient add per
    round, each a graph node. The n x n axes are moved in front for the rounds, so every op
    broadcasts over a contiguous batch axis instead of an inner axis of size n. On a CPU (tiny:
    [8, 256, 4, 4], 20 rounds) the reference's forward+backward ran ~80 ops of ~90 us; this is
    what the default model (no kernel policy) runs, the reference stays the definition."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        p = logits.softmax(dim=-1)  # [..., n, n]
        x = (p + eps).movedim((-2, -1), (0, 1)).contiguous()  # [n(row), n(col), ...]
        ctx.axes = [0] + [1, 0] * (iters - 1)  # column normalisation, then (row, column) rounds
        outs, sums = [], []
        for axis in ctx.axes:
            s = x.sum(dim=axis, keepdim=True) + eps
            x = x / s
            outs.append(x)
            sums.append(s)
        ctx.save_for_backward(p, *outs, *sums)
        return x.movedim((0, 1), (-2, -1)).contiguous()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        p, *saved = ctx.saved_tensors
        k = len(ctx.axes)
        outs, sums = saved[:k], saved[k:]
        g = grad.movedim((-2, -1), (0, 1)).contiguous()  # (elementwise ops keep a permuted layout)
        for axis, y, s in zip(reversed(ctx.axes), reversed(outs), reversed(sums)):
            g = (g - (g * y).sum(dim=axis, keepdim=True)) / s
        g = g.movedim((0, 1), (-2, -1))  # d loss / d softmax output (+ eps)
        return p * (g - (g * p).sum(dim=-1, keepdim=True)), None, None


def sinkhorn_comb_explicit(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """`sinkhorn_comb` (same arguments, same math) with a hand-written backward (`_SinkhornExplicit`)."""
    return _SinkhornExplicit.apply(logits, iters, eps)


class HyperConnection(nn.Module):
    """Coefficients of one sub-layer, from one fp32 linear over the RMS-normalised streams.

    Two epsilons, as in DeepSeek's inference code: `norm_eps` (the model's RMSNorm eps) in the
    RMS normalisation of the flattened streams, `eps` (hc_eps) added to `pre` and in Sinkhorn."""

    # [..., n, n] logits -> comb: the op; model.ops.KernelPolicy may swap in the Triton kernel
    sinkhorn = staticmethod(sinkhorn_comb_explicit)

    def __init__(self, dim: int, n_streams: int, sinkhorn_iters: int, eps: float, norm_eps: float):
        super().__init__()
        self.n, self.iters, self.eps, self.norm_eps = n_streams, sinkhorn_iters, eps, norm_eps
        n_out = 2 * n_streams + n_streams * n_streams  # pre, post, comb
        self.fn = nn.Parameter(torch.empty(n_out, n_streams * dim, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros(n_out, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))  # pre, post, comb gains

    def reset_parameters(self) -> None:
        # keep the mixing logits O(0.1) at init: near-uniform comb, pre ~ 0.5, post ~ 1
        nn.init.normal_(self.fn, std=0.1 / self.fn.shape[1] ** 0.5)
        nn.init.zeros_(self.base)
        nn.init.ones_(self.scale)

    def forward(self, h: torch.Tensor):
        """h [B, T, n, D] -> post [B, T, n], comb [B, T, n, n], next_pre [B, T, n] (fp32)."""
        return self.coefficients(self.project(h))

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """h [B, T, n, D] -> mixing logits [B, T, 2n + n*n]: one fp32 linear over the
        RMS-normalised streams (the part a fused kernel computes while it writes h)."""
        flat = wide(h.flatten(-2))  # [B, T, n*D]
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
        # autocast would run this linear in bf16 (F.linear is on its list): ARCHITECTURE.md §6 says fp32
        with torch.autocast(h.device.type, enabled=False):
            return F.linear(flat, wide(self.fn))

    def coefficients(self, mix: torch.Tensor):
        """Mixing logits [B, T, 2n + n*n] -> post [B, T, n], comb [B, T, n, n], next_pre [B, T, n]."""
        n = self.n
        base = wide(self.base)
        next_pre = torch.sigmoid(mix[..., :n] * self.scale[0] + base[:n]) + self.eps
        post = 2 * torch.sigmoid(mix[..., n:2 * n] * self.scale[1] + base[n:2 * n])
        comb_logits = (mix[..., 2 * n:] * self.scale[2] + base[2 * n:]).unflatten(-1, (n, n))
        return post, self.sinkhorn(comb_logits, self.iters, self.eps), next_pre


def mix_streams(pre: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Sub-layer input: pre [B, T, n], h [B, T, n, D] -> x [B, T, D]."""
    return torch.einsum("bts,btsd->btd", pre.to(h.dtype), h)


def update_streams(h: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Residual update h'[d] = post[d] * y + sum_s comb[s, d] * h[s]."""
    mixed = torch.einsum("btsd,btsc->btdc", comb.to(h.dtype), h)  # [B, T, n(dst), D]
    return mixed + post.to(h.dtype).unsqueeze(-1) * y.unsqueeze(2)


def initial_pre(h: torch.Tensor) -> torch.Tensor:
    """One-hot pre-mix [1, 0, ..., 0] for the first sub-layer: [B, T, n]."""
    pre = torch.zeros(h.shape[:3], dtype=torch.float32, device=h.device)
    pre[..., 0] = 1.0
    return pre
