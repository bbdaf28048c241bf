"""Test support: one-process CLI runs forked from a process that has already imported the CLI's
heavy modules, instead of started from scratch.

A training run of `python -m launch` spends about 7 s of a 2-core CI machine importing torch,
torch._dynamo (every torch optimiser's `add_param_group` imports it), datasets and DeepSpeed
before it reads its config, and the suite makes dozens of such runs. The zygote (`python -m
tests.cli_zygote SOCKET`) imports them once; each run is then a fork of it that sets the run's
argv, environment, working directory, stdout and stderr and executes `launch` as `__main__`, so
it ends like a fresh interpreter would (exit code, tracebacks, atexit handlers). A run is still
its own process with its own pid, which tests can signal as before. The ranks a launcher starts
(`launcher.nproc=2`, say) are fresh processes, as they are outside the tests.

Only for CPU-only machines: DeepSpeed's import asks CUDA whether it is there, and CUDA does not
work in a child forked after that. `FLASHTRAIN_TEST_FORK=0` turns it off.

Protocol, one connection a run: the client sends a JSON request (args, env, cwd) with two file
descriptors (the run's stdout and stderr) over the zygote's Unix socket. The zygote forks a
monitor, which forks the run, writes the run's pid as one line, waits for it, and writes its
exit code (negative for a signal, as `subprocess` reports it) as a second line.
"""
from __future__ import annotations

import atexit
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

# What a pretraining or fine-tuning run imports before it reads its config. ray and wandb stay
# out: they are imported lazily by the runs that use them and start threads of their own.
PRELOAD = ("launch.cli", "launch.stages", "hydra", "trainer.pretrain", "trainer.sft", "deepspeed",
           "torch._dynamo")
START_TIMEOUT_S = 300  # the imports take ~7 s on a 2-core machine


# ------------------------------------------------------------------------------ zygote side
def serve(path: str) -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(16)
    os.rename(path + ".tmp", path)  # the path appears only once connections are accepted
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the monitors are reaped by the kernel
    while True:
        ready, _, _ = select.select([listener, sys.stdin], [], [])
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1):
            return  # the test process closed our stdin: it is done
        if listener in ready:
            conn, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
            if os.fork() == 0:
                listener.close()
                _monitor(conn, json.loads(message), fds)  # never returns
            conn.close()
            for fd in fds:
                os.close(fd)


def _monitor(conn: socket.socket, request: dict, fds: list[int]) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # this process waits for its child
    pid = os.fork()
    if pid == 0:
        conn.close()
        _become_the_run(request, fds)
    for fd in fds:
        os.close(fd)
    conn.sendall(f"{pid}\n".encode())
    _, status = os.waitpid(pid, 0)
    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
    os._exit(0)


def _become_the_run(request: dict, fds: list[int]) -> None:
    """Turn this fork into `python -m launch <args>` and exit as that process would: its exit
    code, a traceback for an error, non-daemon threads joined and atexit handlers run. Module
    teardown is skipped (os._exit): with torch loaded it takes ~1.5 s, a fresh process's too."""
    try:
        _run(request, fds)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        getattr(threading, "_shutdown", lambda: None)()  # what interpreter shutdown does first
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(code)


def _run(request: dict, fds: list[int]) -> None:
    devnull = os.open(os.devnull, os.O_RDONLY)
    for target, fd in ((0, devnull), (1, fds[0]), (2, fds[1])):
        os.dup2(fd, target)
    for fd in {devnull, *fds}:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [sys.argv[0], *request["args"]]
    runpy.run_module("launch", run_name="__main__", alter_sys=True)


# ------------------------------------------------------------------------------ client side
class Zygote:
    """A zygote for this test process, started on first use."""

    def __init__(self, env: dict[str, str], cwd: Path, socket_dir: Path):
        self.env, self.cwd, self.path = env, cwd, str(socket_dir / "zygote.sock")
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def _start(self) -> None:
        with self._lock:
            if self._proc is None:
                self._proc = subprocess.Popen([sys.executable, "-m", "tests.cli_zygote", self.path],
                                              cwd=self.cwd, env=self.env, stdin=subprocess.PIPE,
                                              stdout=subprocess.DEVNULL)
                deadline = time.monotonic() + START_TIMEOUT_S
                while not os.path.exists(self.path):  # it appears once the zygote listens
                    if self._proc.poll() is not None or time.monotonic() > deadline:
                        self._proc.kill()
                        raise RuntimeError(f"the CLI zygote did not start (exit code {self._proc.wait()})")
                    time.sleep(0.05)

    def start_run(self, args: list[str], env: dict[str, str], cwd: Path,
                  merge_stderr: bool) -> ForkedRun:
        self._start()
        return ForkedRun(self.path, args, env, cwd, merge_stderr)

    def run(self, args: list[str], env: dict[str, str], cwd: Path,
            timeout: float | None) -> subprocess.CompletedProcess:
        """What `subprocess.run(..., capture_output=True, text=True, timeout=timeout)` returns."""
        proc = self.start_run(args, env, cwd, merge_stderr=False)
        out, err = proc.communicate(timeout)
        return subprocess.CompletedProcess(["launch", *args], proc.returncode, out, err)

    def close(self) -> None:
        if self._proc is not None:
            self._proc.stdin.close()
            self._proc.wait(timeout=30)


class ForkedRun:
    """The part of `subprocess.Popen` the tests use: pid, stdout, poll, wait, kill, returncode."""

    def __init__(self, path: str, args: list[str], env: dict[str, str], cwd: Path, merge_stderr: bool):
        out_r, out_w = os.pipe()
        err_r, err_w = (None, out_w) if merge_stderr else os.pipe()
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._conn.connect(path)
            request = json.dumps({"args": list(args), "env": env, "cwd": str(cwd)}).encode()
            socket.send_fds(self._conn, [request], [out_w, err_w])
        finally:
            os.close(out_w)
            if err_r is not None:
                os.close(err_w)
        self._lines = self._conn.makefile("r")
        self.pid = int(self._lines.readline())
        self.stdout = open(out_r, encoding="utf-8", errors="replace")
        self.stderr = open(err_r, encoding="utf-8", errors="replace") if err_r is not None else None
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._read_exit_code()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(["launch"], timeout)
            self._read_exit_code()
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def communicate(self, timeout: float | None) -> tuple[str, str]:
        """Both streams read to their end (by threads, so neither pipe fills), then the exit code."""
        streams = [self.stdout, self.stderr]
        texts = ["", ""]

        def drain(i: int) -> None:
            texts[i] = streams[i].read()

        readers = [threading.Thread(target=drain, args=(i,), daemon=True) for i in range(2)]
        for r in readers:
            r.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self.wait(timeout)
            for r in readers:  # a process the run started may still hold the pipes, as with Popen
                r.join(None if deadline is None else max(deadline - time.monotonic(), 0))
                if r.is_alive():
                    raise subprocess.TimeoutExpired(["launch"], timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.wait()
            raise
        for s in streams:
            s.close()
        return texts[0], texts[1]

    def _read_exit_code(self) -> None:
        line = self._lines.readline()
        if not line:
            raise RuntimeError(f"the CLI zygote lost run {self.pid} (its monitor exited without a code)")
        self.returncode = int(line)
        self._conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
