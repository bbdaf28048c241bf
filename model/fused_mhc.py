"""The fused mHC schedule: the same function as `Block.forward` and `Transformer.run_layers`, with
every sub-layer boundary taken in one pass over the residual streams (docs/ARCHITECTURE.md §6).

At a boundary the plain model reads the streams h [B, T, n, D] three times: the residual update
h' = post * y + comb^T h, the next coefficients' linear over RMS-normed h', and the next input mix
pre^T h'. The fused step (`model/kernels/mhc.py`) does all three in one read of h. The boundary
after a block's MoE sub-layer is the one before the next block's attention, so a block hands its
MoE update (y, post, comb) on unapplied ("pending") and the next block's first fused step applies
it; an Engram layer, or the end of the stack, applies it first (`settle`).

`model.ops.KernelPolicy` applies this schedule from outside, by binding `fused_block_forward` as
each block's forward and `fused_run_layers` as the model's run_layers, once it has put the fused
step in the blocks (`Block.fused_mhc`, `Block.fused_mix`). tests/test_kernels_model.py checks the
kernel model against the plain one; tests/test_kernels_mhc.py the step against its composition.
"""
from __future__ import annotations

import types
from typing import Optional

import torch

from model.runtime import AttentionRuntime
from model.transformer import Block, Transformer


def fused_block_forward(block, h: torch.Tensor, pre: torch.Tensor, rt: AttentionRuntime,
                        pending: Optional[tuple] = None):
    """`Block.forward` with fused boundaries: h [B, T, n, D], pre [B, T, n], pending: the previous
    block's MoE update (y [B, T, D], post, comb) not yet in h, or None -> (h', next pre, this block's
    MoE update, pending)."""
    if pending is not None:
        h, x, mix = block.fused_mhc(h, *pending, pre, block.attn_hc.fn, block.attn_hc.norm_eps)
    else:  # no update before it (the first block, after an Engram): one read of h
        x, mix = block.fused_mix(h, pre, block.attn_hc.fn, block.attn_hc.norm_eps)
    post, comb, ffn_pre = block.attn_hc.coefficients(mix)
    y = block.attention(x, rt)
    h, x, mix = block.fused_mhc(h, y, post, comb, ffn_pre, block.ffn_hc.fn, block.ffn_hc.norm_eps)
    post, comb, next_pre = block.ffn_hc.coefficients(mix)
    return h, next_pre, (block.ffn(x, rt), post, comb)


def fused_run_layers(model, h: torch.Tensor, pre: torch.Tensor, input_ids: torch.Tensor, rt: AttentionRuntime,
                     layers) -> tuple[torch.Tensor, torch.Tensor]:
    """`Transformer.run_layers` over blocks that leave their MoE update pending."""
    lookup, history = model.lookup_ids(input_ids, rt)
    pending, last = None, None
    for layer in layers:
        if layer.spec.engram:
            h, pending = model.add_engram(layer, settle(last, h, pending), lookup, rt, history), None
        h, pre, pending = layer(h, pre, rt, pending)
        last = layer
    return settle(last, h, pending), pre


def settle(block, h: torch.Tensor, pending: Optional[tuple]) -> torch.Tensor:
    """h with `block`'s pending MoE update (y, post, comb) applied (h itself when none)."""
    return h if pending is None else block.update_streams(h, *pending)


def apply_fused_schedule(model: torch.nn.Module) -> None:
    """Bind the fused schedule to every block of `model` (and to the model's layer loop when it
    is a Transformer). The blocks must already hold the fused step (KernelPolicy does both)."""
    for module in model.modules():
        if isinstance(module, Block):
            module.forward = types.MethodType(fused_block_forward, module)
        elif isinstance(module, Transformer):
            module.run_layers = types.MethodType(fused_run_layers, module)
