"""Process-group setup. DeepSpeed reads RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT even
for one process; a plain `flashtrain pretrain` fills them in for a single local process."""
from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_process_env() -> None:
    """Defaults for running as the only process (an explicit environment always wins)."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))


def select_accelerator() -> None:
    """DeepSpeed picks its accelerator at import time; without a GPU it must be told 'cpu'."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def skip_shm_comm_build() -> None:
    """DeepSpeed's torch backend compiles its shared-memory all-reduce op (which only its
    inference all-reduce uses; training collectives go through torch.distributed) on first use:
    it needs a C++ compiler, takes 40-70 s into ~/.cache/torch_extensions, and a build killed
    midway leaves a file lock on which every later run waits forever. DeepSpeed skips an op it
    holds incompatible, so mark this one so before any backend is built."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def init_distributed(timeout_s: float | None = None) -> DistInfo:
    """The process group; `timeout_s` (trainer.collective_timeout_s) bounds every collective, so a
    rank that stops responding fails the others instead of holding them (see collective_timeout)."""
    single_process_env()
    select_accelerator()
    import deepspeed

    skip_shm_comm_build()

    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        timeout = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo",
                                   auto_mpi_discovery=False, verbose=False, **timeout)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device)


_TIMEOUT_MARKS = ("Timed out waiting", "Application timeout caused pair closure",  # gloo
                  "Watchdog caught collective operation timeout")  # NCCL


def collective_timeout(error: BaseException) -> str | None:
    """One line for a collective that ran past its deadline (gloo: 'Timed out waiting ...ms for
    recv', NCCL: 'Watchdog caught collective operation timeout'), naming this rank and the
    setting; None for any other error."""
    text = str(error)
    if not isinstance(error, RuntimeError) or not any(m in text for m in _TIMEOUT_MARKS):
        return None
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    detail = next((ln.strip() for ln in text.splitlines() if any(m in ln for m in _TIMEOUT_MARKS)), text)
    detail = detail.split("] ", 1)[-1]  # drop the C++ source location
    return (f"rank {rank}: the other ranks did not answer within trainer.collective_timeout_s (a rank "
            f"stopped responding or died; its own log says which): {detail}")


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def broadcast_object(obj, src: int = 0):
    """Rank `src`'s object on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_reduce_sum_(t: torch.Tensor, group=None) -> torch.Tensor:
    """In-place sum over `group` (default: all ranks). NCCL reduces device tensors only, so a
    host tensor (loss sums, counters) makes a round trip through the current GPU."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return t
    if not t.is_cuda and dist.get_backend(group) == "nccl":
        on_device = t.cuda()
        dist.all_reduce(on_device, group=group)
        t.copy_(on_device.cpu())
    else:
        dist.all_reduce(t, group=group)
    return t
