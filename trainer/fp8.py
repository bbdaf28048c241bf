"""FP8 matmuls for training (`trainer.fp8`), applied to a built model from outside through torchao.

E4M3 operands with dynamic scales, computed from each tensor as it is cast; the master weights,
the optimiser and the checkpoints stay as they are (a float8 copy exists only inside a matmul).

| recipe | dense projections (nn.Linear) | routed experts (grouped GEMMs) |
| --- | --- | --- |
| tensorwise | Float8Linear: a scale per tensor (gradients E5M2) | rowwise grouped GEMM |
| rowwise | Float8Linear: a scale per row, powers of two (all E4M3) | rowwise grouped GEMM |
| blockwise | blockwise GEMM: 1x128 activation, 128x128 weight tiles | blockwise grouped GEMM |

(all torchao; blockwise is DeepSeek-V3's recipe)

Three matmuls of the model multiply by weights no nn.Linear call sees: the shared expert's
gate|up product (w1 and w3 stacked) and the routed experts' two products (grouped, or per expert
in the loop). The model calls them through op attributes (`SharedExpert.linear`,
`RoutedExperts.linear`, `RoutedExperts.grouped_mm`), and this module swaps float8 versions in,
as model.ops.KernelPolicy swaps kernels. The parameters keep their names and classes
(Float8Linear subclasses nn.Linear), so the optimiser routing and the checkpoints do not change.

Kept in high precision (docs/DESIGN.md "FP8 matmuls" says why): the LM head, the router (an fp32
matmul), the mHC mappings (fp32), the compressor (its pooled path is fp32), the indexer's per-head
weights (`weights_proj`), the grouped output projection (`wo_a`, a batched matmul), the
embedding and Engram tables (lookups), and any projection whose dimensions the fp8 GEMMs cannot
take (multiples of 16; of 128 for blockwise).
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from conf.errors import ConfigError

RECIPES = ("none", "tensorwise", "rowwise", "blockwise")
# nn.Linear modules that stay in high precision whatever their size, by name
KEEP_HIGH_PRECISION = {r"(^|\.)head$": "LM head: the logits' precision",
                       r"\.compressor\.": "compressor: its pooled path runs in fp32",
                       r"\.weights_proj$": "indexer head weights: scale the index logits"}


@dataclass
class Fp8Conversion:
    """What `apply_fp8` did: module or op-site name -> how it computes now, or why it stayed."""
    recipe: str
    emulate: bool = False
    converted: dict[str, str] = field(default_factory=dict)
    kept: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        if self.recipe == "none":
            return "trainer.fp8: none (bf16/fp32 matmuls)"
        mode = ", emulated" if self.emulate else ""
        return (f"trainer.fp8: {self.recipe}{mode}: {len(self.converted)} matmul sites in float8, "
                f"{len(self.kept)} kept ({'; '.join(sorted(set(self.kept.values())))})")


def _torchao(recipe: str):
    try:
        import torchao  # noqa: F401
    except ImportError:
        raise ConfigError(f"trainer.fp8={recipe} needs torchao (pip install 'flashtrain[fp8]')") from None


def check_fp8(recipe: str, emulate: bool, precision: str = "auto", zero_stage: int = 0,
              device: Optional[torch.device] = None) -> None:
    """ConfigError (one line, naming the key) where trainer.fp8 cannot run as configured. Without a
    device (the CLI's check before any worker starts) only what the config alone decides."""
    if recipe not in RECIPES:
        raise ConfigError(f"trainer.fp8={recipe!r}: expected one of {', '.join(RECIPES)}")
    if recipe == "none":
        return
    if precision == "fp64":
        raise ConfigError(f"trainer.fp8={recipe} with trainer.precision=fp64: the fp64 checks need exact "
                          f"matmuls; use trainer.fp8=none")
    if zero_stage >= 3:
        raise ConfigError(f"trainer.fp8={recipe} with trainer.zero_stage=3: the float8 matmuls read whole "
                          f"weights that ZeRO-3 partitions; use stage 0-2")
    if recipe == "blockwise":
        if emulate:
            raise ConfigError("trainer.fp8=blockwise has no emulated path (torchao's blockwise kernels are "
                              "Triton/CUDA only); set trainer.fp8_emulate=false on a Hopper GPU, or use "
                              "tensorwise/rowwise emulated")
        if precision not in ("auto", "bf16"):
            raise ConfigError(f"trainer.fp8=blockwise needs trainer.precision=bf16 (got {precision}): "
                              f"torchao's blockwise GEMM writes bf16")
    if not emulate and device is not None:
        _check_device(recipe, device)
    _torchao(recipe)


def _check_device(recipe: str, device: torch.device) -> None:
    if device.type != "cuda":
        raise ConfigError(f"trainer.fp8={recipe} needs a CUDA GPU of compute capability 9.0+ (this run is on "
                          f"{device.type}); trainer.fp8_emulate=true runs it emulated (numerics only, slow)")
    cc = torch.cuda.get_device_capability(device)
    if cc < (9, 0):
        raise ConfigError(f"trainer.fp8={recipe} needs compute capability 9.0+ (the experts' fp8 grouped "
                          f"GEMM; this GPU is {cc[0]}.{cc[1]}); trainer.fp8_emulate=true runs it emulated")


# ---------------------------------------------------------------------------- the float8 ops

class Float8Matmul:
    """F.linear(x, weight) (no bias) through torchao's float8 cast-and-matmul, the autograd
    function Float8Linear.forward runs, for a weight no nn.Linear holds."""

    def __init__(self, config):
        from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args

        with torch.device("meta"):  # only for the matmul configs Float8Linear derives from `config`
            self.mm_config = Float8Linear(16, 16, bias=False, config=config).linear_mm_config
        self.config, self.matmul = config, matmul_with_hp_or_float8_args

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):  # as F.linear under autocast: compute in its dtype
            x = x.to(torch.get_autocast_dtype(x.device.type))
        return self.matmul.apply(x, weight.t(), self.mm_config, self.config)


class BlockwiseMatmul:
    """F.linear(x, weight) with torchao's blockwise float8 GEMM (1x128 activation tiles, 128x128
    weight blocks), bf16 out. Its quantisation kernels read bf16 rows: x (which autocast leaves in
    the dtype the previous op wrote) and the fp32 master weight are cast first, as autocast would
    for a bf16 matmul; bf16 rounding is far finer than E4M3's."""

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        from torchao.prototype.blockwise_fp8_training.linear import fp8_blockwise_mm

        return fp8_blockwise_mm.apply(x.to(torch.bfloat16).contiguous(), weight.to(torch.bfloat16), 128,
                                      torch.bfloat16, False)


class BlockwiseFloat8Linear(nn.Linear):
    """An nn.Linear (no bias) computed by `BlockwiseMatmul`. torchao's own Float8BlockwiseLinear
    runs the same function but takes its input as it comes, and under autocast that is fp32."""

    matmul = BlockwiseMatmul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.weight)

    @classmethod
    def from_linear(cls, module: nn.Linear) -> BlockwiseFloat8Linear:
        with torch.device("meta"):
            new = cls(module.in_features, module.out_features, bias=False)
        new.weight = module.weight  # the same Parameter: its name, optimiser state and checkpoint entry
        return new


def pad_groups(offsets: torch.Tensor, rows: int, align: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Row groups ending at `offsets` [E] (int32) moved so each starts at a multiple of `align`
    (the fp8 grouped GEMM's requirement) -> (destination row of each of the `rows` rows [rows],
    the padded groups' end offsets [E] int32, the padded row count). On the device, no host sync."""
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1)).long()
    padded = (counts + align - 1) // align * align
    padded_ends = padded.cumsum(0)
    shift = (padded_ends - padded) - (offsets.long() - counts)  # how far each group's start moves
    group = torch.repeat_interleave(torch.arange(len(counts), device=offsets.device), counts,
                                    output_size=rows)
    dest = torch.arange(rows, device=offsets.device) + shift[group]
    bound = (rows + len(counts) * align + align - 1) // align * align  # every padded layout fits
    return dest, padded_ends.to(torch.int32), bound


class Float8GroupedMM:
    """torch._grouped_mm(x [N, K], w [E, K, O] (column-major per expert), offs=[E]) in float8 with
    torchao's rowwise grouped GEMM (per-row scales of x, per-column scales of each expert's w). Its
    groups must start at multiples of 16: the rows are spread into a padded buffer first (zero
    rows; `pad_groups`) and gathered back after."""

    align = 16

    def __call__(self, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

        dest, padded_offs, padded_rows = pad_groups(offs, x.shape[0], self.align)
        spread = x.new_zeros(padded_rows, x.shape[1]).index_copy(0, dest, x)
        out = _to_fp8_rowwise_then_scaled_grouped_mm(spread, w, padded_offs, out_dtype=x.dtype,
                                                     pad_token_groups_for_grouped_mm=False)
        return out.index_select(0, dest)


class BlockwiseGroupedMM:
    """torch._grouped_mm in float8 with torchao's blockwise grouped GEMM (it pads the groups to 128
    rows itself; DeepGEMM's kernel where installed, else torchao's emulated GEMM)."""

    def __call__(self, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        from torchao.prototype.moe_training.blockwise_fp8.grouped_mm import (
            _to_fp8_blockwise_then_scaled_grouped_mm,
        )

        return _to_fp8_blockwise_then_scaled_grouped_mm(x, w, offs, out_dtype=torch.bfloat16)


# ---------------------------------------------------------------------------- apply

def linear_config(recipe: str, emulate: bool):
    """torchao's Float8LinearConfig for a tensorwise / rowwise recipe."""
    from torchao.float8 import Float8LinearConfig

    return dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)


def _why_kept(name: str, shape: tuple[int, ...], align: int) -> Optional[str]:
    for pattern, why in KEEP_HIGH_PRECISION.items():
        if re.search(pattern, name):
            return why
    if any(d % align for d in shape):
        return f"a dimension not a multiple of {align}"
    return None


def apply_fp8(model: nn.Module, recipe: str, emulate: bool = False) -> Fp8Conversion:
    """Convert `model`'s matmuls to `recipe` in place (see the module docstring); returns what was
    converted and what was kept. A ConfigError where the routed experts' widths do not fit the
    recipe's GEMM (they are most of the FLOPs: running them in bf16 silently would mislead)."""
    out = Fp8Conversion(recipe, emulate)
    if recipe == "none":
        return out
    check_fp8(recipe, emulate)
    from model.moe import RoutedExperts, SharedExpert

    align = 128 if recipe == "blockwise" else 16
    if recipe == "blockwise":
        to_float8 = BlockwiseFloat8Linear.from_linear
        matmul, grouped = BlockwiseMatmul(), BlockwiseGroupedMM()  # the experts' loop takes `matmul` too
    else:
        from torchao.float8.float8_linear import Float8Linear
        config = linear_config(recipe, emulate)
        to_float8 = lambda m: Float8Linear.from_float(m, config=config)
        # the experts: rowwise scales whatever the dense recipe (torchao's fp8 grouped GEMM is rowwise)
        matmul, expert_matmul = Float8Matmul(config), Float8Matmul(linear_config("rowwise", emulate))
        grouped = Float8GroupedMM()

    for name, module in model.named_modules():
        if isinstance(module, RoutedExperts):
            widths = (module.w1.shape[-1], module.w1.shape[-2])
            if any(d % align for d in widths):
                raise ConfigError(f"trainer.fp8={recipe}: the routed experts' widths {widths} must be "
                                  f"multiples of {align}")
            module.linear = matmul if recipe == "blockwise" else expert_matmul
            module.grouped_mm = grouped
            if emulate:  # no emulated grouped GEMM: the per-expert loop, each matmul emulated
                module.grouped = False
            out.converted[f"{name}.(w1|w3, w2)"] = f"{recipe} grouped" if recipe == "blockwise" else "rowwise"
        elif isinstance(module, SharedExpert):
            why = _why_kept(f"{name}.w1", (module.w1.in_features, module.w1.out_features), align)
            if why is None:
                module.linear = matmul
                out.converted[f"{name}.(w1|w3)"] = recipe
            else:
                out.kept[f"{name}.(w1|w3)"] = why

    def convert(m: nn.Linear, fqn: str) -> bool:
        parent = fqn.rpartition(".")[0]
        if fqn.endswith((".w1", ".w3")) and isinstance(model.get_submodule(parent), SharedExpert):
            return False  # read through SharedExpert.linear (above), never called as modules
        why = _why_kept(fqn, (m.in_features, m.out_features), align)
        if why is not None:
            out.kept[fqn] = why
            return False
        if recipe == "blockwise" and m.bias is not None:
            out.kept[fqn] = "a bias (the blockwise linear takes none)"
            return False
        out.converted[fqn] = recipe
        return True

    for fqn, module in list(model.named_modules()):
        if type(module) is nn.Linear and convert(module, fqn):
            parent, _, child = fqn.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, to_float8(module))
    return out


def float8_modules(model: nn.Module) -> list[str]:
    """Names of the modules that compute in float8 (torchao's Float8Linear, BlockwiseFloat8Linear)."""
    return [name for name, module in model.named_modules()
            if isinstance(module, BlockwiseFloat8Linear) or type(module).__module__.startswith("torchao.")]

