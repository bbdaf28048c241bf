"""The `plan` stage: which parallel layouts of a training run fit a cluster, and what one rank
holds in each (trainer/plan.py)."""
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from conf.model import ModelConfig
from conf.optim import OptimConfig


@dataclass(frozen=True)
class GPUSpec:
    memory_gib: float  # the card's total memory as torch reports it
    bf16_tflops: float  # dense bf16 tensor-core peak (datasheet)
    nvlink_gbs: float  # per GPU and direction, between GPUs of one node
    network_gbs: float  # per GPU and direction, between nodes (one 400 Gb/s NIC a GPU)
    pcie_gbs: float = 50.0  # per GPU and direction, host memory <-> GPU (PCIe Gen5 x16, ~64 GB/s peak)
    host_link_gbs: float = 20.0  # per rank, rank to rank through host memory in one node (gloo)


# memory_gib is the card's total as torch reports it (what allocations can reach, below the marketed
# size); the link rates are NVLink 4 (900 GB/s both directions) and one 400 Gb/s NIC a GPU.
GPUS = {
    "h100": GPUSpec(memory_gib=79.18, bf16_tflops=989.4, nvlink_gbs=450.0, network_gbs=50.0),
    "h200": GPUSpec(memory_gib=139.0, bf16_tflops=989.4, nvlink_gbs=450.0, network_gbs=50.0),
}


@dataclass(frozen=True)
class ActivationRates:
    """Bytes a trained token keeps alive for the backward per layer, per unit of model width (dim),
    kernels on and bf16 autocast, besides the terms computed from shapes (trainer/plan.py
    activation_bytes: the routed experts' weight copies and the LM head's loss), and the optimizer
    step's workspace. Fitted together to every measured step of bench/results/system/step-memory-*.json
    (`small` and flash-width slices; bench/reports/2026-12-07-planner-memory-refit.md): each row's peak
    phase from the constants, then least squares of the workspace over the rows that peak in the
    optimizer step and of the two rates over those that peak at the end of a forward, until the
    phases no longer change."""
    full: float = 122.6  # a block run whole
    checkpointed: float = 21.9  # a block checkpointed whole: its input, and its share of the recomputation
    # the optimizer step's own peak over the kept state, in multiples of the largest non-table
    # parameter's fp32 bytes (the vocabulary-sized embedding or head: Sinkhorn's balancing holds the
    # update, its squares and two scaled copies of the whole matrix; Muon's stacked batches are
    # bounded below that)
    optimizer_workspace: float = 4.05


@dataclass(frozen=True)
class StepRates:
    """What a step's time is built from besides the links' bandwidths, measured on one H100 and one
    H200 with kernels on (bench/system/step_memory.py at flash's and small's widths;
    bench/reports/2026-12-06-planner.md): the model's FLOPs run at a fraction of the bf16 peak,
    each layer adds a fixed cost per micro-step (the memory-bound rest and kernel launches), and
    the optimizer step costs a fixed time per element it updates."""
    compute_efficiency: float = 0.43
    layer_overhead_s: float = 0.0079
    optimizer_s_per_element: float = 0.086e-9
    # trainer.recompute_modules=[moe_act]: the bytes it does not keep (the experts' bf16 weight copies
    # and the SwiGLU output) are made again in the backward at this rate, an effective one: a cast, a
    # stacking copy and an elementwise pass read and write each such byte several times, hence well
    # under the card's copy bandwidth (fitted in bench/reports/2026-12-07-moe-act-recompute.md)
    moe_act_bytes_per_s: float = 5.17e11
    # with every block checkpointed the forward runs twice: 4/3 of the FLOPs and of the layer cost
    recompute: float = 4 / 3


@dataclass
class ClusterConfig:
    nodes: int = 1
    gpus_per_node: int = 8
    gpu: str = "h200"  # a key of GPUS
    memory_headroom_gib: float = 4.0  # kept free per GPU: the CUDA context, NCCL buffers, fragmentation


@dataclass
class PlanOptions:
    seq_len: int = 4096
    micro_batches: list[int] = field(default_factory=lambda: [1, 2, 4])
    # []: every degree that divides both the routed experts and the world size
    expert_parallel: list[int] = field(default_factory=list)
    context_parallel: list[int] = field(default_factory=lambda: [1])  # each sequence cut over this many ranks
    zero_stages: list[int] = field(default_factory=lambda: [0, 1, 2])
    # trainer.grad_accum_dtype at the composite optimizer's zero_stage=2
    grad_accum_dtypes: list[str] = field(default_factory=lambda: ["fp32", "bf16"])
    # trainer.param_dtype at the composite optimizer's zero_stage 1 and 2 (bf16: fp32 masters on owners)
    param_dtypes: list[str] = field(default_factory=lambda: ["fp32", "bf16"])
    # sequences per optimizer step over the whole cluster; 0: one micro-step per rank and step
    global_batch: int = 0
    # activation checkpointing: none | full (every block) | fewest (the fewest first blocks with which the
    # layout fits, when that is some but not all: trainer.checkpointed_layers)
    checkpointing: list[str] = field(default_factory=lambda: ["none", "fewest", "full"])
    # gpu | host (trainer.engram_tables): both by default, as the trainer runs both
    engram_tables: list[str] = field(default_factory=lambda: ["gpu", "host"])
    # trainer.recompute_modules settings: none, or moe_act (the routed experts' weight copies and SwiGLU
    # re-made in the backward of the blocks not checkpointed whole, as Megatron's --recompute-modules)
    recompute_modules: list[str] = field(default_factory=lambda: ["none", "moe_act"])
    # data.image_text_ratio > 0: the vision tower trains, with gradients and optimizer state (a text-only
    # run gives it no state, and gradient buffers only at ZeRO-2); its activations for the images are
    # not modelled
    images: bool = False
    top: int = 12  # rows of the table (feasible first)
    json: bool = False  # one JSON object instead of the table


@dataclass
class PlanConfig:
    defaults: list[Any] = field(default_factory=lambda: ["_self_", {"model": "flash"}, {"optim": "muon"}])
    stage: str = "plan"
    model: ModelConfig = MISSING
    optim: OptimConfig = MISSING
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    plan: PlanOptions = field(default_factory=PlanOptions)
