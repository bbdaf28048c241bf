"""Kernel benchmarks: each Triton kernel against its baseline and its physical limit
(`python -m bench.kernels`)."""
