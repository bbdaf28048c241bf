"""Fused single-pass mHC step (model/kernels/mhc.py) vs the eager PyTorch composition it
replaces (update_streams -> next HyperConnection's RMS norm + linear -> mix_streams).

bf16 streams, fp32 coefficients, 16384 tokens, n = 4, D = 4096 (flash) and D = 1024.
Reports forward and forward+backward medians, the fused speedup, the fused forward's HBM
bytes per token next to the (2n + 2) * D * 2 ideal, and its achieved GB/s as a fraction of
the measured device copy bandwidth.

Also the Sinkhorn projection of the comb logits (model/kernels/sinkhorn.py, one launch
forward and one backward) against the eager `sinkhorn_comb` (~80 / ~160 launches), fp32,
n = 4, 20 rounds: keys sinkhorn_{train,decode}_* at [2, 4096, 4, 4] (a training call) and
[1, 1, 4, 4] (a decode step's call, launch-bound).

    python -m bench.kernels.mhc
"""
from __future__ import annotations

import json

import torch

from bench.timing import copy_bandwidth_gbs, timed_ms
from model.kernels.mhc import (
    forward_splits,
    fused_forward_bytes_per_token,
    fused_mhc_step,
    reference_mhc_step,
)
from model.kernels.sinkhorn import sinkhorn_comb_triton
from model.mhc import sinkhorn_comb

TOKENS, N_STREAMS, DIMS, EPS = 16384, 4, (4096, 1024), 1e-6
SINKHORN_ITERS = 20
SINKHORN_SHAPES = {"train": (2, 4096), "decode": (1, 1)}  # leading dims of the [..., n, n] logits


def _inputs(dim: int, device: torch.device):
    """h [1, T, n, D] and y [1, T, D] bf16; post, comb, pre fp32; fn [2n+n*n, n*D] fp32."""
    n, lead = N_STREAMS, (1, TOKENS)
    h = torch.randn(*lead, n, dim, device=device, dtype=torch.bfloat16)
    y = torch.randn(*lead, dim, device=device, dtype=torch.bfloat16)
    post = 2 * torch.sigmoid(torch.randn(*lead, n, device=device))
    comb = sinkhorn_comb(torch.randn(*lead, n, n, device=device), 20, EPS)
    pre = torch.sigmoid(torch.randn(*lead, n, device=device))
    fn = torch.randn(2 * n + n * n, n * dim, device=device) / (n * dim) ** 0.5
    return [h, y, post, comb, pre, fn]


def _bench_dim(dim: int, device: torch.device, copy_gbs: float) -> dict:
    inputs = _inputs(dim, device)
    grad_inputs = [t.detach().clone().requires_grad_() for t in inputs]
    with torch.no_grad():
        cot = [torch.randn_like(o) for o in reference_mhc_step(*inputs, EPS)]

    def fwd(step):
        with torch.no_grad():
            step(*inputs, EPS)

    def fwd_bwd(step):  # gradients of all six inputs, nothing accumulated into .grad
        torch.autograd.grad(step(*grad_inputs, EPS), grad_inputs, cot)

    out = {"fused_fwd_ms": timed_ms(lambda: fwd(fused_mhc_step)),
           "ref_fwd_ms": timed_ms(lambda: fwd(reference_mhc_step)),
           "fused_fwd_bwd_ms": timed_ms(lambda: fwd_bwd(fused_mhc_step)),
           "ref_fwd_bwd_ms": timed_ms(lambda: fwd_bwd(reference_mhc_step))}
    out["fwd_speedup"] = out["ref_fwd_ms"] / out["fused_fwd_ms"]
    out["fwd_bwd_speedup"] = out["ref_fwd_bwd_ms"] / out["fused_fwd_bwd_ms"]

    splits, _ = forward_splits(TOKENS, dim, device)
    traffic = fused_forward_bytes_per_token(N_STREAMS, dim, elem_bytes=2, splits=splits)
    out["fwd_splits"] = splits
    out["fused_fwd_bytes_per_token"] = traffic["fused"]
    out["ideal_bytes_per_token"] = traffic["ideal"]
    out["fused_over_ideal_bytes"] = traffic["fused"] / traffic["ideal"]
    out["fused_fwd_gbs"] = traffic["fused"] * TOKENS / out["fused_fwd_ms"] / 1e6
    out["fused_fwd_frac_copy_bw"] = out["fused_fwd_gbs"] / copy_gbs
    # the same time, counting only the ideal (2n + 2) * D bytes: the "useful" bandwidth
    out["fused_fwd_ideal_frac_copy_bw"] = traffic["ideal"] * TOKENS / out["fused_fwd_ms"] / 1e6 / copy_gbs
    return out


def _bench_sinkhorn(lead: tuple, device: torch.device) -> dict:
    """Triton vs eager Sinkhorn of fp32 [*lead, n, n] logits: forward, forward + backward."""
    x = torch.randn(*lead, N_STREAMS, N_STREAMS, device=device)
    x_grad = x.clone().requires_grad_()
    cot = torch.randn_like(x)

    def fwd(fn):
        with torch.no_grad():
            fn(x, SINKHORN_ITERS, EPS)

    def fwd_bwd(fn):
        torch.autograd.grad(fn(x_grad, SINKHORN_ITERS, EPS), [x_grad], cot)

    out = {"triton_fwd_ms": timed_ms(lambda: fwd(sinkhorn_comb_triton), reps=50),
           "ref_fwd_ms": timed_ms(lambda: fwd(sinkhorn_comb), reps=50),
           "triton_fwd_bwd_ms": timed_ms(lambda: fwd_bwd(sinkhorn_comb_triton), reps=50),
           "ref_fwd_bwd_ms": timed_ms(lambda: fwd_bwd(sinkhorn_comb), reps=50)}
    out["fwd_speedup"] = out["ref_fwd_ms"] / out["triton_fwd_ms"]
    out["fwd_bwd_speedup"] = out["ref_fwd_bwd_ms"] / out["triton_fwd_bwd_ms"]
    return out


def bench(device: torch.device) -> dict:
    """A flat dict of numbers, keys prefixed d{D}_ (fused step: times in ms, bytes per token,
    GB/s) and sinkhorn_{train,decode}_ (times in ms, speedups)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise RuntimeError("bench.kernels.mhc needs a CUDA device")
    torch.manual_seed(0)
    with torch.cuda.device(device):  # timed_ms and copy_bandwidth_gbs use the current device
        copy_gbs = copy_bandwidth_gbs()
        out = {"tokens": TOKENS, "n_streams": N_STREAMS, "bytes_per_element": 2,
               "copy_bandwidth_gbs": copy_gbs}
        for dim in DIMS:
            out.update({f"d{dim}_{k}": v for k, v in _bench_dim(dim, device, copy_gbs).items()})
            torch.cuda.empty_cache()
        for name, lead in SINKHORN_SHAPES.items():
            out.update({f"sinkhorn_{name}_{k}": v for k, v in _bench_sinkhorn(lead, device).items()})
    return out


if __name__ == "__main__":
    print(json.dumps(bench(torch.device("cuda")), indent=1))
