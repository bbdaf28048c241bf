"""Working precision of numerically sensitive math (softmax, norms, routing, scores)."""
import torch
import torch.nn.functional as F
from torch import nn


def wide(t: torch.Tensor) -> torch.Tensor:
    """At least fp32; fp64 stays fp64, so a float64 model (numerical equivalence checks) is
    float64 end to end."""
    return t if t.dtype == torch.float64 else t.float()


def gather_rows(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """x [B, S, C], ids [B, ...] int (in [0, S)) -> [B, ..., C]: row ids[b, ...] of x[b].
    Same values as x[arange(B)[:, None, ...], ids]; index_select's backward is a scatter-add,
    where advanced indexing's is a sort-based index_put that dominated the training step."""
    B, S, C = x.shape
    if S == 0:  # nothing to gather from (decoding before the first finished block): callers mask these
        return x.new_zeros(*ids.shape, C)
    flat = (ids + torch.arange(B, device=ids.device).view(B, *([1] * (ids.dim() - 1))) * S).reshape(-1)
    return x.reshape(B * S, C).index_select(0, flat).view(*ids.shape, C)


def rms_norm(x: torch.Tensor, normalized_shape, weight: torch.Tensor | None,
             eps: float | None) -> torch.Tensor:
    """F.rms_norm with the weight cast to x's dtype and, under autocast, the output in the autocast
    dtype (RMSNorm's docstring says why)."""
    if weight is not None and weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
    out = F.rms_norm(x, normalized_shape, weight, eps)
    if torch.is_autocast_enabled(x.device.type) and out.dtype == torch.float32:
        out = out.to(torch.get_autocast_dtype(x.device.type))
    return out


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm with its weight cast to the input's dtype. Under bf16 autocast a norm that follows
    a matmul (q_norm, kv_norm, the compressor's and the index key's) gets a bf16 input and an fp32
    weight, and torch's rms_norm then cannot use its fused kernel: it runs the composite (upcast,
    pow, mean, rsqrt, two products, a cast), each op a kernel forward and more backward. With the
    weight in the input's dtype it is one fused kernel each way; its statistics are still fp32 and
    the output is rounded once (the composite rounds the normalised value, then the product).

    Under autocast the output is in the autocast dtype. A norm's output only feeds matmuls, which
    autocast would cast one by one: the block's attention norm feeds four to six projections, its
    FFN norm the router, the shared expert and the routed experts' gather. With the kernels' fp32
    streams that was a cast per consumer forward and, backward, a widening cast per consumer and
    fp32 adds of their gradients ([B, T, D] each). The router, which widens its input, now sees
    the rounded values, as it does without the kernels (the einsum stream mix casts under autocast).

    The norm itself is the `rms_norm` op (below): `model.ops.KernelPolicy` may swap in one Triton
    pass each way (`model/kernels/rms_norm.py`), where torch's backward reads x and dy twice."""

    rms_norm = staticmethod(rms_norm)  # the op; KernelPolicy.apply may replace it per module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rms_norm(x, self.normalized_shape, self.weight, self.eps)
