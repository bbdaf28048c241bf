"""How the processes of a run are started. Every launcher prints the exact command it runs.

  local      this machine, `nproc` processes (1: in-process)
  multinode  one invocation per node: a torchrun rendezvous (nnodes, node_rank, master
             address/port), or the DeepSpeed launcher over a hostfile
  slurm      writes an sbatch script (srun + torchrun per node) and submits it
  ray        one worker per GPU (or CPU slot) as Ray actors on a cluster
"""
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class LauncherConfig:
    name: str = "local"
    nproc: int = 1  # processes per node (GPUs per node on GPU machines)
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: a free port (local only; other launchers need a fixed one)
    dry_run: bool = False  # print what would run, run nothing
    # multinode
    backend: str = "torchrun"  # torchrun | deepspeed
    hostfile: Optional[str] = None  # deepspeed backend: "host slots=N" lines
    # slurm
    partition: Optional[str] = None
    account: Optional[str] = None
    time: str = "24:00:00"
    cpus_per_task: int = 16
    job_name: str = "flashtrain"
    sbatch_extra: list[str] = field(default_factory=list)  # extra "#SBATCH ..." option strings
    # ray
    address: Optional[str] = None  # a Ray cluster address ("auto", "ray://host:10001"); None: a local one
    num_workers: int = 1
    use_gpu: bool = False


@dataclass
class LocalLauncherConfig(LauncherConfig):
    name: str = "local"


@dataclass
class MultinodeLauncherConfig(LauncherConfig):
    name: str = "multinode"
    master_port: int = 29500


@dataclass
class SlurmLauncherConfig(LauncherConfig):
    name: str = "slurm"
    master_port: int = 29500
    nproc: int = 8


@dataclass
class RayLauncherConfig(LauncherConfig):
    name: str = "ray"
    num_workers: int = 2
