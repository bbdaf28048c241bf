"""The encodings of the public checkpoint layout, on top of model/quant.py's quantisers.

  bf16        one bfloat16 tensor
  fp32        one float32 tensor
  fp8_block   `weight` float8_e4m3fn [out, in] + `scale` float8_e8m0fnu [ceil(out/32), ceil(in/32)]:
              one power-of-two scale per 32x32 block (docs/ARCHITECTURE.md §11 "FP8 weights")
  fp4_expert  `weight` float4_e2m1fn_x2 [out, in/2] (safetensors F4, header shape [out, in]) +
              `scale` e8m0 [out, in/32]: MXFP4 along the input dim
              (docs/ARCHITECTURE.md §11 "FP4 routed experts")
  fp8_row     `weight` e4m3 [rows, dim] + `scale` e8m0 [rows, ceil(dim/32)]: Engram table rows

Rounding is the public quantisers' (model/quant.py applies the same rules to activations): FP8
scale pow2ceil(amax/448) with amax >= 1e-4 and values clamped to +-448; MXFP4 scale
2^ceil(log2(amax/6)) with amax >= 6*2^-126; E4M3 and E2M1 round to nearest, ties to even. Partial
blocks (a dim that is not a multiple of 32) are padded with zeros, which never raise a block's amax.

Scale hints: the same values can be stored two ways. A block whose largest code is half the format's
range (E4M3 224, E2M1 3) at scale s holds exactly the values of codes twice as large at scale s/2, and
which of the two a quantiser wrote depends on the unrounded weights it saw. So quantise(dequantise(c))
is not always c, and an exported copy of imported weights would differ in bytes from its source.
`encode` therefore takes the scale bytes the weights came with (`scale_hint`): a block whose values
are exactly representable at its hinted scale is stored at that scale (the source's own codes); every
other block, trained ones included, is quantised afresh.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from model.quant import FORMATS, e2m1_encode, pack_fp8, pack_mxfp4, unpack_fp8, unpack_mxfp4

BLOCK = 32
ROW_CHUNK = 1 << 18  # rows quantised at a time: fp32 temporaries stay small for the 384M-row Engram tables
QUANTISED = ("fp8_block", "fp4_expert", "fp8_row")
ENCODINGS = ("bf16", "fp32", *QUANTISED)
# safetensors header dtype -> bytes per element (F4: two elements per byte)
HEADER_BYTES = {"F4": 0.5, "BOOL": 1.0, "U8": 1.0, "I8": 1.0, "F8_E4M3": 1.0, "F8_E5M2": 1.0, "F8_E8M0": 1.0,
                "BF16": 2.0, "F16": 2.0, "I16": 2.0, "F32": 4.0, "I32": 4.0, "F64": 8.0, "I64": 8.0}


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


def _e8m0(sbytes: Tensor) -> Tensor:
    return FORMATS["fp8"].decode_scale(sbytes)


# ------------------------------------------------------------------ FP8 32x32 blocks
def _to_blocks(x: Tensor) -> Tensor:
    """[out, in] -> [ceil(out/32), ceil(in/32), 1024] fp32, zero padded."""
    rows, cols = x.shape
    x = F.pad(x.float(), (0, _ceil(cols) * BLOCK - cols, 0, _ceil(rows) * BLOCK - rows))
    return x.view(_ceil(rows), BLOCK, _ceil(cols), BLOCK).permute(0, 2, 1, 3).reshape(
        _ceil(rows), _ceil(cols), -1)


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
    """Rows [rows, cols] (at most ROW_CHUNK: `encode` cuts a table into such pieces)."""
    cols = x.shape[1]
    codes, sbytes = pack_fp8(F.pad(x.float(), (0, _ceil(cols) * BLOCK - cols)))
    return codes[:, :cols], sbytes


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


def encode(encoding: str, x: Tensor, scale_hint: Tensor | None = None,
           float_dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """A dequantised tensor -> the stored tensors {suffix: tensor} (see `stored`). `scale_hint`: the
    scale bytes x came with (module doc); `float_dtype`: the dtype a bf16/fp32 tensor is stored in
    instead of its encoding's (the source checkpoint's own choice)."""
    if encoding in ("bf16", "fp32"):
        dtype = float_dtype or (torch.bfloat16 if encoding == "bf16" else torch.float32)
        return {"": x.to(dtype).contiguous()}
    if encoding == "fp8_row" and x.shape[0] > ROW_CHUNK:  # table rows a chunk at a time: bounded temporaries
        pieces = [encode(encoding, x[lo:lo + ROW_CHUNK],
                         None if scale_hint is None else scale_hint[lo:lo + ROW_CHUNK])
                  for lo in range(0, x.shape[0], ROW_CHUNK)]
        return {k: torch.cat([p[k] for p in pieces]) for k in pieces[0]}
    codes, sbytes = _codes(encoding, x)
    if scale_hint is not None and tuple(scale_hint.shape) == tuple(sbytes.shape):
        codes, sbytes = _prefer_hint(encoding, x, codes, sbytes, scale_hint.contiguous().view(torch.uint8))
    return {"": codes.view(_WEIGHT_DTYPE[encoding]), "scale": sbytes.view(torch.float8_e8m0fnu)}


def _codes_at(encoding: str, x: Tensor, sbytes: Tensor) -> Tensor:
    """x quantised at the given E8M0 scale bytes, in `_codes`' layout (no representability check)."""
    if encoding == "fp4_expert":  # [..., rows, cols], scales [..., rows, cols/32]
        xb = x.float().unflatten(-1, (-1, BLOCK)) / _e8m0(sbytes).unsqueeze(-1)
        nibbles = e2m1_encode(xb)
        nibbles = torch.where((xb == 0) & torch.signbit(xb), 8, nibbles).flatten(-2)  # -0 keeps its sign bit
        return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    rows, cols = x.shape
    scale = _e8m0(sbytes).repeat_interleave(BLOCK, 1)[:, :cols]
    if encoding == "fp8_block":
        scale = scale.repeat_interleave(BLOCK, 0)[:rows]
    return (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)


def _prefer_hint(encoding: str, x: Tensor, codes: Tensor, sbytes: Tensor,
                 hint: Tensor) -> tuple[Tensor, Tensor]:
    """Blocks whose values the hinted scales represent exactly take the hinted codes and scales."""
    at_hint = _codes_at(encoding, x, hint)
    inexact = _values(encoding, at_hint, hint) != x.float()
    if encoding == "fp4_expert":  # blocks of 32 along the last dim; codes are nibble pairs
        ok = ~inexact.unflatten(-1, (-1, BLOCK)).any(-1)  # [..., rows, cols/32]
        code_ok = ok.repeat_interleave(BLOCK // 2, -1)
    elif encoding == "fp8_block":  # 32x32 blocks; the zero padding is never inexact
        ok = _to_blocks(inexact.float()).amax(-1) == 0  # [ceil(rows/32), ceil(cols/32)]
        code_ok = ok.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:x.shape[0], :x.shape[1]]
    else:  # fp8_row: blocks of 32 along each row
        rows, cols = x.shape
        ok = ~F.pad(inexact, (0, _ceil(cols) * BLOCK - cols)).view(rows, -1, BLOCK).any(-1)
        code_ok = ok.repeat_interleave(BLOCK, 1)[:, :cols]
    return torch.where(code_ok, at_hint, codes), torch.where(ok, hint, sbytes)


def decode(encoding: str, stored_tensors: dict[str, Tensor]) -> Tensor:
    """The stored tensors {suffix: tensor} -> the dequantised fp32 tensor."""
    main = stored_tensors[""]
    if encoding in ("bf16", "fp32"):
        return main.float()
    return _values(encoding, main.view(torch.uint8), stored_tensors["scale"].view(torch.uint8))
