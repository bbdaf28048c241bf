"""The step's smaller fused ops against their PyTorch references, at `small`'s training shape
(8 x 4096 tokens), each in one process:

* rotary (model/kernels/rope.py) on q [8, 4096, 16, 512] bf16, RoPE on the last 64 dims, angles
  shared by the heads: forward and forward+backward vs `Rotary`'s reference; the forward's bytes
  (one read and one write of q) as a fraction of the measured copy bandwidth.
* the mHC stream mixes the fused step cannot take (model/kernels/stream_mix.py): update_streams
  and mix_streams with fp32 streams [8, 4096, 4, 1024], a bf16 sub-layer output and fp32
  coefficients, under bf16 autocast as in training (where the reference's einsums run as bf16
  batched matmuls): forward and forward+backward vs the reference.
* the backward adds as paired reductions from the MMA layout (FLASHTRAIN_PAIRED_ADDS,
  model/kernels/paired_adds.py) against the atomic adds, forward+backward medians of both and the
  gradients' largest relative difference: sparse attention's dK = dV at q [8, 4096, 16, 512] bf16
  with k = 512 causal random selections over 4096 entries and the 128-token window; the indexer's
  dk (`index_scores_at`) at q [8, 4096, 16, 128] with the same selections as candidates.

    python -m bench.kernels_small_ops
"""
from __future__ import annotations

import json

import torch

import model.kernels.paired_adds as paired_adds
import model.kernels.sparse_attention as sparse_kernels
from bench.kernel_timing import copy_bandwidth_gbs, timed_ms
from model.kernels.indexer import index_scores_at_triton
from model.kernels.stream_mix import mix_streams_triton, update_streams_triton
from model.mhc import mix_streams, update_streams
from model.rope import Rotary

B, T, H, C, R, N, D = 8, 4096, 16, 512, 64, 4, 1024


def _pair(fn_ref, fn_kernel, inputs, n_diff: int) -> dict:
    """Forward and forward+backward (gradients of the first n_diff inputs) medians (ms) of both,
    under bf16 autocast, and the ratios."""
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

            out[f"{name}_fwd_ms"] = timed_ms(fwd)
            out[f"{name}_fwd_bwd_ms"] = timed_ms(fwd_bwd)
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
    ker_rot = Rotary(R, 160_000.0, kernels=True).cuda()
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
    upd["kernel_fwd_frac_copy"] = (2 * h.numel() * 4 + y.numel() * 2) / (upd["kernel_fwd_ms"] * 1e6) / copy_gbs
    result["update_streams"] = upd
    mix = _pair(mix_streams, mix_streams_triton, [pre, h], 2)
    mix["kernel_fwd_frac_copy"] = (h.numel() * 4 + B * T * D * 4) / (mix["kernel_fwd_ms"] * 1e6) / copy_gbs
    result["mix_streams"] = mix
    idx = _causal_selections(g)
    result["attention_paired_adds"] = _attention_paired_adds(g, idx)
    result["indexer_paired_adds"] = _indexer_paired_adds(g, idx)
    return result


def _causal_selections(g: torch.Generator, k: int = 512) -> torch.Tensor:
    """[B, T, k] random distinct entries s <= t per query, -1 padding last (early queries)."""
    causal = torch.ones(T, T, device="cuda", dtype=torch.bool).tril()  # entry s visible to query t >= s
    keys = torch.rand(B, T, T, device="cuda", generator=g).masked_fill(~causal, -1.0)
    top = keys.topk(k, dim=-1)
    return torch.where(top.values >= 0, top.indices, -1).sort(dim=-1, descending=True).values


def _paired_vs_atomic(fwd_bwd) -> dict:
    """fwd_bwd() -> gradients, timed with the atomic and with the paired adds in one process."""
    out, grads = {}, {}
    before = paired_adds.PAIRED_ADDS
    try:
        for paired in (False, True):
            paired_adds.PAIRED_ADDS = paired
            grads[paired] = fwd_bwd()
            out[f"{'paired' if paired else 'atomic'}_fwd_bwd_ms"] = timed_ms(fwd_bwd)
    finally:
        paired_adds.PAIRED_ADDS = before
    out["speedup"] = out["atomic_fwd_bwd_ms"] / out["paired_fwd_bwd_ms"]
    out["grad_rel_diff"] = max(((a.float() - b.float()).norm() / b.float().norm()).item()
                               for a, b in zip(grads[True], grads[False]))
    return out


def _attention_paired_adds(g: torch.Generator, idx: torch.Tensor, W: int = 128) -> dict:
    q = torch.randn(B, T, H, C, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    kv = torch.randn(B, T, C, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    glob = torch.randn(B, T, C, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    doc = torch.zeros(B, T, dtype=torch.long, device="cuda")
    sink = torch.zeros(H, device="cuda")
    cot = torch.randn(B, T, H, C, device="cuda", generator=g).to(torch.bfloat16)

    def fwd_bwd():
        o, _ = sparse_kernels.sparse_attention_triton(q, kv, glob, idx, doc, sink, C ** -0.5, W, want_probs=False)
        return torch.autograd.grad(o, (q, kv, glob), cot)
    return _paired_vs_atomic(fwd_bwd)


def _indexer_paired_adds(g: torch.Generator, cand: torch.Tensor, Di: int = 128) -> dict:
    q = torch.randn(B, T, H, Di, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(B, T, H, device="cuda", generator=g) * (Di * H) ** -0.5).requires_grad_()
    k = torch.randn(B, T, Di, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    cot = torch.randn(cand.shape, device="cuda", generator=g).masked_fill(cand < 0, 0.0)

    def fwd_bwd():
        s = index_scores_at_triton(q, w, k, cand)
        return torch.autograd.grad(s.masked_fill(cand < 0, 0.0), (q, w, k), cot)
    return _paired_vs_atomic(fwd_bwd)


if __name__ == "__main__":
    print(json.dumps(bench(torch.device("cuda", 0)), indent=1))
