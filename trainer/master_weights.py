"""trainer.param_dtype=bf16: which parameters stay fp32, and the fp32 gradients the masters step with.

The composite optimiser (optim/composite.py) stores a replicated parameter in bf16 on every rank and
keeps its fp32 master on the one rank that steps it, as Megatron's distributed optimizer and
DeepSpeed's bf16 ZeRO do. The model reads those weights through autocast, which casts an fp32 weight
to bf16 for each matmul anyway, so storing them in bf16 computes the same forward. Some parameters the
model reads in fp32 on purpose, or elementwise in their own dtype; rounding them would change what
is computed, and they are small, so they stay fp32 on every rank (`fp32_parameters`).

Autograd gives a bf16 parameter a bf16 gradient. At zero_stage=2 trainer/backward_reduce.py converts
each micro-batch's gradient to trainer.grad_accum_dtype as it reduces it; at zero_stage=1
`Fp32Grads` adds each micro-batch's gradient into an fp32 buffer (Megatron's `main_grad`), so the
accumulation over micro-batches and the reduction to the owner are in fp32 as before.
"""
from __future__ import annotations

import torch
from torch import nn

from conf.errors import ConfigError

PARAM_DTYPES = ("fp32", "bf16")


def check_param_dtype(param_dtype: str, precision: str, zero_stage: int) -> None:
    """ConfigError for a trainer.param_dtype the run cannot use. bf16 parameters need bf16 compute
    (autocast: an fp32 forward would read rounded weights for nothing) and a sharded composite
    optimiser (zero_stage 1 or 2: at 0 every rank owns every parameter, so every rank would hold every
    master); `check_param_dtype_optimizer` checks the optimiser once it is built."""
    if param_dtype not in PARAM_DTYPES:
        raise ConfigError(f"trainer.param_dtype={param_dtype!r}: expected fp32 or bf16")
    if param_dtype == "fp32":
        return
    if precision != "bf16":
        raise ConfigError(f"trainer.param_dtype=bf16 needs trainer.precision=bf16 (got {precision}): the "
                          "weights are stored for bf16 compute")
    if zero_stage not in (1, 2):
        raise ConfigError(f"trainer.param_dtype=bf16 needs trainer.zero_stage=1 or 2 (got {zero_stage}): the "
                          "fp32 masters live on each parameter's owner")


def check_param_dtype_optimizer(param_dtype: str, composite: bool) -> None:
    """ConfigError for bf16 parameters without the composite optimiser, whose owners keep the masters
    (DeepSpeed's own bf16 path is trainer.precision=bf16 with optim=adamw)."""
    if param_dtype == "bf16" and not composite:
        raise ConfigError("trainer.param_dtype=bf16 needs the composite optimiser (optim=muon or "
                          "trainer.expert_parallel > 1); with optim=adamw DeepSpeed's bf16 engine already "
                          "keeps bf16 weights and fp32 masters")


def fp32_parameters(model: nn.Module) -> frozenset[int]:
    """ids of the parameters kept fp32 under trainer.param_dtype=bf16:
    - every parameter of fewer than 2 dimensions (norm weights, biases, gains, attention sinks, the
      image delimiter embeddings): read elementwise in their own dtype, and a rounding error there is
      not averaged over a dot product; they are a negligible share of the bytes;
    - the Engram norms' [streams, dim] weights (norm weights, as above);
    - mHC (HyperConnection): its linear runs in fp32 outside autocast (docs/ARCHITECTURE.md §6);
    - the MoE router's gate: fp32 logits rank the experts (as DeepSeek's gate computes them);
    - a pooling Compressor's projections: computed in fp32 for the softmax over the pooled tokens;
    - Engram tables: Sinkhorn updates their rows sparsely (or host memory holds them), and the lookup
      is not an autocast op, so a bf16 table would hand the model rounded rows;
    - the token embedding: its forward would be the same in bf16 (its output is cast to bf16 before
      first use, model/transformer.py embed_streams), but its backward sums the gradients of a batch's
      repeated tokens in the weight's dtype, and a frequent token's row would be summed in bf16.
    With these kept, every gradient is the one the fp32-weight run computes (autocast's matmuls give
    bf16 weight gradients either way), so a bf16-weight run takes the fp32-weight run's steps
    (tests/test_master_weights.py). The LM head, the largest matrix, is an autocast matmul: bf16."""
    keep: set[int] = set()
    for module in model.modules():
        kind = type(module).__name__
        if kind in ("HyperConnection", "Router", "EngramTable", "Embedding") or (
                kind == "Compressor" and getattr(module, "ratio", 1) > 1):
            keep.update(id(p) for p in module.parameters())
    for name, p in model.named_parameters():
        if p.dim() < 2 or name.endswith("norm_weight"):
            keep.add(id(p))
    return frozenset(keep)


class Fp32Grads:
    """zero_stage=1 with bf16 parameters: after each backward, each given parameter's bf16 gradient is
    added into an fp32 buffer and dropped, so micro-batches accumulate in fp32 (`take` at the step)."""

    def __init__(self, params: list[torch.Tensor]):
        self.grads: dict[int, torch.Tensor] = {}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params if p.requires_grad]

    @torch.no_grad()
    def _on_grad(self, p: torch.Tensor) -> None:
        buf = self.grads.get(id(p))
        if buf is None:
            self.grads[id(p)] = p.grad.float()
        else:
            buf.add_(p.grad)
        p.grad = None

    def take(self) -> dict[int, torch.Tensor]:
        """id(param) -> its fp32 gradient summed over the step's micro-batches; the buffers restart."""
        grads, self.grads = self.grads, {}
        return grads

    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.grads.values())

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
