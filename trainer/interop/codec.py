"""The encodings of the public checkpoint layout, on top of model/quant.py's quantisers.

  bf16        one bfloat16 tensor
  fp32        one float32 tensor
  fp8_block   `weight` float8_e4m3fn [out, in] + `scale` float8_e8m0fnu [ceil(out/32), ceil(in/32)]:
              one power-of-two scale per 32x32 block (SPEC §11 "FP8 weights")
  fp4_expert  `weight` float4_e2m1fn_x2 [out, in/2] (safetensors F4, header shape [out, in]) +
              `scale` e8m0 [out, in/32]: MXFP4 along the input dim (SPEC §11 "FP4 routed experts")
  fp8_row     `weight` e4m3 [rows, dim] + `scale` e8m0 [rows, ceil(dim/32)]: Engram table rows

Rounding is model/quant.py's, the rules of the activation quantisers: FP8 scale pow2ceil(amax/448)
with amax >= 1e-4 and values clamped to +-448; MXFP4 scale 2^ceil(log2(amax/6)) with
amax >= 6*2^-126; E4M3 and E2M1 round to nearest, ties to even. Partial blocks (a dim that is not a
multiple of 32) are padded with zeros, which never raise a block's amax.

Canonical codes: with those rules quantise(dequantise(codes)) is NOT always the stored codes. A
block whose rounded maximum lands on exactly half the format's range (E4M3 224, E2M1 3) dequantises
to values whose amax gives the next smaller power-of-two scale, so a re-quantisation stores the same
values at half the scale and twice the codes. `encode` therefore stores Q(D(Q(x))): the same
dequantised values as the activation quantiser's Q(x) (bit for bit), in the one code form that is a
fixed point of Q(D(.)), so an export of an imported checkpoint is byte-identical to its source.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from model.quant import FORMATS, pack_fp8, pack_mxfp4, unpack_fp8, unpack_mxfp4

BLOCK = 32
ROW_CHUNK = 1 << 18  # rows quantised at a time: fp32 temporaries stay small for the 384M-row Engram tables
QUANTISED = ("fp8_block", "fp4_expert", "fp8_row")
ENCODINGS = ("bf16", "fp32", *QUANTISED)
# safetensors header dtype -> bytes per element (F4: two elements per byte)
HEADER_BYTES = {"BF16": 2.0, "F32": 4.0, "F8_E4M3": 1.0, "F8_E8M0": 1.0, "F4": 0.5}


def _ceil(n: int, block: int = BLOCK) -> int:
    return -(-n // block)


def stored(encoding: str, shape: tuple[int, ...]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """What the layout stores for a dequantised tensor of `shape`: suffix -> (safetensors header
    dtype, header shape). Suffix "" is the tensor itself, "scale" its scale tensor."""
    if encoding == "bf16":
        return {"": ("BF16", shape)}
    if encoding == "fp32":
        return {"": ("F32", shape)}
    rows, cols = shape
    if encoding == "fp8_block":
        return {"": ("F8_E4M3", shape), "scale": ("F8_E8M0", (_ceil(rows), _ceil(cols)))}
    if encoding == "fp4_expert":
        return {"": ("F4", shape), "scale": ("F8_E8M0", (rows, cols // BLOCK))}
    if encoding == "fp8_row":
        return {"": ("F8_E4M3", shape), "scale": ("F8_E8M0", (rows, _ceil(cols)))}
    raise ValueError(f"unknown encoding {encoding!r}")


def stored_bytes(encoding: str, shape: tuple[int, ...]) -> int:
    total = 0.0
    for dtype, dims in stored(encoding, shape).values():
        total += HEADER_BYTES[dtype] * torch.Size(dims).numel()
    return int(total)


# ------------------------------------------------------------------ FP8 32x32 blocks
def _to_blocks(x: Tensor) -> Tensor:
    """[out, in] -> [ceil(out/32), ceil(in/32), 1024] fp32, zero padded."""
    rows, cols = x.shape
    x = F.pad(x.float(), (0, _ceil(cols) * BLOCK - cols, 0, _ceil(rows) * BLOCK - rows))
    return x.view(_ceil(rows), BLOCK, _ceil(cols), BLOCK).permute(0, 2, 1, 3).reshape(_ceil(rows), _ceil(cols), -1)


def _from_blocks(xb: Tensor, rows: int, cols: int) -> Tensor:
    ob, ib, _ = xb.shape
    return xb.view(ob, ib, BLOCK, BLOCK).permute(0, 2, 1, 3).reshape(ob * BLOCK, ib * BLOCK)[:rows, :cols]


def _fp8_block_codes(x: Tensor) -> tuple[Tensor, Tensor]:
    """[out, in] -> (E4M3 bits uint8 [out, in], E8M0 bytes [ceil(out/32), ceil(in/32)])."""
    codes, sbytes = FORMATS["fp8"].encode(_to_blocks(x))  # one amax and scale per 1024-value block
    return _from_blocks(codes, *x.shape).contiguous(), sbytes


def _fp8_block_values(codes: Tensor, sbytes: Tensor) -> Tensor:
    fmt = FORMATS["fp8"]
    rows, cols = codes.shape
    scale = fmt.decode_scale(sbytes).repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]
    return fmt.decode_values(codes) * scale


# ------------------------------------------------------------------ FP8 rows (Engram tables)
def _fp8_row_codes(x: Tensor) -> tuple[Tensor, Tensor]:
    rows, cols = x.shape
    codes, sbytes = [], []
    for lo in range(0, rows, ROW_CHUNK):
        c, s = pack_fp8(F.pad(x[lo:lo + ROW_CHUNK].float(), (0, _ceil(cols) * BLOCK - cols)))
        codes.append(c[:, :cols])
        sbytes.append(s)
    return torch.cat(codes), torch.cat(sbytes)


def _fp8_row_values(codes: Tensor, sbytes: Tensor, out: Tensor | None = None) -> Tensor:
    rows, cols = codes.shape
    out = torch.empty(rows, cols, dtype=torch.float32) if out is None else out
    for lo in range(0, rows, ROW_CHUNK):
        c = F.pad(codes[lo:lo + ROW_CHUNK], (0, _ceil(cols) * BLOCK - cols))
        out[lo:lo + ROW_CHUNK] = unpack_fp8(c, sbytes[lo:lo + ROW_CHUNK])[:, :cols]
    return out


# ------------------------------------------------------------------ the public interface
def _codes(encoding: str, x: Tensor) -> tuple[Tensor, Tensor]:
    if encoding == "fp8_block":
        return _fp8_block_codes(x)
    if encoding == "fp4_expert":
        return pack_mxfp4(x.float())  # nibble-packed E2M1 [out, in/2], E8M0 [out, in/32]
    return _fp8_row_codes(x)


def _values(encoding: str, codes: Tensor, sbytes: Tensor) -> Tensor:
    if encoding == "fp8_block":
        return _fp8_block_values(codes, sbytes)
    if encoding == "fp4_expert":
        return unpack_mxfp4(codes, sbytes)
    return _fp8_row_values(codes, sbytes)


_WEIGHT_DTYPE = {"fp8_block": torch.float8_e4m3fn, "fp4_expert": torch.float4_e2m1fn_x2,
                 "fp8_row": torch.float8_e4m3fn}


def encode(encoding: str, x: Tensor) -> dict[str, Tensor]:
    """A dequantised tensor -> the stored tensors {suffix: tensor} (see `stored`)."""
    if encoding == "bf16":
        return {"": x.to(torch.bfloat16).contiguous()}
    if encoding == "fp32":
        return {"": x.to(torch.float32).contiguous()}
    codes, sbytes = _codes(encoding, x)
    codes, sbytes = _codes(encoding, _values(encoding, codes, sbytes))  # the canonical form (module doc)
    return {"": codes.view(_WEIGHT_DTYPE[encoding]), "scale": sbytes.view(torch.float8_e8m0fnu)}


def decode(encoding: str, stored_tensors: dict[str, Tensor]) -> Tensor:
    """The stored tensors {suffix: tensor} -> the dequantised fp32 tensor."""
    main = stored_tensors[""]
    if encoding in ("bf16", "fp32"):
        return main.float()
    return _values(encoding, main.view(torch.uint8), stored_tensors["scale"].view(torch.uint8))
