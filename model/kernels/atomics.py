"""Relaxed fp32 reductions into global memory, four values an instruction.

Triton 3.6 lowers `tl.atomic_add` on fp32 to one `atom.global.gpu.relaxed.add.f32` per element
(sm_90 PTX), even where the addresses are contiguous. Hopper has a vector form,
`red.global.add.v4.f32` (PTX 8.1, sm_90), which adds 16 aligned bytes in one request.
`add_rows_f32` takes a [R, N] tile of pointers that is contiguous along N (each row a run of
N fp32 addresses), splits the tile into its columns 4g .. 4g + 3 element for element (a reshape
and two splits: one thread then holds all four values of a group), and issues one vector
reduction for each group whose four lanes are all enabled and whose address is 16-byte aligned.
Any other group falls back to a scalar reduction for each enabled lane, so masks and alignment
are never assumed, only the contiguity along N.
The reference is `tl.atomic_add(..., sem="relaxed")`, which `VEC = False` runs, and the
interpreter whatever VEC says (it has no PTX); the GPU tests compare the kernels that use this with
their PyTorch references.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_INTERPRET = tl.constexpr(bool(triton.knobs.runtime.interpret))
# $0: dummy result; $1: address of column 4g; $2-$5: values; $6-$9: lane enables (int32)
_RED_V4 = tl.constexpr("""{
.reg .pred rp_v, rp_0, rp_1, rp_2, rp_3;
.reg .b64 rd_a;
mov.u32 $0, 0;
and.b64 rd_a, $1, 15;
setp.eq.s64 rp_v, rd_a, 0;
setp.ne.s32 rp_0, $6, 0;
setp.ne.s32 rp_1, $7, 0;
setp.ne.s32 rp_2, $8, 0;
setp.ne.s32 rp_3, $9, 0;
and.pred rp_v, rp_v, rp_0;
and.pred rp_v, rp_v, rp_1;
and.pred rp_v, rp_v, rp_2;
and.pred rp_v, rp_v, rp_3;
@rp_v red.relaxed.gpu.global.add.v4.f32 [$1], {$2, $3, $4, $5};
not.pred rp_v, rp_v;
and.pred rp_0, rp_0, rp_v;
and.pred rp_1, rp_1, rp_v;
and.pred rp_2, rp_2, rp_v;
and.pred rp_3, rp_3, rp_v;
@rp_0 red.relaxed.gpu.global.add.f32 [$1], $2;
@rp_1 red.relaxed.gpu.global.add.f32 [$1+4], $3;
@rp_2 red.relaxed.gpu.global.add.f32 [$1+8], $4;
@rp_3 red.relaxed.gpu.global.add.f32 [$1+12], $5;
}""")


@triton.jit
def _column_quads(x, R: tl.constexpr, N: tl.constexpr):
    """x [R, N] -> its columns 4g, 4g + 1, 4g + 2, 4g + 3: four [R, N // 4] tensors."""
    even, odd = tl.split(tl.reshape(x, [R, N // 4, 2, 2]))  # [R, N // 4, 2]: columns 4g + 2i (+ 1)
    x0, x2 = tl.split(even)
    x1, x3 = tl.split(odd)
    return x0, x1, x2, x3


@triton.jit
def add_rows_f32(ptrs, vals, mask, R: tl.constexpr, N: tl.constexpr, VEC: tl.constexpr):
    """*ptrs += vals where mask, as relaxed reductions (nothing reads the target before the kernel
    ends). ptrs [R, N] fp32 pointers, contiguous along N; vals, mask [R, N]; N % 4 == 0 when VEC."""
    if VEC and not _INTERPRET:
        p0, _p1, _p2, _p3 = _column_quads(ptrs.to(tl.int64), R, N)
        v0, v1, v2, v3 = _column_quads(vals.to(tl.float32), R, N)
        m0, m1, m2, m3 = _column_quads(mask.to(tl.int32), R, N)
        tl.inline_asm_elementwise(_RED_V4, "=r,l,f,f,f,f,r,r,r,r", [p0, v0, v1, v2, v3, m0, m1, m2, m3],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.atomic_add(ptrs, vals, mask=mask, sem="relaxed")


def vector_reductions(wanted: bool, device: torch.device) -> bool:
    """VEC for a launch on `device`: the vector form needs sm_90 or newer."""
    return wanted and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
