"""Training-loop configs: steps, batch, checkpoints, precision, metrics."""
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class TrainerConfig:
    # optimizer steps (150: the default `tiny` run, bench/reports/2026-12-06-design-history.md)
    max_steps: int = 150
    micro_batch_size: int = 8  # sequences per process per forward
    grad_accum_steps: int = 1
    grad_clip: float = 1.0  # max global grad norm (0 = off)
    log_every: int = 10  # steps between metric rows
    eval_every: int = 20  # steps between validation passes (0 = only at the end)
    eval_batches: int = 4  # validation micro-batches per pass (0 = the whole split)
    save_every: int = 50  # steps between checkpoints (0 = only at the end)
    keep_last: int = 3  # complete checkpoints kept on disk
    save_at_end: bool = True  # a final checkpoint (benchmarks turn it off)
    seed: int = 1234
    resume: str = "auto"  # auto | none | <checkpoint dir>
    # a NaN/Inf loss or gradient skips the step's update; this many in a row stop the run (0: never)
    max_nonfinite_steps: int = 10
    # a rank waiting longer on the others in a collective fails with one line
    collective_timeout_s: float = 1800.0
    # ZeRO stage: DeepSpeed's for optim=adamw; for Muon or expert parallelism (the composite optimiser)
    # 0 replicates, 1 shards the optimiser state by parameter, 2 also gradients (trainer/backward_reduce.py)
    zero_stage: int = 1
    # the composite optimiser's gradients at zero_stage=2, held and reduced: fp32 | bf16 (half the bytes)
    grad_accum_dtype: str = "fp32"
    # the composite optimiser's weights: fp32 | bf16 (replicated weights stored in bf16 on every rank, the
    # fp32 master on the owner only, as Megatron's distributed optimizer; trainer/master_weights.py)
    param_dtype: str = "fp32"
    activation_checkpointing: bool = False  # recompute each block's activations in the backward
    # with activation_checkpointing: checkpoint only the first this many blocks (None: every block), as
    # Megatron's --recompute-num-layers; `flashtrain plan` gives the fewest that fit
    checkpointed_layers: Optional[int] = None
    # selective recomputation in the blocks not checkpointed whole, as Megatron's --recompute-modules:
    # moe_act (the routed experts' SwiGLU and weight copies; their matmul outputs are kept)
    recompute_modules: list[str] = field(default_factory=list)
    compile: bool = False  # torch.compile each block's forward (trainer/parallelize.py compile_blocks)
    context_parallel: int = 1  # CP degree: each sequence cut into this many slices, one per rank
    expert_parallel: int = 1  # EP degree: experts sharded over groups of this many ranks (world = DP x EP)
    # EP: compute the shared expert while the rows travel to their experts (Megatron's
    # --moe-shared-expert-overlap); false: after the dispatch, as on one GPU
    shared_expert_overlap: bool = True
    precision: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16 | fp64 (numerical checks)
    # FP8 matmuls through torchao (trainer/fp8.py): none | tensorwise | rowwise | blockwise (1x128 / 128x128)
    fp8: str = "none"
    fp8_emulate: bool = False  # float8 numerics without float8 hardware (CPU tests; slow)
    peak_flops: Optional[float] = None  # per device, for MFU; None = from the device
    progress: bool = True  # progress bar with ETA on rank 0
    torch_threads: Optional[int] = None  # CPU intra-op threads (None = torch default)
    # a GPU run first checks its layout against the planner (trainer/plan.py) and stops, in one line,
    # when it cannot fit the card
    plan_check: bool = True
    # where the Engram tables live: gpu (parameters of the model) | host (row shards in host memory,
    # prefetched per micro-batch and updated there; trainer/engram_host.py)
    engram_tables: str = "gpu"
    # with host tables: intra-op (OpenMP) threads of each of the two threads that gather and scatter
    # their rows (0: auto, what the process's intra-op threads leave after two, halved), so their CPU
    # ops do not deschedule the threads launching the GPU's kernels (trainer/engram_host.py)
    engram_host_threads: int = 0
    # time expert all-to-alls (CUDA events) and log their share of step time (a2a_share); an exchange
    # that overlaps the shared expert counts from its start to its wait, so the share is an upper bound
    profile_comm: bool = False
