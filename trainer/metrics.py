"""Metrics: the run's metrics.jsonl, throughput, MFU and MoE load balance."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

import torch

# Dense bf16 tensor-core peak per device (FLOP/s), from the vendors' datasheets.
GPU_PEAK_BF16 = {"H200": 989.4e12, "H100": 989.4e12, "H800": 989.4e12, "A100": 312e12, "B200": 2250e12,
                 "L40S": 362e12, "A10": 125e12}


def device_peak_flops(device: torch.device, configured: Optional[float]) -> tuple[float, str]:
    """Peak FLOP/s of one device and where the number came from."""
    if configured:
        return float(configured), "config"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in GPU_PEAK_BF16.items():
            if key in name:
                return peak, f"datasheet:{key}"
    return measure_matmul_flops(device), "measured-matmul"


def measure_matmul_flops(device: torch.device, n: int = 1024, reps: int = 8) -> float:
    """CPUs have no datasheet number we can look up: use the fp32 matmul rate of this machine."""
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    a @ b
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 2 * n**3 * reps / (time.perf_counter() - start)


class MetricsLog:
    """metrics.jsonl: one JSON object per logged step. On resume, rows past the checkpoint's step
    (written by the run that was interrupted) are dropped so the file reads as one run."""

    def __init__(self, path: Path, resume_step: Optional[int], enabled: bool):
        self.path, self.enabled = Path(path), enabled
        if not enabled:
            return
        if resume_step is None:
            self.path.write_text("")
        elif self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))

    def rows(self) -> list[dict[str, Any]]:
        """The rows on file, in the order they were written."""
        if not (self.enabled and self.path.exists()):
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def write(self, row: dict[str, Any]) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")


def moe_balance(loads: list[torch.Tensor]) -> dict[str, float]:
    """Per-layer expert load (tokens routed) -> max/mean load and coefficient of variation,
    averaged over MoE layers. 1.0 / 0.0 is perfect balance."""
    ratios, cvs = [], []
    for load in loads:
        mean = load.float().mean()
        if mean > 0:
            ratios.append((load.max() / mean).item())
            cvs.append((load.float().std(unbiased=False) / mean).item())
    if not ratios:
        return {}
    return {"moe_max_over_mean": sum(ratios) / len(ratios), "moe_load_cv": sum(cvs) / len(cvs)}
