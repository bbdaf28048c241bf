"""How processes are started. `local` with nproc=1 runs in-process."""
from dataclasses import dataclass


@dataclass
class LauncherConfig:
    name: str = "local"
    nproc: int = 1  # processes on this machine
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: a free port on this machine


@dataclass
class LocalLauncherConfig(LauncherConfig):
    name: str = "local"
