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
    """Bytes a trained token keeps alive per layer, per unit of model width (dim), kernels on and
    bf16 autocast, fitted to measured peaks of `small` (bench/reports/2026-12-06-planner.md):
    without checkpointing, the slope of the peak over micro-batches 2-8 of 4K tokens; with each
    block checkpointed, the least-squares rate over 64K- and 128K-token sequences."""
    full: float = 122.3
    checkpointed: float = 22.1
    # the optimizer step's own peak over the kept state, in multiples of the largest parameter's
    # fp32 bytes (Muon's Newton-Schulz and Sinkhorn's scaling work on whole matrices): 4.0 measured
    # at flash's width, 4.2 at small's, with the trainer's sparse Engram gradients
    optimizer_workspace: float = 4.2


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
