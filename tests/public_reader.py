"""An independent reader of the public DeepSeek-V4.1-Flash checkpoint layout.

Written from the layout's description (issue 11), not from flashtrain: it imports only json,
safetensors and torch, and decodes every number format by hand from its bit layout:
  e8m0  scale byte e -> 2^(e - 127)
  e4m3  s eeee mmm, bias 7: normal (1 + m/8) 2^(e-7), subnormal (m/8) 2^-6
  e2m1  s ee m per nibble, two per byte (element 2i in the low nibble): 0, .5, 1, 1.5, 2, 3, 4, 6
  FP8 linear weights: one scale per 32x32 block; FP4 experts: one scale per 32 inputs;
  Engram tables (`engram.embed`): one scale per 32 values of a row.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def e8m0(byte: torch.Tensor) -> torch.Tensor:
    return torch.pow(2.0, byte.to(torch.float64) - 127)


def e4m3(byte: torch.Tensor) -> torch.Tensor:
    b = byte.to(torch.int64)
    sign = torch.where(b >> 7 == 1, -1.0, 1.0).to(torch.float64)
    exp, man = (b >> 3) & 0xF, (b & 0x7).to(torch.float64)
    normal = (1 + man / 8) * torch.pow(2.0, (exp - 7).to(torch.float64))
    subnormal = man / 8 * 2.0**-6
    return sign * torch.where(exp == 0, subnormal, normal)


def e2m1(nibble: torch.Tensor) -> torch.Tensor:
    n = nibble.to(torch.int64)
    return torch.where(n >> 3 == 1, -1.0, 1.0).to(torch.float64) * E2M1_MAGNITUDES[n & 0x7]


def _expand(scale: torch.Tensor, rows: int, cols: int, block_rows: int, block_cols: int) -> torch.Tensor:
    return scale.repeat_interleave(block_rows, 0).repeat_interleave(block_cols, 1)[:rows, :cols]


def decode(name: str, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """One stored tensor (and its scale) -> float64 values."""
    if scale is None:
        return weight.to(torch.float64)
    sbytes = e8m0(scale.view(torch.uint8))
    if weight.dtype == torch.float4_e2m1fn_x2:  # [out, in/2] bytes, scale per 32 inputs
        packed = weight.view(torch.uint8)
        codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)  # [out, in]
        return e2m1(codes) * _expand(sbytes, *codes.shape, 1, 32)
    values = e4m3(weight.view(torch.uint8))
    rows, cols = values.shape
    if ".engram.embed." in name:  # Engram table: a scale per 32 values of each row
        return values * _expand(sbytes, rows, cols, 1, 32)
    return values * _expand(sbytes, rows, cols, 32, 32)  # FP8 linear: a scale per 32x32 block


def read(root: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, every tensor by name, decoded to float64; `.scale` tensors folded into their
    weights)."""
    root = Path(root)
    config = json.loads((root / "config.json").read_text())
    weight_map = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    raw = {}
    for file in sorted(set(weight_map.values())):
        with safe_open(str(root / file), framework="pt") as f:
            for name in f.keys():
                assert weight_map[name] == file, f"{name} is in {file}, the index says {weight_map[name]}"
                raw[name] = f.get_tensor(name)
    assert set(raw) == set(weight_map), "the index and the shards name different tensors"
    out = {}
    for name, tensor in raw.items():
        if name.endswith(".scale") and name[:-len("scale")] + "weight" in raw:
            continue
        scale = raw.get(name[:-len("weight")] + "scale") if name.endswith(".weight") else None
        out[name] = decode(name, tensor, scale)
    return config, out
