"""The fused ops and the one policy that picks their implementation.

Model code calls each fused op through an attribute of the module that uses it, and that
attribute is the plain-PyTorch reference by default (`RMSNorm.rms_norm`, `Rotary.rotate`,
`CSA2Attention.attend`, ...). A `KernelPolicy`, built from config (`model.kernels`) and
applied from outside like torchtitan's parallelisms (`KernelPolicy.apply(model)`), swaps in the
Triton kernels of `model/kernels/`. Each kernel is wrapped in its op's guard, which hands the
call back to the reference where the kernel does not take it (fp64 precision checks, a
broadcast it does not take, torch.compile tracing, a ZeRO-3 partitioned weight), and says so
once per op. This module is the only part of `model/` besides the kernels themselves that
imports `model.kernels`; the kernels import the reference math, never the other way round.

| op | module attribute(s) | reference runs instead when |
| --- | --- | --- |
| rms_norm | RMSNorm.rms_norm | torch.compile (inductor fuses the norm), fp64, no weight, not the last dim |
| rotary | Rotary.rotate | fp64; angles that broadcast other than over a head axis |
| stream_mix | Block.mix_streams, .update_streams, Transformer.mix_streams | fp64; broadcast arguments |
| mhc_step | Block.fused_mhc, .fused_mix, on the schedule of model/fused_mhc.py | fp64 (in the kernel) |
| sinkhorn | HyperConnection.sinkhorn | never (fp64 is computed in fp64) |
| swiglu | SharedExpert.swiglu, RoutedExperts.swiglu | torch.compile, fp64, odd width (inside the kernel) |
| moe_combine | MoE.combine, MoE.gather_sum | torch.compile, fp64; gather_sum also for one copy per row |
| engram_lookup | Engram.gather_rows | torch.compile, a ZeRO-3 partitioned table |
| engram_gate | Engram.gate | torch.compile, fp64 |
| attention | CSA2Attention.attend, .attend_rotates (RoPE folded in) | never |
| index_scores | CSA2Attention.scores_at, .scores_masked | never |
| topk | CSA2Attention.select | never |
| cross_entropy | Transformer.head_loss | fp64, a ZeRO-3 partitioned head |
"""
from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Iterable
from typing import Optional

import torch
from torch import nn

OPS = ("rms_norm", "rotary", "stream_mix", "mhc_step", "sinkhorn", "swiglu", "moe_combine", "engram_lookup",
       "engram_gate", "attention", "index_scores", "topk", "cross_entropy")
UNDER_COMPILE = ("rms_norm", "swiglu", "moe_combine", "engram_lookup", "engram_gate")  # reference when traced
UNDER_ZERO3 = ("engram_lookup", "cross_entropy")  # read a whole weight that ZeRO-3 partitions


def _traced_or_fp64(t: torch.Tensor) -> Optional[str]:
    """Why an op whose reference inductor fuses better (or that fp64 checks want exact) runs its
    reference for t: under torch.compile tracing, or for fp64; None otherwise."""
    if torch.compiler.is_compiling():
        return "torch.compile"
    return "fp64" if t.dtype == torch.float64 else None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _needs_a_kernel_device(module: nn.Module, args: tuple) -> None:
    """Forward pre-hook of a model with Triton kernels in it: one clear error, before the first
    kernel launch, when its input is on a device Triton cannot run on here (a CPU tensor outside
    Triton's interpreter), where the first kernel would fail with a launch error of its own."""
    x = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if x is not None and not x.is_cuda and not _interpreting():
        raise RuntimeError(f"model.kernels=true runs Triton kernels: it needs a CUDA device (or "
                           f"TRITON_INTERPRET=1), and the input is on {x.device}")


class KernelPolicy:
    """Which ops run their Triton kernel. `fused`: op names (OPS); the rest run the reference."""

    def __init__(self, fused: Iterable[str] = ()):
        fused = tuple(fused)
        unknown = sorted(set(fused) - set(OPS))
        if unknown:
            raise ValueError(f"unknown fused ops {unknown}; expected some of {', '.join(OPS)}")
        self.fused = frozenset(fused)
        self.fell_back: dict[str, str] = {}  # op -> the first reason its reference ran instead

    @classmethod
    def from_config(cls, model_cfg) -> KernelPolicy:
        """model.kernels=true: every op fused; false: none."""
        return cls(OPS if model_cfg.kernels else ())

    def describe(self, compile: bool = False, zero_stage: int = 0) -> str:
        """One line for the run's log: what runs fused, and what runs its reference and why."""
        if not self.fused:
            return "model.kernels: off (every op runs its PyTorch reference)"
        parts = [f"model.kernels: Triton for {', '.join(op for op in OPS if op in self.fused)}"]
        if compile and (ops := [op for op in UNDER_COMPILE if op in self.fused]):
            parts.append(f"under trainer.compile the reference for {', '.join(ops)} (inductor fuses them)")
        if zero_stage >= 3 and (ops := [op for op in UNDER_ZERO3 if op in self.fused]):
            parts.append(f"under ZeRO-3 the reference for {', '.join(ops)} (partitioned weights)")
        return "; ".join(parts)

    # ------------------------------------------------------------------ guards
    def _reference(self, op: str, why: str) -> None:
        """Note (and say, once per op) that `op` ran its reference. Silent while torch.compile
        traces: `describe` names the ops that do so."""
        if op not in self.fell_back and not torch.compiler.is_compiling():
            self.fell_back[op] = why
            print(f"flashtrain: model.kernels: {op} runs its PyTorch reference here ({why})", file=sys.stderr,
                  flush=True)

    def _guarded(self, op: str, kernel: Callable, reference: Callable,
                 refuse: Callable[..., Optional[str]]) -> Callable:
        """kernel(*args), or reference(*args) where refuse(*args) names a reason."""
        def call(*args):
            why = refuse(*args)
            if why is None:
                return kernel(*args)
            self._reference(op, why)
            return reference(*args)
        call.__name__ = f"{op}_guarded"
        return call

    # ------------------------------------------------------------------ apply
    def apply(self, model: nn.Module) -> nn.Module:
        """Swap the fused ops' kernels into every module of `model` that uses one (in place)."""
        ops = self._ops()
        from model.attention import CSA2Attention
        from model.engram import Engram
        from model.mhc import HyperConnection
        from model.moe import MoE, RoutedExperts, SharedExpert
        from model.numerics import RMSNorm
        from model.rope import Rotary
        from model.transformer import Block, Transformer

        sites = {RMSNorm: ("rms_norm",), Rotary: ("rotate",),
                 Block: ("mix_streams", "update_streams", "fused_mhc", "fused_mix"),
                 Transformer: ("mix_streams", "head_loss"),
                 HyperConnection: ("sinkhorn",), SharedExpert: ("swiglu",), RoutedExperts: ("swiglu",),
                 MoE: ("combine", "gather_sum"), Engram: ("gather_rows", "gate"),
                 CSA2Attention: ("attend", "attend_rotates", "scores_at", "scores_masked", "select")}
        for module in model.modules():
            for cls, names in sites.items():
                if isinstance(module, cls):
                    for name in names:
                        if name in ops:
                            setattr(module, name, ops[name])
        if "mhc_step" in self.fused:  # the blocks now hold the fused step: run them on its schedule
            from model.fused_mhc import apply_fused_schedule
            apply_fused_schedule(model)
        if self.fused and _needs_a_kernel_device not in model._forward_pre_hooks.values():
            model.register_forward_pre_hook(_needs_a_kernel_device)
        return model

    def _ops(self) -> dict[str, object]:
        """Module attribute -> its fused implementation, for the fused ops (Triton is imported
        only when some op is fused)."""
        out: dict[str, object] = {}
        on = self.fused
        if "rms_norm" in on:
            from model.kernels.rms_norm import rms_norm_triton
            from model.numerics import rms_norm

            def refuse_norm(x, shape, weight, eps):
                if why := _traced_or_fp64(x):
                    return why
                if weight is None or len(shape) != 1 or x.shape[-1] != shape[0]:
                    return "no weight, or not a norm over the last dim"
                return None
            out["rms_norm"] = self._guarded("rms_norm", lambda x, shape, w, eps: rms_norm_triton(x, w, eps),
                                            rms_norm, refuse_norm)
        if "rotary" in on:
            from model.kernels.rope import angle_share, rotary_triton
            from model.rope import rotate

            def refuse_rotary(x, angles, inverse=False):
                if x.dtype == torch.float64:
                    return "fp64"
                return (None if angle_share(x, angles) is not None
                        else "angles broadcast in a way the kernel does not take")
            out["rotate"] = self._guarded("rotary", rotary_triton, rotate, refuse_rotary)
        if "stream_mix" in on:
            from model.kernels.stream_mix import mix_streams_triton, update_streams_triton
            from model.mhc import mix_streams, update_streams

            def refuse_mix(pre, h):
                if h.dtype == torch.float64:
                    return "fp64"
                return None if tuple(pre.shape) == tuple(h.shape[:-1]) else "broadcast arguments"

            def refuse_update(h, y, post, comb):
                if h.dtype == torch.float64:
                    return "fp64"
                want = ((y, h.shape[:-2] + h.shape[-1:]), (post, h.shape[:-1]),
                        (comb, h.shape[:-1] + h.shape[-2:-1]))
                return None if all(tuple(t.shape) == tuple(s) for t, s in want) else "broadcast arguments"
            out["mix_streams"] = self._guarded("stream_mix", mix_streams_triton, mix_streams, refuse_mix)
            out["update_streams"] = self._guarded("stream_mix", update_streams_triton, update_streams,
                                                  refuse_update)
        if "mhc_step" in on:
            from model.kernels.mhc import fused_mhc_mix, fused_mhc_step
            out["fused_mhc"], out["fused_mix"] = fused_mhc_step, fused_mhc_mix
        if "sinkhorn" in on:
            from model.kernels.sinkhorn import sinkhorn_comb_triton
            out["sinkhorn"] = sinkhorn_comb_triton  # one launch where the reference is ~80 ops
        if "swiglu" in on:
            from model.kernels.swiglu import clamped_swiglu_packed_triton
            out["swiglu"] = clamped_swiglu_packed_triton
        if "moe_combine" in on:
            from model.kernels.moe_combine import moe_combine_triton, moe_gather_sum_triton
            from model.moe import combine_reference, gather_sum_reference

            refuse_moe = _traced_or_fp64
            out["combine"] = self._guarded(
                "moe_combine",
                lambda y, inv, order, weights, dtype: moe_combine_triton(y, inv, weights, dtype),
                combine_reference, lambda y, *_: refuse_moe(y))
            out["gather_sum"] = self._guarded(
                "moe_combine", moe_gather_sum_triton, gather_sum_reference,
                lambda g, back, copies, dtype: refuse_moe(g) if copies > 1 else "one copy per row")
        if "engram_lookup" in on:
            from model.engram import engram_rows
            from model.kernels.engram import engram_lookup_triton

            def refuse_lookup(engram, *_):
                if torch.compiler.is_compiling():
                    return "torch.compile"
                return "ZeRO-3 partitioned table" if hasattr(engram.table.weight, "ds_id") else None
            out["gather_rows"] = self._guarded("engram_lookup", engram_lookup_triton, engram_rows,
                                               refuse_lookup)
        if "engram_gate" in on:
            from model.engram import engram_gate
            from model.kernels.engram_gate import engram_gate_triton

            out["gate"] = self._guarded("engram_gate", engram_gate_triton, engram_gate,
                                        lambda h, *_: _traced_or_fp64(h))
        if "attention" in on:
            from model.kernels.sparse_attention import sparse_attention_triton

            out["attend"], out["attend_rotates"] = sparse_attention_triton, True
        if "index_scores" in on:
            from model.kernels.indexer import index_scores_at_triton, index_scores_triton
            out["scores_at"], out["scores_masked"] = index_scores_at_triton, index_scores_triton
        if "topk" in on:
            from model.kernels.topk import select_topk_triton
            out["select"] = select_topk_triton
        if "cross_entropy" in on:
            from model.chunking import chunked_head_loss
            from model.kernels.cross_entropy import linear_cross_entropy_triton

            def fused_loss(x, head, labels, chunk=0):
                total = linear_cross_entropy_triton(x, head.weight, labels,
                                                    chunk if chunk > 0 else len(labels))
                return total / (labels != -100).sum().clamp(min=1)

            def refuse_loss(x, head, labels, chunk=0):
                if x.dtype == torch.float64:
                    return "fp64"
                return "ZeRO-3 partitioned head" if hasattr(head.weight, "ds_id") else None
            out["head_loss"] = self._guarded("cross_entropy", fused_loss, chunked_head_loss, refuse_loss)
        return out


def compile_with_limits(fn: Callable, backend: str | Callable, recompiles: int,
                        total_recompiles: int, dynamic: Optional[bool] = None) -> Callable:
    """torch.compile(fn), with dynamo's recompile limits raised to at least these while it runs.
    Layers share their code, so each layer's guards (its spec, what it reads) make another compiled
    version of the same functions, and every Triton kernel (`torch.compiler.disable`d) cuts a layer
    into frames. A frame dynamo fails to compile runs eagerly with a logged warning
    (suppress_errors): compiling changes how the model runs, never what it computes. The settings
    hold only during the call, so a user's own torch.compile elsewhere keeps dynamo's. dynamic is
    torch.compile's: False keeps every shape static, so layers whose shapes differ (each layer's
    cache length) recompile instead of turning into one symbolic graph."""
    import torch._dynamo

    compiled = torch.compile(fn, backend=backend, dynamic=dynamic)
    config = torch._dynamo.config
    settings = {"recompile_limit": max(config.recompile_limit, recompiles),
                "accumulated_recompile_limit": max(config.accumulated_recompile_limit, total_recompiles),
                "suppress_errors": True}

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with torch._dynamo.config.patch(**settings):
            return compiled(*args, **kwargs)
    return call
