"""Shared measurement helpers for bench/kernels*.py: every figure is a ratio to a baseline
measured in the same process (absolute times on a shared machine are noisy)."""
from __future__ import annotations

import torch


def timed_ms(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median milliseconds per call of fn() on the current CUDA device."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def kernel_ms(fn, reps: int = 10, warmup: int = 3, name: str | None = None) -> float:
    """GPU milliseconds per call of fn(): the summed durations of the CUDA kernels (and copies) it
    launches, from the profiler; with `name`, only those of the kernels called that. For ops whose
    wall time per call is the host's launch overhead (a norm over [32768, 1024] is ~0.05 ms of GPU
    work behind ~0.1 ms of Python and launches), and that in a GPU-bound step cost only their
    kernels' time; unlike graph_ms it needs no capturable fn (autograd backward)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()
               if name is None or e.key == name) / 1e3 / reps


def graph_ms(fn, calls: int = 20, reps: int = 9, warmup: int = 3) -> float:
    """Median GPU milliseconds per call of fn(), from `calls` back-to-back calls captured in one CUDA
    graph and replayed `reps` times: for kernels of tens of microseconds, where timed_ms would
    count the host's launch overhead (Python wrapper, allocation, Triton launcher) as kernel
    time. fn must be capturable (no host sync); its allocations come from the graph's pool."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compile, allocator) on a side stream, as capture needs
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    torch.cuda.empty_cache()
    return sorted(times)[len(times) // 2]


def copy_bandwidth_gbs(n_bytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth (read + write bytes per second, in GB/s)."""
    src = torch.empty(n_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = timed_ms(lambda: dst.copy_(src))
    return 2 * n_bytes / ms / 1e6


def matmul_tflops(n: int = 8192) -> float:
    """Measured dense bf16 matmul throughput (TFLOP/s): the denominator of 'useful TFLOP/s'."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = timed_ms(lambda: a @ b)
    return 2 * n**3 / ms / 1e9


def timed_into(out: dict, key: str, fn, **kw) -> float:
    """out[key] = timed_ms(fn, **kw); NaN (and out[key + '_oom'] = 1) when the GPU runs out of
    memory, so one oversized entry does not lose the others. Returns out[key]."""
    try:
        out[key] = timed_ms(fn, **kw)
    except torch.OutOfMemoryError:
        out[key], out[f"{key}_oom"] = float("nan"), 1
    torch.cuda.empty_cache()
    return out[key]
