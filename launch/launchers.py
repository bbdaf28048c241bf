"""Starting the processes of a run: local, multinode (torchrun or DeepSpeed), Slurm, Ray.

Every launcher re-invokes `python -m launch <stage> <overrides>` in each worker with the
process-group environment set (RANK, WORLD_SIZE, ...); a worker that finds WORLD_SIZE in
its environment runs the stage in-process. The run directory is pinned with
hydra.run.dir so every worker, on every node, writes to the same place.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from conf.errors import ConfigError
from conf.launcher import LauncherConfig

LAUNCHERS = ("local", "multinode", "slurm", "ray")


def worker_argv(argv: list[str], run_dir: Path) -> list[str]:
    """The stage and overrides a worker gets: the caller's, with the run dir pinned."""
    keep = [a for a in argv if not a.startswith(("hydra.run.dir=", "launcher.dry_run="))]
    return [*keep, f"hydra.run.dir={run_dir}"]


def _show(cmd: list[str] | str, what: str) -> None:
    text = cmd if isinstance(cmd, str) else shlex.join(cmd)
    print(f"flashtrain: {what}: {text}", file=sys.stderr, flush=True)


STOP_GRACE_S = 10.0


def _wait_all(procs: list[subprocess.Popen]) -> int:
    """First non-zero exit code; a rank that dies would leave the others blocked in a
    collective, so the rest are stopped."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed or all(c == 0 for c in codes):
            break
        time.sleep(0.5)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:  # a stopped or wedged rank ignores SIGTERM: SIGKILL it after a grace period
        try:
            p.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return failed[0] if failed else 0


def launch_local(cfg: LauncherConfig, argv: list[str], run_dir: Path) -> int:
    from trainer.distributed import free_port

    port = cfg.master_port or free_port()
    cmd = [sys.executable, "-m", "launch", *worker_argv(argv, run_dir)]
    _show(cmd, f"{cfg.nproc} local processes, MASTER {cfg.master_addr}:{port}, each runs")
    if cfg.dry_run:
        return 0
    procs = []
    for rank in range(cfg.nproc):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(cfg.nproc), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(cfg.nproc), MASTER_ADDR=cfg.master_addr, MASTER_PORT=str(port))
        procs.append(subprocess.Popen(cmd, env=env))
    return _wait_all(procs)


def multinode_command(cfg: LauncherConfig, argv: list[str], run_dir: Path) -> list[str]:
    if not cfg.master_port:
        raise ConfigError("launcher=multinode needs a fixed launcher.master_port shared by all nodes")
    worker = ["-m", "launch", *worker_argv(argv, run_dir)]
    if cfg.backend == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={cfg.nnodes}",
                f"--node_rank={cfg.node_rank}", f"--nproc_per_node={cfg.nproc}",
                f"--master_addr={cfg.master_addr}", f"--master_port={cfg.master_port}", *worker]
    if cfg.backend == "deepspeed":
        if not cfg.hostfile or not Path(cfg.hostfile).is_file():
            raise ConfigError(f"launcher.backend=deepspeed needs launcher.hostfile (got {cfg.hostfile!r})")
        return ["deepspeed", f"--hostfile={cfg.hostfile}", f"--num_nodes={cfg.nnodes}",
                f"--num_gpus={cfg.nproc}", f"--master_addr={cfg.master_addr}",
                f"--master_port={cfg.master_port}", "--module", *worker[1:]]
    raise ConfigError(f"launcher.backend={cfg.backend!r}: expected torchrun or deepspeed")


def launch_multinode(cfg: LauncherConfig, argv: list[str], run_dir: Path) -> int:
    cmd = multinode_command(cfg, argv, run_dir)
    _show(cmd, f"node {cfg.node_rank}/{cfg.nnodes} runs")
    return 0 if cfg.dry_run else subprocess.call(cmd)


def sbatch_script(cfg: LauncherConfig, argv: list[str], run_dir: Path) -> str:
    if not cfg.master_port:
        raise ConfigError("launcher=slurm needs a fixed launcher.master_port")
    options = [f"--job-name={cfg.job_name}", f"--nodes={cfg.nnodes}", "--ntasks-per-node=1",
               f"--cpus-per-task={cfg.cpus_per_task}", f"--time={cfg.time}",
               f"--output={run_dir}/slurm-%j.out"]
    if cfg.nproc and cfg.nproc > 0:
        options.append(f"--gpus-per-node={cfg.nproc}")
    if cfg.partition:
        options.append(f"--partition={cfg.partition}")
    if cfg.account:
        options.append(f"--account={cfg.account}")
    options += list(cfg.sbatch_extra)
    # $SLURM_* and $HEAD are expanded by the batch shell on each node
    worker = (f"{shlex.quote(sys.executable)} -m torch.distributed.run --nnodes=\"$SLURM_NNODES\" "
              f"--nproc_per_node={cfg.nproc} --rdzv_backend=c10d --rdzv_endpoint=\"$HEAD:{cfg.master_port}\" "
              f"--rdzv_id=\"$SLURM_JOB_ID\" " + shlex.join(["-m", "launch", *worker_argv(argv, run_dir)]))
    lines = ["#!/bin/bash", *(f"#SBATCH {o}" for o in options), "set -euo pipefail",
             'HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
             f"mkdir -p {shlex.quote(str(run_dir))}", f"srun {worker}", ""]
    return "\n".join(lines)


def launch_slurm(cfg: LauncherConfig, argv: list[str], run_dir: Path) -> int:
    script = sbatch_script(cfg, argv, run_dir)
    if cfg.dry_run:
        print(script, end="")
        return 0
    if shutil.which("sbatch") is None:  # before anything is written: a run dir without a job misleads
        raise ConfigError("launcher=slurm: no `sbatch` on PATH (not a Slurm login node?); "
                          "launcher.dry_run=true prints the script instead")
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "launch.sbatch"
    path.write_text(script)
    _show(["sbatch", str(path)], "submitting")
    return subprocess.call(["sbatch", str(path)])


def launch_ray(cfg: LauncherConfig, argv: list[str], run_dir: Path) -> int:
    """One Ray actor per worker; each starts the stage in a fresh process with the rank
    environment (and, with use_gpu, the GPU Ray assigned to it)."""
    cmd = [sys.executable, "-m", "launch", *worker_argv(argv, run_dir)]
    _show(cmd, f"{cfg.num_workers} Ray workers ({cfg.address or 'local cluster'}), each runs")
    if cfg.dry_run:
        return 0
    import ray  # optional dependency: only this launcher needs it

    ray.init(address=cfg.address, include_dashboard=False, log_to_driver=True)
    try:
        Worker = ray.remote(num_cpus=1, num_gpus=1 if cfg.use_gpu else 0)(_RayWorker)
        workers = [Worker.remote() for _ in range(cfg.num_workers)]
        addr, port = ray.get(workers[0].endpoint.remote())
        env = {"WORLD_SIZE": str(cfg.num_workers), "MASTER_ADDR": addr, "MASTER_PORT": str(port)}
        codes = ray.get([w.run.remote(cmd, {**env, "RANK": str(r)}) for r, w in enumerate(workers)])
    finally:
        ray.shutdown()
    bad = [c for c in codes if c != 0]
    return bad[0] if bad else 0


class _RayWorker:
    def endpoint(self) -> tuple[str, int]:
        import ray

        from trainer.distributed import free_port

        return ray.util.get_node_ip_address(), free_port()

    def run(self, cmd: list[str], env: dict[str, str]) -> int:
        # one process per actor: LOCAL_RANK 0 of the devices Ray made visible to it
        return subprocess.call(cmd, env=dict(os.environ, LOCAL_RANK="0", **env))


def launch(cfg: LauncherConfig, argv: list[str], run_dir: Path) -> int:
    if cfg.name not in LAUNCHERS:
        raise ConfigError(f"launcher.name={cfg.name!r}: expected one of {LAUNCHERS}")
    return {"local": launch_local, "multinode": launch_multinode, "slurm": launch_slurm,
            "ray": launch_ray}[cfg.name](cfg, argv, run_dir)


def check_launcher(cfg: LauncherConfig) -> None:
    """ConfigError for process counts a launch cannot start."""
    for name in ("nproc", "nnodes", "num_workers"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"launcher.{name}={getattr(cfg, name)}: must be at least 1")
    if not 0 <= cfg.node_rank < cfg.nnodes:
        raise ConfigError(f"launcher.node_rank={cfg.node_rank}: expected 0 .. launcher.nnodes-1 "
                          f"({cfg.nnodes - 1})")


def launched_world_size(cfg: LauncherConfig) -> int:
    """The processes a launch starts in all: one per worker under Ray, nproc per node otherwise."""
    return cfg.num_workers if cfg.name == "ray" else cfg.nproc * cfg.nnodes


def needs_launch(cfg: LauncherConfig) -> bool:
    """False inside a worker (the environment already names its rank) and for a plain local run."""
    if "WORLD_SIZE" in os.environ:
        return False
    return cfg.name != "local" or cfg.nproc > 1
