"""The step's smaller fused ops against their PyTorch references, at `small`'s training shape
(8 x 4096 tokens), each in one process:

* rotary (model/kernels/rope.py) on q [8, 4096, 16, 512] bf16, RoPE on the last 64 dims, angles
  shared by the heads: forward and forward+backward vs `Rotary`'s reference; the forward's bytes
  (one read and one write of q) as a fraction of the measured copy bandwidth.
* the mHC stream mixes the fused step cannot take (model/kernels/stream_mix.py): update_streams
  and mix_streams with fp32 streams [8, 4096, 4, 1024] (training with model.fp32_residual=true;
  the default holds them in bf16), a bf16 sub-layer output and fp32 coefficients, under bf16
  autocast (where the reference's einsums run as bf16 batched matmuls): forward and
  forward+backward vs the reference.
* RMSNorm (model/kernels/rms_norm.py) on bf16 [8, 4096, D], D = 1024 (the block norms) and 512
  (q / kv norms), weight and input gradients: forward and forward+backward vs the reference
  (torch's fused rms_norm with the weight in bf16), in GPU kernel time (`kernel_ms`: one call is
  launch-bound on the host, in the GPU-bound step only its kernels count); each pass's bytes
  (forward: read x, write y; backward: read x and dy, write dx) as a fraction of the copy bandwidth.
* Engram's gated residual add (model/kernels/engram_gate.py) at an Engram layer: fp32 streams
  [8, 4096, 4, 1024], bf16 kv [8, 4096, 5, 1024] (the fused projection's output under autocast):
  forward and forward+backward (gradients of h and kv) vs `Engram.gated_residual`, in GPU kernel
  time; the bytes of each pass (forward: read h and kv, write out; backward: read h, kv and the
  output's gradient, write the gradients of h and kv) as a fraction of the copy bandwidth.

    python -m bench.kernels.small_ops
"""
from __future__ import annotations

import dataclasses
import json

import torch
import torch.nn.functional as F

from bench.timing import copy_bandwidth_gbs, kernel_ms, timed_ms
from conf.model import TinyModelConfig
from model.engram import Engram
from model.kernels.engram_gate import engram_gate_triton
from model.kernels.rms_norm import _rms_norm_kernel
from model.kernels.stream_mix import mix_streams_triton, update_streams_triton
from model.mhc import mix_streams, update_streams
from model.ops import KernelPolicy
from model.rope import Rotary

B, T, H, C, R, N, D = 8, 4096, 16, 512, 64, 4, 1024


def _pair(fn_ref, fn_kernel, inputs, n_diff: int, timer=timed_ms) -> dict:
    """Forward and forward+backward (gradients of the first n_diff inputs) times (ms) of both,
    under bf16 autocast, and the ratios. timer: timed_ms (wall medians) or kernel_ms (GPU time)."""
    grad_inputs = [t.detach().clone().requires_grad_(i < n_diff) for i, t in enumerate(inputs)]
    diff = [t for t in grad_inputs if t.requires_grad]
    out = {}
    for name, fn in (("ref", fn_ref), ("kernel", fn_kernel)):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            with torch.no_grad():
                o = fn(*inputs)
            cot = torch.randn_like(o)

            def fwd(fn=fn):
                with torch.no_grad():
                    fn(*inputs)

            def fwd_bwd(fn=fn, cot=cot):
                torch.autograd.grad(fn(*grad_inputs), diff, cot)

            out[f"{name}_fwd_ms"] = timer(fwd)
            out[f"{name}_fwd_bwd_ms"] = timer(fwd_bwd)
    out["fwd_speedup"] = out["ref_fwd_ms"] / out["kernel_fwd_ms"]
    out["fwd_bwd_speedup"] = out["ref_fwd_bwd_ms"] / out["kernel_fwd_bwd_ms"]
    return out


def bench(device) -> dict:
    torch.cuda.set_device(device)
    g = torch.Generator(device="cuda").manual_seed(0)
    copy_gbs = copy_bandwidth_gbs()
    result = {"shape": {"tokens": B * T, "heads": H, "latent": C, "rope_dims": R, "streams": N, "dim": D},
              "copy_gbs": copy_gbs}

    ref_rot = Rotary(R, 160_000.0).cuda()
    ker_rot = KernelPolicy(["rotary"]).apply(Rotary(R, 160_000.0)).cuda()
    q = torch.randn(B, T, H, C, device="cuda", generator=g).to(torch.bfloat16)
    angles = ref_rot.angles(torch.arange(T, device="cuda").expand(B, T)).unsqueeze(-2)
    rot = _pair(ref_rot, ker_rot, [q, angles], 1)
    rot["kernel_fwd_frac_copy"] = 2 * q.numel() * q.element_size() / (rot["kernel_fwd_ms"] * 1e6) / copy_gbs
    result["rotary_q"] = rot

    h = torch.randn(B, T, N, D, device="cuda", generator=g)
    y = torch.randn(B, T, D, device="cuda", generator=g).to(torch.bfloat16)
    post = 2 * torch.rand(B, T, N, device="cuda", generator=g)
    comb = torch.rand(B, T, N, N, device="cuda", generator=g)
    pre = torch.rand(B, T, N, device="cuda", generator=g)
    upd = _pair(update_streams, update_streams_triton, [h, y, post, comb], 4)
    # forward bytes: h and h' (fp32) and y (bf16)
    upd["kernel_fwd_frac_copy"] = ((2 * h.numel() * 4 + y.numel() * 2) / (upd["kernel_fwd_ms"] * 1e6)
                                   / copy_gbs)
    result["update_streams"] = upd
    mix = _pair(mix_streams, mix_streams_triton, [pre, h], 2)
    mix["kernel_fwd_frac_copy"] = (h.numel() * 4 + B * T * D * 4) / (mix["kernel_fwd_ms"] * 1e6) / copy_gbs
    result["mix_streams"] = mix
    for dim in (1024, 512):
        x = torch.randn(B, T, dim, device="cuda", generator=g).to(torch.bfloat16)
        w = 1 + 0.1 * torch.randn(dim, device="cuda", generator=g)
        # as model.numerics.RMSNorm under autocast (where rms_norm may run in fp32): bf16 out
        norm = _pair(lambda x, w: F.rms_norm(x, (x.shape[-1],), w.to(x.dtype), 1e-6).to(x.dtype),
                     lambda x, w: _rms_norm_kernel(x, w, 1e-6, x.dtype), [x, w], 2, timer=kernel_ms)
        nbytes = x.numel() * x.element_size()
        norm["kernel_fwd_frac_copy"] = 2 * nbytes / (norm["kernel_fwd_ms"] * 1e6) / copy_gbs
        bwd_ms = norm["kernel_fwd_bwd_ms"] - norm["kernel_fwd_ms"]
        norm["kernel_bwd_frac_copy"] = 3 * nbytes / (bwd_ms * 1e6) / copy_gbs
        result[f"rms_norm_{dim}"] = norm
    result["engram_gate"] = _engram_gate(g, copy_gbs)
    return result


def _engram_gate(g: torch.Generator, copy_gbs: float) -> dict:
    cfg = dataclasses.replace(TinyModelConfig(vocab_size=97), engram_min_rows=50, dim=D, hc_mult=N)
    eng = Engram(cfg, cfg.engram_layers[0]).cuda()
    h = torch.randn(B, T, N, D, device="cuda", generator=g)
    kv = torch.randn(B, T, N + 1, D, device="cuda", generator=g).to(torch.bfloat16)
    w_h, w_k = eng.hidden_norm_weight, eng.key_norm_weight
    gate = _pair(eng.gated_residual, lambda h, kv: engram_gate_triton(h, kv, w_h, w_k, eng.eps),
                 [h, kv], 2, timer=kernel_ms)
    fwd_bytes = 2 * h.numel() * 4 + kv.numel() * 2
    bwd_bytes = 3 * h.numel() * 4 + 2 * kv.numel() * 2
    gate["kernel_fwd_frac_copy"] = fwd_bytes / (gate["kernel_fwd_ms"] * 1e6) / copy_gbs
    gate["kernel_bwd_frac_copy"] = (bwd_bytes / ((gate["kernel_fwd_bwd_ms"] - gate["kernel_fwd_ms"]) * 1e6)
                                    / copy_gbs)
    return gate


if __name__ == "__main__":
    print(json.dumps(bench(torch.device("cuda", 0)), indent=1))
