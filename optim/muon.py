"""Muon: momentum SGD whose update is orthogonalised by a Newton-Schulz iteration.

A parameter is viewed as a batch of matrices ("blocks", see `muon_blocks`), and each block's update
is replaced by (approximately) its polar factor U V^T, so every direction the update spans moves by
the same amount. Blocks:
  [out, in]   heads = 1   one matrix
  [out, in]   heads = h   [h, out/h, in]: head-wise Muon. Rows are head-major (row h*C + c belongs to
                          head h), the layout of `wq_b` [H*C, R] whose output is unflattened to (H, C).
  [G, A, B]   heads = 1   G matrices as stored: grouped `wo_a`, MoE experts `w1/w3` [E, I, D], `w2` [E, D, I]
  [G, A, B]   heads = h   [G*h, A/h, B]
Head count is the param-group option `heads` (default 1), shared by every parameter of the group:
make one group per head count, e.g.
    Muon([{"params": [attn.wq_b.weight], "heads": n_heads}, {"params": other_matrices}], lr=...)

Vectors and scalars (norms, biases, gains) do not belong here: Muon rejects parameters that are not
2-D or 3-D. The optimiser is purely local and deterministic, so a data-parallel wrapper can hand each
rank the whole parameters it owns.
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch

from optim.base import CheckedOptimizer

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # quintic (a, b, c): fast rise of small singular values
RMS_MODES = ("moonlight", "fixed")
MOONLIGHT_RMS = 0.2  # Moonlight's update RMS, matched to AdamW's typical update RMS
# Elements per stacked Newton-Schulz batch: one batched matmul chain instead of a launch chain per
# parameter, with the extra memory (the stacked update and its bf16 iterates) bounded.
MAX_BATCH_NUMEL = 1 << 27


def newton_schulz(G: torch.Tensor, steps: int = 5, eps: float = 1e-7,
                  compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """[..., A, B] -> [..., A, B], each matrix mapped to approximately its polar factor U V^T.

    The coefficients trade convergence for speed: singular values end up roughly in [0.7, 1.2],
    which is all Muon needs (ones below ~1e-3 of the Frobenius norm stay short after 5 steps). `compute_dtype`
    defaults to bfloat16 on CUDA, float32 elsewhere; the result has G's dtype. An all-zero matrix maps to
    zeros.
    """
    if G.dim() < 2:
        raise ValueError(f"newton_schulz needs [..., A, B], got shape {tuple(G.shape)}")
    if compute_dtype is None:
        compute_dtype = torch.bfloat16 if G.is_cuda else torch.float32
    a, b, c = NS_COEFFS
    tall = G.size(-2) > G.size(-1)
    X = G.to(compute_dtype)
    if tall:
        X = X.mT  # run on the wide side: the Gram matrix S is then the smaller one
    # Frobenius norm >= spectral norm, so singular values start in [0, 1], inside the iteration's basin
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + eps)
    lead = X.shape[:-2]
    X = X.reshape(-1, *X.shape[-2:])  # [N, a, b]: baddbmm wants one batch dim
    for _ in range(steps):
        S = X @ X.mT  # [N, min(A, B), min(A, B)]
        # a X + (b S + c S S) X, the scalings and sums in the matmul epilogues (fp32, one rounding)
        # instead of four elementwise passes over S and X
        X = torch.baddbmm(X, torch.baddbmm(S, S, S, beta=b, alpha=c), X, beta=a)
    X = X.reshape(*lead, *X.shape[-2:])
    if tall:
        X = X.mT
    return X.to(G.dtype)


def _check_shape(shape: torch.Size, heads: int) -> None:
    if len(shape) not in (2, 3):
        raise ValueError(f"Muon needs a 2-D or 3-D parameter, got shape {tuple(shape)}")
    if not isinstance(heads, int) or heads < 1:
        raise ValueError(f"heads={heads!r}: expected an int >= 1")
    if shape[-2] % heads:
        raise ValueError(f"shape {tuple(shape)}: {shape[-2]} rows not divisible by heads={heads}")


def muon_blocks(t: torch.Tensor, heads: int = 1) -> torch.Tensor:
    """[out, in] or [G, A, B] -> [N, A/heads, B], the batch of matrices Muon orthogonalises.

    A view when t is contiguous. Raises ValueError for other ranks or a row count not divisible by heads.
    """
    _check_shape(t.shape, heads)
    return t.reshape(-1, t.size(-2) // heads, t.size(-1))


def muon_direction(u: torch.Tensor, heads: int = 1, ns_steps: int = 5, rms_mode: str = "moonlight",
                   target_rms: float = 0.18) -> torch.Tensor:
    """Orthogonalised and scaled update for the momentum update u; same shape and dtype as u.

    moonlight: O * 0.2 * sqrt(max(A, B)). An orthogonal A x B block has RMS 1/sqrt(max(A, B)),
               so the update RMS is ~0.2 whatever the shape.
    fixed:     each block rescaled to RMS exactly target_rms (an all-zero block stays zero).
    """
    return _orthogonalise(muon_blocks(u, heads), ns_steps, rms_mode, target_rms).reshape(u.shape)


def _orthogonalise(blocks: torch.Tensor, ns_steps: int, rms_mode: str, target_rms: float) -> torch.Tensor:
    """[N, A, B] -> [N, A, B]: each block's Newton-Schulz polar factor, scaled as `muon_direction` says."""
    if rms_mode not in RMS_MODES:
        raise ValueError(f"rms_mode={rms_mode!r}: expected one of {RMS_MODES}")
    ortho = newton_schulz(blocks, ns_steps)  # [N, A, B]
    if rms_mode == "moonlight":
        return ortho * (MOONLIGHT_RMS * math.sqrt(max(ortho.shape[-2:])))
    rms = ortho.float().square().mean(dim=(-2, -1), keepdim=True).sqrt()  # [N, 1, 1]
    scale = target_rms / rms.clamp_min(torch.finfo(torch.float32).tiny)
    return (ortho.float() * scale).to(ortho.dtype)


def same_shape_batches(params: list[torch.Tensor], heads: int,
                       max_numel: int = MAX_BATCH_NUMEL) -> list[list[int]]:
    """Indices of params in batches whose Muon blocks share one [A, B] shape, dtype and device, in
    first-seen order; a batch holds at most max_numel elements unless one parameter alone is larger."""
    by_kind: dict[tuple, list[int]] = defaultdict(list)
    for i, p in enumerate(params):
        _check_shape(p.shape, heads)
        by_kind[(p.size(-2) // heads, p.size(-1), p.dtype, p.device)].append(i)
    batches = []
    for members in by_kind.values():
        batch, numel = [], 0
        for i in members:
            if batch and numel + params[i].numel() > max_numel:
                batches.append(batch)
                batch, numel = [], 0
            batch.append(i)
            numel += params[i].numel()
        batches.append(batch)
    return batches


def _check_group(group: dict[str, Any]) -> None:
    """ValueError for a bad option or a parameter the group's `heads` cannot split."""
    if not group["lr"] >= 0.0:
        raise ValueError(f"lr={group['lr']}: expected >= 0")
    if not 0.0 <= group["momentum"] < 1.0:
        raise ValueError(f"momentum={group['momentum']}: expected in [0, 1)")
    if not isinstance(group["ns_steps"], int) or group["ns_steps"] < 1:
        raise ValueError(f"ns_steps={group['ns_steps']!r}: expected an int >= 1")
    if not group["weight_decay"] >= 0.0:
        raise ValueError(f"weight_decay={group['weight_decay']}: expected >= 0")
    if group["rms_mode"] not in RMS_MODES:
        raise ValueError(f"rms_mode={group['rms_mode']!r}: expected one of {RMS_MODES}")
    if not group["target_rms"] > 0.0:
        raise ValueError(f"target_rms={group['target_rms']}: expected > 0")
    for p in group["params"]:
        _check_shape(p.shape, group["heads"])


class Muon(CheckedOptimizer):
    """Muon over whole 2-D / 3-D parameters; one state tensor (`momentum_buffer`) per parameter.

    Per parameter: buf = momentum * buf + grad; u = grad + momentum * buf (Nesterov) or buf;
    p *= 1 - lr * weight_decay; p -= lr * muon_direction(u, heads, ...). Parameters whose blocks
    share a shape are stepped together (`same_shape_batches`): the per-parameter loop was bound by
    kernel launches (hundreds of small matmul chains), the arithmetic is the same.
    Group options: lr, momentum, nesterov, ns_steps, weight_decay, rms_mode, target_rms, heads.
    """

    check_group = staticmethod(_check_group)

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5, weight_decay: float = 0.0,
                 rms_mode: str = "moonlight", target_rms: float = 0.18, heads: int = 1):
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                        weight_decay=weight_decay, rms_mode=rms_mode, target_rms=target_rms, heads=heads)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if p.grad.is_sparse:
                    raise RuntimeError("Muon does not support sparse gradients (use Sinkhorn for tables)")
            for batch in same_shape_batches(params, group["heads"]):
                self._step_batch([params[i] for i in batch], group)
        return loss

    def _step_batch(self, params: list[torch.Tensor], group: dict[str, Any]) -> None:
        """The step for parameters whose blocks share one shape: multi-tensor momentum and update,
        and one Newton-Schulz iteration over all their blocks stacked ([sum N, A, B])."""
        lr, mu, wd, heads = group["lr"], group["momentum"], group["weight_decay"], group["heads"]
        grads = [p.grad for p in params]
        bufs = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            bufs.append(state["momentum_buffer"])
        torch._foreach_mul_(bufs, mu)
        torch._foreach_add_(bufs, grads)
        us = torch._foreach_add(grads, bufs, alpha=mu) if group["nesterov"] else bufs
        blocks = [muon_blocks(u, heads) for u in us]  # each [N_i, A, B]
        stacked = torch.cat(blocks) if len(blocks) > 1 else blocks[0]
        ortho = _orthogonalise(stacked, group["ns_steps"], group["rms_mode"], group["target_rms"])
        directions = [d.reshape(p.shape) for d, p in zip(ortho.split([b.size(0) for b in blocks]), params)]
        if wd != 0.0:
            torch._foreach_mul_(params, 1.0 - lr * wd)  # decoupled: independent of the gradient's scale
        torch._foreach_add_(params, directions, alpha=-lr)
