"""Mixture of experts: 1 shared + N routed SwiGLU experts, dropless (docs/ARCHITECTURE.md §1, §11).

Routing follows DeepSeek-V3 practice with V4's score function:
  score = sqrt(softplus(W x))                         affinities [N, E]
  chosen = top-k(score + bias)                        bias: auxiliary-loss-free balancing
  weight = score[chosen] / sum(score[chosen]) * route_scale     (k = 1: score[chosen] * route_scale)
The bias shifts selection only and is updated from the observed load, never by gradients.
A small sequence-wise balance loss is returned alongside.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from model.numerics import wide


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit); limit <= 0 disables the clamp."""
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return F.silu(gate) * up


def expert_counts(ids: torch.Tensor, n: int, chunk: int = 1 << 24) -> torch.Tensor:
    """How often each of 0..n-1 occurs in ids (int64 [n]). torch.bincount on CUDA reads the input's
    max and min back to the host, so the host waits for the GPU. torch.histc with the range given
    does not, and counts in shared memory; a scatter-add into [n] puts all its atomics on n
    addresses, several times slower. The float counts are exact: ids go in
    `chunk` (<= 2^24) at a time. Deterministic mode has no CUDA histc, so it takes the scatter-add."""
    flat = ids.reshape(-1)
    if torch.are_deterministic_algorithms_enabled():
        return torch.zeros(n, dtype=torch.int64, device=ids.device).scatter_add_(0, flat,
                                                                                 torch.ones_like(flat))
    counts = torch.zeros(n, dtype=torch.int64, device=ids.device)
    for part in flat.split(min(chunk, 1 << 24)):
        counts += torch.histc(part.float(), bins=n, min=0, max=n).long()  # bin e holds [e, e + 1)
    return counts


def clamped_swiglu_packed(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """clamped_swiglu of gate_up [..., 2I] = [gate | up]: the output of one matmul with the gate
    and up weights stacked, so the input is read once and its gradient comes from one matmul
    (no sum of two) -> [..., I]."""
    gate, up = gate_up.chunk(2, -1)
    return clamped_swiglu(gate, up, limit)


class SharedExpert(nn.Module):
    """A dense SwiGLU MLP that every token passes through."""

    swiglu = staticmethod(clamped_swiglu_packed)  # the op; model.ops.KernelPolicy may swap in the Triton one
    # the matmul by the stacked gate|up weight, which no nn.Linear holds; trainer/fp8.py may swap in
    # a float8 one (w2, a module, is converted as a module)
    linear = staticmethod(F.linear)

    def __init__(self, dim: int, inter_dim: int, limit: float):
        super().__init__()
        self.limit = limit
        self.w1 = nn.Linear(dim, inter_dim, bias=False)  # gate
        self.w3 = nn.Linear(dim, inter_dim, bias=False)  # up
        self.w2 = nn.Linear(inter_dim, dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.linear(x, torch.cat((self.w1.weight, self.w3.weight)))  # [..., 2 * inter_dim]
        return self.w2(self.swiglu(gate_up, self.limit))


def _aligned(w: torch.Tensor) -> torch.Tensor:
    """w, copied if it does not start on a 16-byte boundary, which torch._grouped_mm requires. A weight
    kept in a flat buffer (DeepSpeed's bf16 partitions) starts wherever the parameters before it end, off
    the boundary when one of those has a size that is no multiple of 8 (the mHC scales have 3)."""
    return w if w.data_ptr() % 16 == 0 else w.clone()


class RoutedExperts(nn.Module):
    """E experts stored as stacked weights [E, ...], so expert parallelism can shard dim 0.

    Two ways to compute the same thing: a loop over experts (the reference; matmuls per expert,
    and the row counts must be on the host) and grouped GEMMs (torch._grouped_mm: two launches
    for all experts, gate and up stacked in the first; row offsets stay on the device, so
    routing needs no host sync).
    `grouped`: None picks grouped where PyTorch has a fast kernel for it (CUDA, bf16 compute)."""

    swiglu = staticmethod(clamped_swiglu_packed)  # the op; model.ops.KernelPolicy may swap in the Triton one
    # the matmuls: per expert (the loop) and grouped; trainer/fp8.py may swap in float8 ones
    linear = staticmethod(F.linear)
    grouped_mm = staticmethod(torch._grouped_mm)
    # True: one grouped GEMM by the gate and up weights stacked, a copy of both made every call (in
    # training the activations are the larger operand); False: a GEMM by each and their outputs
    # stacked. The inference engine sets False from outside (inference/weights.py): a decode
    # step's few rows would otherwise copy every expert's gate and up weights per layer
    stack_gate_up = True

    def __init__(self, n_experts: int, dim: int, inter_dim: int, limit: float, grouped: bool | None = None):
        super().__init__()
        self.limit, self.grouped = limit, grouped
        self.w1 = nn.Parameter(torch.empty(n_experts, inter_dim, dim))  # gate
        self.w3 = nn.Parameter(torch.empty(n_experts, inter_dim, dim))  # up
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, inter_dim))  # down

    @property
    def n_experts(self) -> int:
        return self.w1.shape[0]

    def use_grouped(self, x: torch.Tensor) -> bool:
        if self.grouped is not None:
            return self.grouped
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
        return x.is_cuda and dtype == torch.bfloat16

    def forward(self, x: torch.Tensor, counts: list[int] | torch.Tensor) -> torch.Tensor:
        """x [N, D] sorted by expert, counts[e] rows for local expert e (a list or a device
        tensor) -> [N, D]."""
        if self.use_grouped(x):
            return self.forward_grouped(x, torch.as_tensor(counts, device=x.device))
        if isinstance(counts, torch.Tensor):
            counts = counts.tolist()
        outs = []
        for e, rows in enumerate(torch.split(x, counts)):
            if rows.shape[0] == 0:
                continue
            h = self.swiglu(self.linear(rows, torch.cat((self.w1[e], self.w3[e]))), self.limit)
            outs.append(self.linear(h, self.w2[e]))
        return torch.cat(outs) if outs else x.new_zeros(0, x.shape[-1])

    def forward_grouped(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offsets = counts.cumsum(0).to(torch.int32)  # [E] end row of each expert's group
        dtype = (torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type)
                 else x.dtype)
        w2 = _aligned(self.w2.to(dtype)).transpose(-2, -1)  # [E, I, D] view
        with torch.autocast(x.device.type, enabled=False):  # _grouped_mm has no autocast rule: cast here
            x = x.to(dtype)
            if self.stack_gate_up:
                w13 = torch.cat((self.w1.to(dtype), self.w3.to(dtype)), 1).transpose(-2, -1)  # [E, D, 2I]
                gate_up = self.grouped_mm(x, w13, offs=offsets)  # [N, 2I]
            else:
                gate_up = torch.cat([self.grouped_mm(x, _aligned(w.to(dtype)).transpose(-2, -1), offs=offsets)
                                     for w in (self.w1, self.w3)], dim=-1)
            h = self.swiglu(gate_up, self.limit)  # [N, I]
            return self.grouped_mm(h, w2, offs=offsets)


class _Gather(torch.autograd.Function):
    """x.index_select(0, index) [M * copies, D] from x [M, D], where row r of x appears `copies`
    times in the output, at positions back[r * copies : (r + 1) * copies]. The gradient gathers
    with `back` and sums each row's copies: index_select's own backward is a scatter-add.
    `dtype`: the rows come out cast to it (x is cast before the gather, copies times less to
    convert), and the gradient's copies are summed in x's dtype. `gather_sum(grad, back, copies,
    dtype)` computes that gradient (`gather_sum_reference`, or the fused kernel of
    `model/kernels/moe_combine.py`: same values)."""

    @staticmethod
    def forward(ctx, x, index, back, copies, dtype=None, gather_sum=None):
        ctx.save_for_backward(back)
        ctx.copies, ctx.in_dtype, ctx.gather_sum = copies, x.dtype, gather_sum or gather_sum_reference
        return (x if dtype is None else x.to(dtype)).index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (back,) = ctx.saved_tensors
        return ctx.gather_sum(grad, back, ctx.copies, ctx.in_dtype), None, None, None, None, None


def gather_sum_reference(grad: torch.Tensor, back: torch.Tensor, copies: int,
                         dtype: torch.dtype) -> torch.Tensor:
    """grad [M * copies, D] -> [M, D] in dtype: row r is the sum of grad's rows back[r * copies:
    (r + 1) * copies] (`_Gather`'s gradient)."""
    g = grad.index_select(0, back)
    if copies > 1:
        g = g.view(-1, copies, g.shape[-1]).sum(1, dtype=dtype)
    return g.to(dtype)


def routing_order(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """flat [N*k] expert id of each choice slot s = n*k + j -> (order, inv): row i of the
    expert-sorted rows is slot order[i] (stable: by expert, then token), and slot s is row inv[s]."""
    order = flat.argsort(stable=True)
    inv = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return order, inv


def combine_reference(y: torch.Tensor, inv: torch.Tensor, order: torch.Tensor, weights: torch.Tensor,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """The routed outputs y [N*k, D] (expert order; choice slot s is row inv[s], order = inv's
    inverse) back in token order, scaled by weights [N, k] and summed over a token's k experts
    -> [N, D] in out_dtype. `model/kernels/moe_combine.py` is the fused version."""
    N, k = weights.shape
    y = _Gather.apply(y, inv, order, 1).view(N, k, -1)  # [N, k, D] by token
    y = y * weights.unsqueeze(-1).to(y.dtype)
    return y.sum(1, dtype=out_dtype)  # autocast: y may be narrower than x; the sum is in x's dtype


class Router(nn.Module):
    def __init__(self, dim: int, n_experts: int, topk: int, route_scale: float, vision: bool = False):
        """vision: image-span tokens select with a bias of their own (`bias_vl`, the public gate's),
        balanced by their own load, since their expert affinities differ from text's."""
        super().__init__()
        self.topk, self.route_scale = topk, route_scale
        self.weight = nn.Parameter(torch.empty(n_experts, dim))
        # selection-only bias of auxiliary-loss-free balancing, and the load it is updated from
        self.register_buffer("bias", torch.zeros(n_experts, dtype=torch.float32))
        self.register_buffer("load", torch.zeros(n_experts, dtype=torch.float32))
        vl = (lambda: torch.zeros(n_experts, dtype=torch.float32)) if vision else (lambda: None)
        self.register_buffer("bias_vl", vl())  # None buffers are not in the state dict
        self.register_buffer("load_vl", vl())

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None):
        """x [N, D], image_mask [N] bool (image-span tokens) or None -> scores [N, E] (fp32),
        chosen [N, k], weights [N, k]."""
        # fp32 logits (as DeepSeek's gate computes them): autocast would cast the widened x and
        # weight back to bf16 for the linear, so the top-k would rank bf16-rounded logits, at the
        # price of a [N, D] cast each way
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(wide(x), wide(self.weight))
        scores = torch.sqrt(F.softplus(logits))
        vl = image_mask is not None and self.bias_vl is not None
        bias = torch.where(image_mask.unsqueeze(-1), self.bias_vl, self.bias) if vl else self.bias
        chosen = torch.topk(scores.detach() + bias, self.topk, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if self.topk > 1:  # one expert keeps its raw score, as the public router leaves it
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights * self.route_scale
        if self.training:
            if vl:
                self.load += expert_counts(chosen[~image_mask], scores.shape[-1])
                self.load_vl += expert_counts(chosen[image_mask], scores.shape[-1])
            else:
                self.load += expert_counts(chosen, scores.shape[-1])
        return scores, chosen, weights

    def loads(self) -> list[torch.Tensor]:
        """The load counters (text, then image tokens when there is a vision bias)."""
        return [self.load] if self.load_vl is None else [self.load, self.load_vl]

    @torch.no_grad()
    def update_bias(self, speed: float) -> None:
        """Raise the bias of under-loaded experts and lower it for over-loaded ones, then reset
        the load counter. The caller all-reduces `load` first when data-parallel."""
        for bias, load in zip((self.bias, self.bias_vl), self.loads()):
            if load.sum() > 0:
                bias += speed * torch.sign(load.mean() - load)
            load.zero_()


class MoE(nn.Module):
    # the ops: the weighted combine and the dispatch gather's gradient; model.ops.KernelPolicy may
    # swap in the fused kernels of model/kernels/moe_combine.py
    combine = staticmethod(combine_reference)
    gather_sum = staticmethod(gather_sum_reference)

    def __init__(self, dim: int, n_routed: int, n_shared: int, topk: int, inter_dim: int,
                 route_scale: float, limit: float, seq_aux_alpha: float, vision: bool = False):
        super().__init__()
        self.n_routed, self.topk, self.seq_aux_alpha = n_routed, topk, seq_aux_alpha
        self.router = Router(dim, n_routed, topk, route_scale, vision)
        self.experts = RoutedExperts(n_routed, dim, inter_dim, limit)
        self.shared = SharedExpert(dim, inter_dim * n_shared, limit) if n_shared > 0 else None

    def dispatch(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
                 alongside: Optional[Callable[[], torch.Tensor]] = None) -> torch.Tensor:
        """Dropless routed compute: x [N, D], chosen/weights [N, k] -> [N, D], plus alongside()
        when given: work that does not depend on the routing (the shared expert), which an
        expert-parallel dispatch runs while its exchange is in flight. Expert parallelism
        replaces this method from outside (an all-to-all around the experts).
        Choice slot s = n*k + j (token n's j-th expert) is row inv[s] of the expert-sorted
        rows. Both reorderings are permutations, so each gradient is a gather too: no
        scatter-add (fp32 atomics) in the forward's combine or the backward's dispatch."""
        flat = chosen.flatten()
        order, inv = routing_order(flat)
        counts = expert_counts(flat, self.n_routed)  # [E], on the device
        y = self.experts(self.gather_routed(x, order, inv), counts)  # [N*k, D] by expert
        y = self.combine_routed(y, order, inv, weights, x.dtype)
        return y if alongside is None else y + alongside()

    def gather_routed(self, x: torch.Tensor, order: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
        """x [N, D] -> [N*k, D]: row i is token order[i] // k's (`routing_order`). Under autocast
        the experts compute in its dtype, so the N rows are cast before they are copied k times
        (and an expert-parallel exchange moves them in it); the copies' gradient is summed in x's
        dtype."""
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else None
        return _Gather.apply(x, order // self.topk, inv, self.topk, dtype, self.gather_sum)

    def combine_routed(self, y: torch.Tensor, order: torch.Tensor, inv: torch.Tensor, weights: torch.Tensor,
                       out_dtype: torch.dtype) -> torch.Tensor:
        """The experts' rows y [N*k, D] in `order` -> [N, D]: weighted sum over each token's k experts."""
        return self.combine(y, inv, order, weights, out_dtype)

    def forward(self, x: torch.Tensor, shard=None,
                image_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, D] -> (y [B, T, D], sequence-wise balance loss scalar). `shard`: where the T
        tokens sit in the sequence (see model.runtime.SequenceShard); None: the whole sequence.
        image_mask [B, T]: image-span tokens (their own selection bias), or None."""
        B, T, D = x.shape
        flat = x.reshape(B * T, D)
        scores, chosen, weights = self.router(flat, None if image_mask is None else image_mask.reshape(-1))
        y = self.dispatch(flat, chosen, weights,
                          alongside=None if self.shared is None else lambda: self.shared(flat))
        return y.view(B, T, D), self.sequence_balance_loss(scores, chosen, B, T, shard)

    def sequence_balance_loss(self, scores, chosen, B: int, T: int, shard=None) -> torch.Tensor:
        """alpha * sum_e f_e P_e per sequence (DeepSeek-V3): f_e = E/(k L) * tokens routed to e,
        P_e = mean over the L tokens of the normalised affinity. A slice of the sequence (context
        parallelism) gets the whole sequence's f and its own tokens' share of P, scaled by the
        number of slices, so the slices' losses average to the whole sequence's."""
        if self.seq_aux_alpha <= 0 or not self.training:
            return scores.new_zeros(())
        E = self.n_routed
        hits = torch.zeros(B, E, device=scores.device, dtype=scores.dtype).scatter_add_(
            1, chosen.view(B, T * self.topk),
            torch.ones(B, T * self.topk, device=scores.device, dtype=scores.dtype))
        length, parts = T, 1
        if shard is not None:
            hits, length, parts = shard.sum(hits), shard.total_len or T, shard.parts
        f = hits * E / (self.topk * length)
        p = (scores / scores.sum(-1, keepdim=True)).view(B, T, E).sum(1) / length
        return parts * self.seq_aux_alpha * (f * p).sum(-1).mean()
