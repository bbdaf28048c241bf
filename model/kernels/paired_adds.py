"""Relaxed fp32 adds straight from a `tl.dot` result's MMA layout, two columns an instruction.

`tl.atomic_add` on a dot's [R, V] fp32 tile makes Triton (3.6) first move the tile from the MMA
accumulator layout to the blocked layout its coalescing pass picks for the address tensor, through
shared memory: 2 x 32 KiB per key block in the sparse attention backward's dK = dV adds, 64 KiB per
candidate tile in the indexer backward's dk adds. `red_add_pairs` issues the adds as inline PTX,
which Triton lays out like its operands, so the tile stays where the MMA left it.

Experimental and off unless FLASHTRAIN_PAIRED_ADDS=1 (read at each launch through `enabled`, so
tests and benchmarks can flip `PAIRED_ADDS`). GPU only: the interpreter cannot run PTX, so CPU tests
use the atomic adds. Compiled offline for sm_90 (Triton 3.6, ptxas): the attention backward config
`small` picks loses both layout conversions a loop; its spills go 152 / 112 -> 188 / 296 bytes.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
PAIRED_ADDS = os.environ.get("FLASHTRAIN_PAIRED_ADDS") == "1"


def enabled(width: int) -> bool:
    """Whether a kernel adding rows `width` columns wide should take `red_add_pairs` now."""
    return PAIRED_ADDS and not INTERPRET and width % 2 == 0


@triton.jit
def red_add_pairs(ptrs, vals, row_ok, col_ok):
    """Relaxed fp32 adds of vals [R, V] (V even) at ptrs where row_ok [R] and col_ok [V], in the
    layout vals has (the MMA accumulator's): one `red.global.add.v2.f32` per pair of a thread's registers. That needs each pair to be two
    adjacent columns (2j, 2j + 1) of a row, as register bit 0 of the MMA layouts is: every element
    carries its column, and a pair that is not such a pair traps (a launch error, never a wrong
    sum). The masks go in as a row part and a column part, so a thread holds one register per row
    and per column it touches instead of one per element. GPU only (inline PTX)."""
    V: tl.constexpr = vals.shape[1]
    rows = tl.broadcast_to(row_ok.to(tl.int32)[:, None], vals.shape)
    cols = tl.broadcast_to((tl.arange(0, V) * 2 + col_ok.to(tl.int32))[None, :], vals.shape)  # column, mask bit
    # pack=2: $0 $1 are the dummy outputs, then each argument's two elements in turn: addresses
    # $2 $3 (the second is not needed), values $4 $5, row masks $6 $7, column codes $8 $9
    tl.inline_asm_elementwise(
        asm="""{
        .reg .pred m, bad;
        .reg .b32 c0, c1, t;
        and.b32 t, $8, 1;
        setp.ne.b32 m, $6, 0;
        setp.ne.and.b32 m, t, 0, m;
        shr.u32 c0, $8, 1;
        shr.u32 c1, $9, 1;
        add.u32 t, c0, 1;
        setp.ne.u32 bad, c1, t;
        and.b32 t, c0, 1;
        setp.ne.or.u32 bad, t, 0, bad;
        @bad trap;
        @m red.global.gpu.relaxed.add.v2.f32 [$2], {$4, $5};
        mov.u32 $0, 0;
        mov.u32 $1, 0;
        }""",
        constraints="=r,=r,l,l,r,r,r,r,r,r",
        args=[ptrs.to(tl.int64), vals, rows, cols], dtype=tl.int32, is_pure=False, pack=2)
