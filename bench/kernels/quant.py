"""KV-cache quantisation kernels (model/kernels/quant.py) against the PyTorch reference (model/quant.py),
on CUDA; prints one JSON object.

For each format (kv_fp4, mxfp4, fp8) and operation, on a bf16 [rows, dim] tensor:

* pack: bf16 values -> (codes, scale bytes)
* unpack: (codes, scale bytes) -> bf16 values
* quant_dequant: bf16 -> bf16, the QAT forward (reference: fake_quant_<fmt>)

each as effective bandwidth (the bytes an ideal kernel must move: inputs read once plus outputs written
once, the same count for kernel and reference) and as a fraction of the device-to-device copy bandwidth
measured in the same process (bench/timing.py). The reference's extra traffic (fp32 copies,
int64 bucket indices) is exactly what its lower figure shows.

Timing: at 65536 x 512 a kernel call is 25-50 us of GPU time, about what the host needs to launch it
(Python wrapper, two allocations, Triton's launcher), so one call between two events measures mostly the
host. The primary figures (``*_gbs``, ``*_frac_copy``) therefore time 20 back-to-back calls captured in
one CUDA graph (bench.timing.graph_ms): GPU time only, for kernel and reference alike. The input
(64 MiB) is larger than the H200's 50 MB L2, so repeated calls do not run from cache. ``*_eager_frac_copy``
keeps the old per-call event timing, host launch included: what a lone eager call achieves.

    python -m bench.kernels.quant [--rows 65536] [--dim 512]
"""
from __future__ import annotations

import argparse
import json

import torch

from bench.timing import copy_bandwidth_gbs, graph_ms, timed_ms
from model import quant as ref
from model.kernels import quant as kern

FORMATS = {
    # name: (reference pack, reference unpack, kernel pack, kernel unpack, reference fake quant)
    "kv_fp4": (ref.pack_kv_fp4, ref.unpack_kv_fp4, kern.pack_kv_fp4, kern.unpack_kv_fp4,
               ref.fake_quant_kv_fp4),
    "mxfp4": (ref.pack_mxfp4, ref.unpack_mxfp4, kern.pack_mxfp4, kern.unpack_mxfp4, ref.fake_quant_mxfp4),
    "fp8": (ref.pack_fp8, ref.unpack_fp8, kern.pack_fp8, kern.unpack_fp8, ref.fake_quant_fp8),
}


def _nbytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _bench_format(name: str, x: torch.Tensor, copy_gbs: float, reps: int) -> dict[str, float]:
    r_pack, r_unpack, k_pack, k_unpack, r_fake = FORMATS[name]
    codes, scales = k_pack(x)
    r_codes, r_scales = r_pack(x)
    y, qd = k_unpack(codes, scales, torch.bfloat16), kern.quant_dequant(name, x)
    same = (torch.equal(codes, r_codes) and torch.equal(scales, r_scales)
            and torch.equal(y.view(torch.int16),
                            r_unpack(r_codes, r_scales, torch.bfloat16).view(torch.int16))
            and torch.equal(qd.view(torch.int16), r_fake(x).view(torch.int16)))
    out = {f"{name}_matches_reference": float(same)}
    packed = _nbytes(codes, scales)
    runs = {  # op: (bytes moved, kernel, reference)
        "pack": (_nbytes(x) + packed, lambda: k_pack(x), lambda: r_pack(x)),
        "unpack": (packed + _nbytes(y), lambda: k_unpack(codes, scales, torch.bfloat16),
                   lambda: r_unpack(codes, scales, torch.bfloat16)),
        "quant_dequant": (2 * _nbytes(x), lambda: kern.quant_dequant(name, x), lambda: r_fake(x)),
    }
    for op, (n_bytes, k_fn, r_fn) in runs.items():
        k_gbs = n_bytes / graph_ms(k_fn) / 1e6
        r_gbs = n_bytes / graph_ms(r_fn) / 1e6
        out[f"{name}_{op}_kernel_gbs"] = k_gbs
        out[f"{name}_{op}_kernel_frac_copy"] = k_gbs / copy_gbs
        out[f"{name}_{op}_kernel_eager_frac_copy"] = n_bytes / timed_ms(k_fn, reps=reps) / 1e6 / copy_gbs
        out[f"{name}_{op}_ref_gbs"] = r_gbs
        out[f"{name}_{op}_ref_frac_copy"] = r_gbs / copy_gbs
        out[f"{name}_{op}_speedup"] = k_gbs / r_gbs
    return out


def bench(device: torch.device | str = "cuda", rows: int = 65536, dim: int = 512, reps: int = 20) -> dict:
    """Kernel and reference bandwidth for every format and operation; a flat dict of numbers, keyed
    ``<fmt>_<op>_{kernel,ref}_{gbs,frac_copy}`` and ``<fmt>_<op>_speedup``, plus ``copy_gbs`` and
    ``<fmt>_<op>_kernel_eager_frac_copy`` (one call between events, host launch included) and
    ``<fmt>_matches_reference`` (1.0 when the kernels reproduced the reference bit for bit on this data)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"bench needs a CUDA device, got {device}")
    out: dict[str, float] = {"rows": rows, "dim": dim, "timing": "cuda_graph_x20"}
    with torch.cuda.device(device), torch.no_grad():
        out["copy_gbs"] = copy_bandwidth_gbs()
        x = torch.randn(rows, dim, device=device, dtype=torch.bfloat16)
        for name in FORMATS:
            out.update(_bench_format(name, x, out["copy_gbs"], reps))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=65536)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    result = {"bench": "kernels_quant", "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, **bench("cuda", args.rows, args.dim, args.reps)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
