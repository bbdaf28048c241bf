"""Triton CSA2 sparse attention (model/kernels/sparse_attention.py) vs dense causal attention
(torch SDPA) and vs the plain-PyTorch reference (model.csa.sparse_attention), on one GPU.

For each context length S, the T = 4096 last queries of the sequence (a query chunk as the
model runs it) attend with H = 64 heads over C = 512: the kernel to its W = 128 window rows plus
k = 512 selected entries out of S / 4 compressed entries; SDPA to all S keys (causal, aligned
bottom-right). Useful TFLOP/s count only the attended pairs: 4 * T * H * (k + W) * C forward
and 2.5x that backward (the flash-attention convention), as a fraction of measured bf16 matmul
throughput.

    python -m bench.kernels.attention
"""
from __future__ import annotations

import functools
import json

import torch

T, H, C, K, W, RATIO = 4096, 64, 512, 512, 128, 4
LENGTHS = (8192, 32768, 65536, 131072)


def _inputs(S: int, device: torch.device, grad: bool) -> dict:
    g = torch.Generator(device=device).manual_seed(S)
    r = lambda *shape: torch.randn(*shape, device=device, generator=g,
                                   dtype=torch.bfloat16).requires_grad_(grad)
    entries = S // RATIO
    visible = max(K, (S - T) // RATIO)  # entries complete before the chunk's first query
    idx = torch.rand(1, T, visible, device=device, generator=g).topk(K, dim=-1).indices
    return dict(q=r(1, T, H, C), win_kv=r(1, T, C), glob_kv=r(1, entries, C), idx=idx,
                doc_start=torch.zeros(1, T, dtype=torch.long, device=device),
                sink=torch.zeros(H, device=device, requires_grad=grad), scale=C ** -0.5, window=W,
                positions=(S - T + torch.arange(T, device=device)).unsqueeze(0), halo=r(1, W - 1, C))


def _fwd_bwd(fn, args: dict):
    """A callable running fn forward and backward into every floating input that needs grad."""
    leaves = [v for v in args.values() if torch.is_tensor(v) and v.requires_grad]

    def run():
        out = fn(**args)[0]
        torch.autograd.grad(out, leaves, torch.ones_like(out))
    return run


def _guard(entry: dict, name: str, measure) -> None:
    """entry[name] = measure(), or 'oom' / the error's first line; memory freed either way."""
    try:
        entry[name] = measure()
    except torch.cuda.OutOfMemoryError:
        entry[name] = "oom"
    except RuntimeError as e:  # e.g. no SDPA backend for this shape
        entry[name] = f"error: {str(e).splitlines()[0][:200]}"
    torch.cuda.empty_cache()


def _sdpa_inputs(S: int, dim: int, device: torch.device):
    """q [1, H, T, dim], kv [1, H, S, dim] (MQA: one K = V row for every head, materialised per
    head so every backend takes it) and the backend CausalBias's dispatch will pick, or None
    where only the math path (materialised [H, T, S] scores) would run."""
    from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

    q = torch.randn(1, H, T, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    kv = torch.randn(1, 1, S, dim, device=device, dtype=torch.bfloat16).expand(1, H, S, dim).contiguous()
    kv.requires_grad_(True)
    params = SDPAParams(q, kv, kv, None, 0.0, False, False)  # the checks CausalBias makes, in order
    backend = ("flash" if can_use_flash_attention(params)
               else "efficient" if can_use_efficient_attention(params) else None)
    return q, kv, backend


def _sdpa(S: int, device: torch.device, entry: dict) -> None:
    """Dense causal SDPA of the T last queries over S keys, aligned bottom-right, at head dim 256:
    flash attention stops at 256, and the memory-efficient backend's backward at head dim 512
    hit an illegal memory access on the H200 (torch 2.11). The dense baseline is therefore
    charged for half the dot-product width of the sparse kernel: a conservative comparison."""
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    from bench.timing import timed_ms

    dim = 256
    q, kv, backend = _sdpa_inputs(S, dim, device)
    if backend is None:
        entry["sdpa"] = "only the math path would run"
        return
    mask = causal_lower_right(T, S)
    fwd = lambda: F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask)

    def fwd_bwd():
        out = fwd()
        torch.autograd.grad(out, (q, kv), torch.ones_like(out))

    entry.update(sdpa_backend=backend, sdpa_head_dim=dim)
    with torch.no_grad():
        _guard(entry, "sdpa_fwd_ms", lambda: timed_ms(fwd, reps=5, warmup=1))
    _guard(entry, "sdpa_fwd_bwd_ms", lambda: timed_ms(fwd_bwd, reps=5, warmup=1))
    flops = 4 * T * H * (S - (T - 1) / 2) * dim  # bottom-right causal: query i sees S - T + i + 1 keys
    for part, mult in (("fwd", 1.0), ("fwd_bwd", 3.5)):
        if isinstance(entry.get(f"sdpa_{part}_ms"), float):
            entry[f"sdpa_{part}_tflops"] = mult * flops / entry[f"sdpa_{part}_ms"] / 1e9


def _kernel(S: int, device: torch.device, entry: dict, peak: float) -> None:
    """The Triton kernel (and, at the first length, the PyTorch reference) at context length S."""
    from bench.timing import timed_ms
    from model.csa import sparse_attention
    from model.kernels.sparse_attention import sparse_attention_triton

    args = _inputs(S, device, grad=True)
    with torch.no_grad():
        _guard(entry, "kernel_fwd_ms",
               lambda: timed_ms(lambda: sparse_attention_triton(**args, want_probs=False)))
        # + the second pass producing the head-summed probabilities (what indexer_kl needs)
        _guard(entry, "kernel_fwd_probs_ms", lambda: timed_ms(lambda: sparse_attention_triton(**args)))
    no_probs = functools.partial(sparse_attention_triton, want_probs=False)
    _guard(entry, "kernel_fwd_bwd_ms", lambda: timed_ms(_fwd_bwd(no_probs, args), reps=10))
    fwd_flops = 4 * T * H * (K + W) * C
    for part, mult in (("fwd", 1.0), ("fwd_bwd", 3.5)):
        if isinstance(entry.get(f"kernel_{part}_ms"), float):
            entry[f"kernel_{part}_tflops"] = mult * fwd_flops / entry[f"kernel_{part}_ms"] / 1e9
            entry[f"kernel_{part}_frac_peak"] = entry[f"kernel_{part}_tflops"] / peak
    if S == LENGTHS[0]:  # the gathering reference: O(T * (k + W) * C) fp32 intermediates
        with torch.no_grad():
            _guard(entry, "reference_fwd_ms", lambda: timed_ms(lambda: sparse_attention(**args), reps=5))
        _guard(entry, "reference_fwd_bwd_ms", lambda: timed_ms(_fwd_bwd(sparse_attention, args), reps=5))
        for part in ("fwd", "fwd_bwd"):
            ref, ker = entry.get(f"reference_{part}_ms"), entry.get(f"kernel_{part}_ms")
            if isinstance(ref, float) and isinstance(ker, float):
                entry[f"reference_over_kernel_{part}"] = ref / ker


def bench(device) -> dict:
    """Times (ms), useful TFLOP/s and their fraction of dense bf16 matmul throughput, per length;
    an entry that runs out of memory reads 'oom'."""
    from bench.timing import matmul_tflops

    device = torch.device(device)
    assert device.type == "cuda", "bench.kernels.attention needs a CUDA device"
    torch.cuda.set_device(device)
    peak = matmul_tflops()
    result = {"device": torch.cuda.get_device_name(device), "peak_matmul_tflops": peak, "queries": T,
              "heads": H, "latent": C, "topk": K, "window": W, "compress_ratio": RATIO, "lengths": {}}
    for S in LENGTHS:
        entry = {}
        for name, part, extra in (("kernel", _kernel, (peak,)), ("sdpa", _sdpa, ())):
            try:
                part(S, device, entry, *extra)
            except torch.cuda.OutOfMemoryError:
                entry[name] = "oom"
            torch.cuda.empty_cache()
        for part in ("fwd", "fwd_bwd"):
            dense, ker = entry.get(f"sdpa_{part}_ms"), entry.get(f"kernel_{part}_ms")
            if isinstance(dense, float) and isinstance(ker, float):
                entry[f"sdpa_over_kernel_{part}"] = dense / ker
        result["lengths"][S] = entry
    return result


if __name__ == "__main__":
    print(json.dumps(bench("cuda"), indent=1))
