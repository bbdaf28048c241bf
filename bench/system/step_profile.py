"""Where the kernels-on `small` step's GPU time goes, at the micro-batch that gave the best MFU
(8 x 4096 tokens, eager): one profiled forward+backward and one profiled optimizer step, every
CUDA kernel put in one category by name. It bounds what fusing more can buy: the step cannot be
faster than its matmuls plus its attention, so `mfu_bound_gemm_attention` is the MFU with every
other kernel taking no time at all. MFU uses the median wall time of 3 unprofiled passes
(`fwd_bwd_wall_ms_passes` lists them).

Attention here is memory-bound by construction at 16 heads: each query gathers its own selected
rows (C = 512 latent values, bf16) and does 4 * H * C FLOPs with each (QK and PV, the row is both
K and V), i.e. 2H FLOPs per byte. `attention_hbm_bound_frac_peak` is that intensity times the
measured copy bandwidth over the bf16 peak: the attention's ceiling as a fraction of peak when its
rows come from HBM (neighbouring queries share window rows and, often, selected ones, so L2 can
lift it somewhat).
"""
from __future__ import annotations

import re
import statistics
import time

import torch

from bench.system.step import small_model
from bench.timing import copy_bandwidth_gbs
from model.accounting import train_flops_per_token
from trainer.metrics import device_peak_flops

# first match wins; the Triton kernels' names are those in model/kernels/
CATEGORIES = (
    # swiglu's kernels are _swiglu_*
    ("sparse_attention", r"^(_fwd_kernel|_bwd_kernel|_window_dkv_kernel|_psum_kernel)$"),
    ("indexer", r"^_scores"),
    ("mhc_sinkhorn", r"^(_mhc_|_sinkhorn_)"),
    ("gemm", r"nvjet|gemm|cutlass|xmma|wgmma|cublas"),
    ("copy_cast_cat", r"copy|Memcpy|CatArray|Memset"),
    ("softmax", r"SoftMax|softmax"),
    ("topk_sort", r"topk|Sort|sort|radix|DigitCounts|WithinKCounts"),
    ("index_gather_scatter", r"index|gather|scatter|Embedding|embedding"),
    ("other_elementwise_reduce", r""),
)


def _by_category(prof) -> dict[str, float]:
    out = {name: 0.0 for name, _ in CATEGORIES}
    for event in prof.key_averages():
        if event.self_device_time_total <= 0:
            continue
        name = next(n for n, pattern in CATEGORIES if re.search(pattern, event.key))
        out[name] += event.self_device_time_total / 1e3  # ms
    return out


def _top_kernels(prof, n: int = 30) -> list[dict]:
    """The n kernels with the most GPU time: name (cut to 90 characters), ms, calls."""
    events = sorted((e for e in prof.key_averages() if e.self_device_time_total > 0),
                    key=lambda e: -e.self_device_time_total)[:n]
    return [{"name": e.key[:90], "ms": round(e.self_device_time_total / 1e3, 2), "calls": e.count}
            for e in events]


def _top_ops(prof, n: int = 40) -> list[dict]:
    """The n (operator, input shapes) pairs whose own kernels take the most GPU time: which
    tensor op, forward or backward, a category's milliseconds come from."""
    from torch.autograd import DeviceType

    events = sorted((e for e in prof.key_averages(group_by_input_shape=True)
                     # operators, not kernels
                     if e.device_type == DeviceType.CPU and e.self_device_time_total > 0),
                    key=lambda e: -e.self_device_time_total)[:n]
    return [{"op": e.key[:60], "shapes": str(e.input_shapes)[:120],
             "ms": round(e.self_device_time_total / 1e3, 2), "calls": e.count} for e in events]


def bench(device, seq_len: int = 4096, micro_batch: int = 8, vocab: int = 129_280) -> dict:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.set_device(device)
    model, opt = small_model(kernels=True, vocab=vocab)
    cfg = model.cfg
    ids = torch.randint(0, vocab, (micro_batch, seq_len + 1), device="cuda")

    def fwd_bwd():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(ids[:, :-1], labels=ids[:, 1:])
        out.loss.backward()

    for _ in range(2):  # autotuning, allocator growth
        fwd_bwd()
        opt.step()
        opt.zero_grad(set_to_none=True)
    # the wall time is the median of 3 unprofiled passes: single passes of the same code spread
    # ~5% (idle gaps of 2-9% of the GPU time); each pass starts from set_to_none gradients
    walls = []
    for i in range(3):
        if i:
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        fwd_bwd()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - start) * 1e3)
    wall_ms = statistics.median(walls)
    start = time.perf_counter()
    opt.step()
    torch.cuda.synchronize()
    opt_wall_ms = (time.perf_counter() - start) * 1e3
    opt.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fwd_bwd()
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof_opt:
        opt.step()
        torch.cuda.synchronize()
    opt.zero_grad(set_to_none=True)
    # a third pass records operators and shapes (host-side overhead: kept out of the passes above)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof_ops:
        fwd_bwd()
        torch.cuda.synchronize()
    opt.zero_grad(set_to_none=True)

    cats, opt_cats = _by_category(prof), _by_category(prof_opt)
    gpu_ms, opt_gpu_ms = sum(cats.values()), sum(opt_cats.values())
    tokens = micro_batch * seq_len
    flops = train_flops_per_token(model, seq_len)
    peak, source = device_peak_flops(torch.device("cuda"), None)
    mfu = tokens * flops / (wall_ms / 1e3) / peak  # forward+backward only (no optimizer step)
    copy_gbs = copy_bandwidth_gbs()
    bound_ms = cats["gemm"] + cats["sparse_attention"]
    return {"model": "small", "seq_len": seq_len, "micro_batch": micro_batch, "tokens": tokens,
            "fwd_bwd_wall_ms": wall_ms, "fwd_bwd_wall_ms_passes": walls, "fwd_bwd_gpu_ms": gpu_ms,
            "gpu_busy_frac": gpu_ms / wall_ms,
            "fwd_bwd_ms": cats, "fwd_bwd_frac": {k: v / gpu_ms for k, v in cats.items()},
            "optimizer_wall_ms": opt_wall_ms, "optimizer_gpu_ms": opt_gpu_ms, "optimizer_ms": opt_cats,
            "mfu_fwd_bwd": mfu, "peak_source": source,
            "mfu_bound_gemm_attention": mfu * wall_ms / bound_ms,
            "copy_gbs": copy_gbs, "heads": cfg.n_heads,
            "attention_hbm_bound_frac_peak": 2 * cfg.n_heads * copy_gbs * 1e9 / peak,
            "top_kernels_fwd_bwd": _top_kernels(prof), "top_ops_fwd_bwd": _top_ops(prof_ops),
            "top_kernels_optimizer": _top_kernels(prof_opt, 15)}
