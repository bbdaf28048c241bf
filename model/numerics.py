"""Working precision of numerically sensitive math (softmax, norms, routing, scores)."""
import torch


def wide(t: torch.Tensor) -> torch.Tensor:
    """At least fp32; fp64 stays fp64, so a float64 model (numerical equivalence checks) is
    float64 end to end."""
    return t if t.dtype == torch.float64 else t.float()
