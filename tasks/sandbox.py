"""Run untrusted, model-generated Python in a sandboxed subprocess (the verifier of code tasks).

`run_python(source, tests)` runs `source`, then `tests` (asserts) in the same namespace, in a
fresh `python -I -S -B` (isolated mode, standard library only) inside a temporary directory that
is removed afterwards, and reports whether the tests ran to the end. Whatever the code does, the
call returns within about `wall_s` and does not raise; it raises only for a bad argument.

The child runs this file as its `-c` program, as three processes:
  warden      the Popen child, leader of a new session: joins a pids cgroup (as root), unshares
              network and PID namespaces (inside a user namespace unless it is root), forks the
              supervisor and passes on its status; last, it removes the cgroup, and the
              temporary directory too if the caller has gone.
  supervisor  PID 1 of the new PID namespace: forks the runner and waits for it, or for the
              caller to close the lifeline pipe (timeout, or the caller died). When it exits
              the kernel kills every process left in the namespace, so fork-bomb children die
              even if they left the session with setsid().
  runner      sets rlimits, enters a user namespace (if the warden did not), sets
              no_new_privs and Landlock, drops all capabilities, loads the seccomp filter,
              then runs the code.
The caller kills the whole process group (os.killpg) afterwards in any case. Calls from several
threads at once are fine: each run has its own directory, pipes and cgroup.

Layers, each tried at run time; `isolation()` reports which the kernel granted here:
  network     a network namespace without interfaces ("netns": nothing, not even loopback, is
              reachable). Refused: Python-level blocking ("python"): socket creation and name
              resolution raise, which code calling libc through ctypes can get around.
  processes   a pids cgroup (root: RLIMIT_NPROC does not bind root) or RLIMIT_NPROC (counted
              per user namespace, so `max_procs` is this run's own budget); threads count too.
  filesystem  Landlock (Linux >= 5.13): writes only beneath the temporary directory (and to
              /dev/null); reads only there and in the interpreter's standard library and
              installation and the system's shared libraries (`_readable_paths`: no /etc, /home,
              /root, /proc, /tmp, so no credential file and no other process's /proc); also TCP
              bind/connect (ABI 4) and signals to processes outside the sandbox (ABI 6).
  syscalls    a seccomp filter (libseccomp, where the library is installed): EPERM for
              `SECCOMP_DENIED` (ptrace and other processes' memory, bpf, perf, io_uring,
              userfaultfd, keyrings, unshare/setns, mounts, modules, clock and admin calls) and
              for clone() with a namespace flag; ENOSYS for clone3(); another ABI's calls kill.
  resources   RLIMIT_CPU (SIGXCPU at cpu_s, SIGKILL a second later), RLIMIT_AS (memory),
              RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_CORE=0; stdout and stderr are read in chunks
              and the run is killed once either passes `max_output_bytes`.
Not prevented: reading the standard library, the interpreter's base installation and the
shared libraries; filling the disk with many files under the size limit until the wall-clock
limit; the system calls the filter allows (a denylist: whatever a Python program may need stays,
so a kernel bug reachable through them is not covered), and every call without libseccomp;
without Landlock, reading and writing wherever the caller's user may;
without a PID namespace, processes that leave the session survive the run. "passed" is checked
against a per-run nonce so an early `sys.exit(0)` does not pass, but the code runs in the same
interpreter as the tests and can defeat asserts (an object whose __eq__ is always True); a
verifier that must resist that compares outputs outside the sandbox (tasks/python_code.py).
"""
from __future__ import annotations

import builtins
import ctypes
import json
import math
import os
import resource
import secrets
import select
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, NoReturn, Optional

STATUSES = ("ok", "failed", "error", "timeout", "cpu_limit", "memory", "output_limit")
BOOT_ARG = "flashtrain-sandbox"  # argv[1] of every sandbox process: how to find them in `ps`
MAX_SOURCE_BYTES = 1 << 20  # longer code is not run (status "error")
FILE_BYTES = 16 << 20  # RLIMIT_FSIZE: the largest file the code may write
OPEN_FILES = 64  # RLIMIT_NOFILE
CONTROL_BYTES = 1 << 16  # what is kept of the control pipe (the code could write to it)
DRAIN_S = 0.2  # after the warden exits, how long its pipes may stay open (a straggler holds them)
KILL_GRACE_S = 0.5  # how long the supervisor gets to clean up before its process group is killed

_CLONE = {"user": 0x10000000, "net": 0x40000000, "pid": 0x20000000}
_PR_SET_PDEATHSIG, _PR_CAPBSET_DROP, _PR_SET_CHILD_SUBREAPER, _PR_SET_NO_NEW_PRIVS = 1, 24, 36, 38
_CAP_VERSION_3 = 0x20080522
_LL_CREATE, _LL_ADD_RULE, _LL_RESTRICT = 444, 445, 446  # Landlock syscalls: same number on every arch
_LL_VERSION, _LL_PATH_BENEATH = 1, 1
_LL_WRITE_FILE, _LL_TRUNCATE, _LL_REFER = 1 << 1, 1 << 14, 1 << 13
_LL_READ_FILE, _LL_READS = 1 << 2, 1 << 2 | 1 << 3  # READ_FILE, READ_DIR
# write, rm, mk*
_LL_WRITES = 1 << 1 | 1 << 4 | 1 << 5 | 1 << 6 | 1 << 7 | 1 << 8 | 1 << 9 | 1 << 10 | 1 << 11 | 1 << 12
# System calls no other layer covers and no checked program needs, refused with EPERM by a seccomp
# filter (libseccomp): another process's memory, kernel attack surface that unprivileged code can
# reach (BPF, perf, io_uring, userfaultfd, keyrings), new namespaces, and administration calls
# (refused anyway without capabilities, so their only use here would be a kernel bug).
SECCOMP_DENIED = (
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "keyctl", "add_key", "request_key",
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "open_by_handle_at", "name_to_handle_at",
    "fsopen", "fsmount", "fsconfig", "move_mount", "open_tree", "mount_setattr",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot",
    "swapon", "swapoff", "syslog", "acct", "quotactl", "settimeofday", "clock_settime", "clock_adjtime",
    "adjtimex", "personality", "iopl", "ioperm", "uselib", "lookup_dcookie", "vhangup", "fanotify_init",
)
_SCMP_ACT_ALLOW, _SCMP_ACT_ERRNO = 0x7FFF0000, 0x00050000
_SCMP_CMP_MASKED_EQ = 7
_NAMESPACE_FLAGS = 0x7E020000  # CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET


@dataclass
class SandboxResult:
    passed: bool  # the tests ran to the end and the process exited 0
    status: str  # one of STATUSES
    returncode: Optional[int]  # the code's exit code, -N for signal N; None if it never finished
    stdout: str  # at most max_output_bytes of it
    stderr: str
    wall_s: float
    isolation: dict[str, Any] = field(default_factory=dict)  # the layers active in this run


def run_python(source: str, tests: str, *, wall_s: float = 5.0, cpu_s: float = 2.0, memory_mb: int = 256,
               max_output_bytes: int = 65536, max_procs: int = 16) -> SandboxResult:
    """Run `source` then `tests` in the sandbox. `cpu_s` is rounded up to whole seconds."""
    if not isinstance(source, str) or not isinstance(tests, str):
        raise TypeError(f"run_python: source and tests must be str, got {type(source).__name__} and "
                        f"{type(tests).__name__}")
    if not (0 < wall_s < math.inf and 0 < cpu_s < math.inf and memory_mb >= 32 and max_output_bytes >= 0
            and max_procs >= 1):
        raise ValueError("run_python: need finite wall_s > 0 and cpu_s > 0, memory_mb >= 32, "
                         f"max_output_bytes >= 0, max_procs >= 1; got {wall_s}, {cpu_s}, {memory_mb}, "
                         f"{max_output_bytes}, {max_procs}")
    try:
        compile(tests, "tests.py", "exec")
    except (SyntaxError, ValueError) as e:
        raise ValueError(f"run_python: the tests do not compile: {e}") from None
    code = source.encode("utf-8", "surrogatepass")  # lone surrogates: a syntax error in the child
    if len(code) > MAX_SOURCE_BYTES:
        return SandboxResult(False, "error", None, "", f"source is {len(code)} bytes, over the "
                             f"{MAX_SOURCE_BYTES}-byte limit; not run", 0.0)
    try:
        tmp = tempfile.mkdtemp(prefix="flashtrain-sandbox-")
    except OSError as e:  # e.g. a full disk: a failed check, not a crashed trainer
        return SandboxResult(False, "error", None, "", f"no temporary directory for the sandbox: {e}", 0.0)
    try:
        Path(tmp, "solution.py").write_bytes(code)
        Path(tmp, "tests.py").write_text(tests, encoding="utf-8")
        limits = {"cpu_s": math.ceil(cpu_s), "memory": memory_mb << 20, "max_procs": max_procs}
        return _execute(tmp, limits, wall_s, max_output_bytes)
    except OSError as e:
        return SandboxResult(False, "error", None, "", f"the sandbox could not be set up: {e}", 0.0)
    finally:
        _remove_tree(tmp)


_ISOLATION: dict[str, Any] = {}


def isolation() -> dict[str, Any]:
    """The layers the kernel grants here (probed by running empty code, until a probe answers):
    {"network": "netns" | "python", "pid_namespace": bool, "user_namespace": bool,
     "process_limit": "cgroup" | "rlimit" | "none", "filesystem": "landlock-vN" | "none",
     "syscalls": "seccomp" | "none"}."""
    if not _ISOLATION:
        _ISOLATION.update(run_python("", "", wall_s=30.0).isolation)
    return dict(_ISOLATION)


def network_isolation() -> str:
    """"netns" (a network namespace: the kernel isolates) or "python" (socket calls blocked in
    the interpreter, the fallback where user/network namespaces are refused)."""
    return isolation().get("network", "python")


# ------------------------------------------------------------------------------------- caller
def _execute(tmp: str, limits: dict, wall_s: float, cap: int) -> SandboxResult:
    start = time.monotonic()
    nonce = secrets.token_hex(16)
    fds: list[int] = []
    try:
        for _ in range(3):
            fds += os.pipe()
        os.write(fds[5], nonce.encode())
    except OSError:
        for fd in fds:
            os.close(fd)
        raise
    # ctl: JSON lines from the sandbox (isolation, the runner's end, the exit status); life: the
    # lifeline, closing our end makes the supervisor kill the code; key: the nonce, for the runner
    (ctl_r, ctl_w), (life_r, life_w), (key_r, key_w) = fds[0:2], fds[2:4], fds[4:6]
    os.close(key_w)
    cgroup = _pids_cgroup(limits["max_procs"] + 2) if os.geteuid() == 0 else None  # + warden, supervisor
    config = {**limits, "tmp": tmp, "ctl_fd": ctl_w, "life_fd": life_r, "key_fd": key_r, "cgroup": cgroup}
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8",
           "LC_ALL": "C.UTF-8"}
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-B", "-c", _boot_source(), BOOT_ARG,
                                 json.dumps(config)],
                                cwd=tmp, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, pass_fds=(ctl_w, life_r, key_r),
                                start_new_session=True)
    except OSError as e:  # e.g. no process slots left
        os.close(ctl_r)
        os.close(life_w)
        _remove_cgroup(cgroup)
        return SandboxResult(False, "error", None, "", f"the sandbox could not start: {e}",
                             time.monotonic() - start)
    finally:
        for fd in (ctl_w, life_r, key_r):
            os.close(fd)
    try:
        out, err, ctl, how = _collect(proc, ctl_r, start + wall_s, cap)
    finally:
        os.close(life_w)  # the supervisor kills the code and what it left, then exits
        _kill(proc, cgroup)
        os.close(ctl_r)
    return _result(out, err, ctl, how, nonce, limits["cpu_s"], time.monotonic() - start)


def _collect(proc: subprocess.Popen, ctl_fd: int, deadline: float,
             cap: int) -> tuple[bytes, bytes, bytes, str]:
    """Read stdout, stderr and the control pipe until they close -> (stdout, stderr, control,
    "done" | "timeout" | "output_limit"). Never holds more than `cap` bytes of either stream."""
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    bufs = {out_fd: bytearray(), err_fd: bytearray(), ctl_fd: bytearray()}
    how, exited = "done", None
    with selectors.DefaultSelector() as sel:
        for fd in bufs:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                how = "timeout"
                break
            if exited is None and _has_exited(proc.pid):
                exited = now
            elif exited is not None and now - exited > DRAIN_S:
                break
            for key, _ in sel.select(min(deadline - now, 0.05)):
                try:
                    data = os.read(key.fd, 65536)
                except OSError:
                    data = b""
                if not data:
                    sel.unregister(key.fd)
                    continue
                buf = bufs[key.fd]
                room = max(0, (CONTROL_BYTES if key.fd == ctl_fd else cap) - len(buf))
                buf += data[:room]
                if key.fd != ctl_fd and len(data) > room:
                    how = "output_limit"
            if how == "output_limit":
                break
    return bytes(bufs[out_fd]), bytes(bufs[err_fd]), bytes(bufs[ctl_fd]), how


def _has_exited(pid: int) -> bool:
    """Without reaping it, so its pid (the process group's id) cannot be reused before _kill."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill(proc: subprocess.Popen, cgroup: Optional[str]) -> None:
    """After the lifeline is closed: give the supervisor a moment to clean up, then kill the
    warden's process group whatever it did."""
    until = time.monotonic() + KILL_GRACE_S
    while not _has_exited(proc.pid) and time.monotonic() < until:
        time.sleep(0.005)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the warden is unreaped, so the group id is still ours
    except OSError:
        pass
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()
    _remove_cgroup(cgroup)


def _result(out: bytes, err: bytes, ctl: bytes, how: str, nonce: str, cpu_s: int,
            wall: float) -> SandboxResult:
    info, end, exit_msg = {}, {}, None
    for line in ctl.splitlines():
        try:
            msg = json.loads(line)
        except (ValueError, RecursionError):  # the code can write to this pipe too
            continue
        if not isinstance(msg, dict):
            continue
        if isinstance(msg.get("isolation"), dict) and not info:  # the runner's, sent before the code ran
            info = msg["isolation"]
        if "end" in msg:
            end = msg
        if isinstance(msg.get("exit"), int) and isinstance(msg.get("cpu"), (int, float)):
            exit_msg = msg  # the supervisor's comes last, after the runner is dead
    code = exit_msg["exit"] if exit_msg else None
    if how != "done":
        status = how
    elif exit_msg is None:
        status = "error"  # the sandbox itself failed; its traceback is in stderr
    elif code == -signal.SIGXCPU or (code == -signal.SIGKILL and exit_msg["cpu"] >= cpu_s):
        status = "cpu_limit"
    elif end.get("end") == "memory":
        status = "memory"
    elif end.get("end") == "ok" and end.get("nonce") == nonce and code == 0:
        status = "ok"
    elif end.get("end") == "syntax":
        status = "error"
    else:
        status = "failed"
    return SandboxResult(status == "ok", status, code, out.decode("utf-8", "replace"),
                         err.decode("utf-8", "replace"), wall, info)


@lru_cache(maxsize=1)
def _boot_source() -> str:
    """This file, run by the child as its program (read once: a file edited on disk later cannot
    mismatch the caller's side of the protocol)."""
    return Path(__file__).read_text(encoding="utf-8")


def _remove_tree(path: str) -> None:
    """Remove the temporary directory, also where the code made parts of it unwritable. Touches
    nothing outside it, and nothing if it is gone already (the warden removes it when the
    lifeline was closed)."""
    if os.path.islink(path) or not os.path.isdir(path):
        return
    try:
        os.chmod(path, 0o700)
        for parent, dirs, _ in os.walk(path):  # top-down: a directory is opened up before it is read
            for name in dirs:
                if not os.path.islink(os.path.join(parent, name)):
                    os.chmod(os.path.join(parent, name), 0o700)
    except OSError:
        pass
    shutil.rmtree(path, ignore_errors=True)


@lru_cache(maxsize=1)
def _pids_cgroup_dir() -> Optional[str]:
    """This process's cgroup directory in a hierarchy with the pids controller (v1 first)."""
    try:
        groups = [line.split(":", 2) for line in Path("/proc/self/cgroup").read_text().splitlines()]
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    for version in ("cgroup", "cgroup2"):
        path = next((g[2] for g in groups if len(g) == 3 and (
            "pids" in g[1].split(",") if version == "cgroup" else g[0] == "0")), None)
        for line in mounts if path is not None else ():
            left, _, right = line.partition(" - ")
            fields, (fstype, _, opts) = left.split(), (right.split(" ") + ["", "", ""])[:3]
            if fstype != version or (version == "cgroup" and "pids" not in opts.split(",")):
                continue
            root, mountpoint = fields[3], fields[4]
            if root == "/" or path == root or path.startswith(root + "/"):
                rel = path if root == "/" else path[len(root):]
                return os.path.join(mountpoint, rel.lstrip("/"))
    return None


def _pids_cgroup(limit: int) -> Optional[str]:
    """A fresh cgroup under ours that holds at most `limit` tasks, or None where none can be made."""
    base = _pids_cgroup_dir()
    if base is None:
        return None
    path = os.path.join(base, f"flashtrain-sandbox-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        os.mkdir(path)
    except OSError:
        return None
    try:
        Path(path, "pids.max").write_text(str(limit))  # absent on v2 without pids in subtree_control
        return path
    except OSError:
        _remove_cgroup(path)
        return None


def _remove_cgroup(path: Optional[str]) -> None:
    """Kill what is left in it (nothing, normally), then remove it, unless the warden did."""
    for _ in range(50) if path else ():
        try:
            pids = Path(path, "cgroup.procs").read_text().split()
        except FileNotFoundError:
            return
        except OSError:
            pids = []
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (OSError, ValueError):
                pass
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)


# ---------------------------------------------------------------------------------- sandbox side
def _warden(cfg: dict) -> NoReturn:
    info: dict[str, Any] = {"process_limit": "none"}
    if cfg["cgroup"]:
        try:
            Path(cfg["cgroup"], "cgroup.procs").write_text(str(os.getpid()))
            info["process_limit"] = "cgroup"
        except OSError:
            pass
    got = _unshare()
    info.update(network="netns" if "net" in got else "python", pid_namespace="pid" in got,
                user_namespace="user" in got)
    if info["process_limit"] == "none" and os.geteuid() != 0:
        # a user namespace counts its own processes; otherwise the user's others count too
        n = cfg["max_procs"] + 2 + (0 if "user" in got else _count_processes(os.getuid()))
        resource.setrlimit(resource.RLIMIT_NPROC, (n, n))
        info["process_limit"] = "rlimit"
    if "pid" not in got:
        _supervise(cfg, info, warden=True)
    supervisor = os.fork()
    if supervisor == 0:
        _supervise(cfg, info, warden=False)
    code = os.waitstatus_to_exitcode(os.waitpid(supervisor, 0)[1])
    _leave(cfg)
    os._exit(code if code >= 0 else 128 - code)


def _leave(cfg: dict) -> None:
    """The warden's last act, so that nothing is left behind even if the caller died: leave the
    cgroup and remove it (everything else in it is dead by now), and remove the temporary
    directory if the caller closed the lifeline (it timed out or died; if it lives, it removes
    the directory too)."""
    if cfg["cgroup"]:
        try:
            Path(os.path.dirname(cfg["cgroup"]), "cgroup.procs").write_text(str(os.getpid()))
            os.rmdir(cfg["cgroup"])
        except OSError:
            pass
    if select.select([cfg["life_fd"]], [], [], 0)[0]:
        shutil.rmtree(cfg["tmp"], ignore_errors=True)


def _unshare() -> set[str]:
    """The namespaces the warden got, best first. Unprivileged, network and PID namespaces need
    a user namespace; root makes them without one, so that the warden keeps the capabilities to
    remove its cgroup (the runner enters a user namespace of its own and drops them all)."""
    tries = [("user", "net", "pid"), ("user", "pid"), ("user", "net")]
    if os.geteuid() == 0:
        tries = [("net", "pid"), ("pid",), ("net",), *tries]
    for names in tries:
        if _unshare_flags(sum(_CLONE[n] for n in names)):
            return set(names)
    return set()


def _unshare_flags(flags: int) -> bool:
    try:
        if hasattr(os, "unshare"):  # Python >= 3.12
            os.unshare(flags)
            return True
        return _libc().unshare(ctypes.c_int(flags)) == 0
    except OSError:
        return False


def _count_processes(uid: int) -> int:
    count = 0
    for entry in os.scandir("/proc"):
        try:
            if entry.name.isdigit() and entry.stat().st_uid == uid:
                count += 1
        except OSError:
            pass
    return count


def _supervise(cfg: dict, info: dict, warden: bool) -> NoReturn:
    if info["pid_namespace"]:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # the warden killed: this namespace goes with it
    else:
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)  # what the code leaves behind is re-parented to us
    runner = os.fork()
    if runner == 0:
        _run(cfg, info)
    status, usage = _await(runner, cfg["life_fd"])
    code = os.waitstatus_to_exitcode(status)
    if not info["pid_namespace"]:
        _kill_orphans()
    _send(cfg["ctl_fd"], {"exit": code, "cpu": usage.ru_utime + usage.ru_stime})
    if warden:
        _leave(cfg)
    os._exit(code if code >= 0 else 128 - code)


def _kill_orphans() -> None:
    """Without a PID namespace: kill our children (the code's processes, re-parented to this
    subreaper, even those that left the session) until none are left. An unreaped child's pid
    cannot be reused, so no other process is hit."""
    children = Path(f"/proc/self/task/{os.getpid()}/children")
    for _ in range(10_000):
        try:
            pids = [int(p) for p in children.read_text().split()]
        except OSError:
            return
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except OSError:
                pass


def _await(pid: int, life_fd: int) -> tuple[int, Any]:
    """Wait for the runner, killing it if the caller closes the lifeline -> (status, rusage)."""
    try:
        pidfd: Optional[int] = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None
    while True:
        watch = [life_fd] if pidfd is None else [life_fd, pidfd]
        if life_fd in select.select(watch, [], [], 0.05 if pidfd is None else None)[0]:
            os.kill(pid, signal.SIGKILL)
            _, status, usage = os.wait4(pid, 0)
            return status, usage
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            return status, usage


def _run(cfg: dict, info: dict) -> NoReturn:
    ctl = cfg["ctl_fd"]
    os.close(cfg["life_fd"])
    nonce = os.read(cfg["key_fd"], 64).decode()
    os.close(cfg["key_fd"])
    source, tests = Path("solution.py").read_bytes(), Path("tests.py").read_bytes()
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    _set_limits(cfg)
    if not info["user_namespace"]:  # capabilities, if any, then only count inside it
        info["user_namespace"] = _unshare_flags(_CLONE["user"])
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)  # no setuid gains; lets an unprivileged process use Landlock
    abi = _landlock(os.getcwd())
    info["filesystem"] = f"landlock-v{abi}" if abi else "none"
    _drop_capabilities()
    if info["network"] != "netns":
        _block_network()
    info["syscalls"] = "seccomp" if _seccomp() else "none"
    _send(ctl, {"isolation": info})
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past RLIMIT_FSIZE a write fails (EFBIG), not the process
    end, exit_code = "exception", 1
    try:
        try:
            code = compile(source, "solution.py", "exec"), compile(tests, "tests.py", "exec")
        except (SyntaxError, ValueError):
            end = "syntax"
            raise
        scope = {"__name__": "__main__", "__builtins__": builtins}
        exec(code[0], scope)
        exec(code[1], scope)
        end, exit_code = "ok", 0
    except SystemExit as e:  # an exit before the tests finished never counts as passing
        end = "exit"
        exit_code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except BaseException as e:
        if _from_memory_error(e):
            end = "memory"
        try:  # the code's frames only, not this function's
            traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        except BaseException:
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    _send(ctl, {"end": end, "nonce": nonce} if end == "ok" else {"end": end})
    os._exit(exit_code & 0xFF)


def _from_memory_error(e: Optional[BaseException]) -> bool:
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, MemoryError):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def _set_limits(cfg: dict) -> None:
    for res, soft, hard in ((resource.RLIMIT_CPU, cfg["cpu_s"], cfg["cpu_s"] + 1),
                            (resource.RLIMIT_AS, cfg["memory"], cfg["memory"]),
                            (resource.RLIMIT_FSIZE, FILE_BYTES, FILE_BYTES),
                            (resource.RLIMIT_NOFILE, OPEN_FILES, OPEN_FILES),
                            (resource.RLIMIT_CORE, 0, 0)):
        current = resource.getrlimit(res)[1]
        if current != resource.RLIM_INFINITY:  # never above what we were given
            soft, hard = min(soft, current), min(hard, current)
        resource.setrlimit(res, (soft, hard))


def _landlock(writable: str) -> int:
    """Allow writes only beneath `writable` and to /dev/null, reads only beneath `writable` and
    what the interpreter needs (`_readable_paths`), plus no TCP, no signals out of the sandbox
    (where the ABI has them) -> the Landlock ABI applied, 0 where there is none."""
    syscall = _libc().syscall
    syscall.restype = ctypes.c_long
    abi = syscall(ctypes.c_long(_LL_CREATE), None, ctypes.c_long(0), ctypes.c_long(_LL_VERSION))
    if abi < 1:
        return 0
    writes = _LL_WRITES | (_LL_REFER if abi >= 2 else 0) | (_LL_TRUNCATE if abi >= 3 else 0)
    net = 0b11 if abi >= 4 else 0  # BIND_TCP | CONNECT_TCP, with no port allowed
    scoped = 0b11 if abi >= 6 else 0  # abstract unix sockets, signals
    attr = (ctypes.c_uint64 * 3)(writes | _LL_READS, net, scoped)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    ruleset = syscall(ctypes.c_long(_LL_CREATE), ctypes.byref(attr), ctypes.c_long(size), ctypes.c_long(0))
    if ruleset < 0:
        return 0
    rules = [(writable, writes | _LL_READS),
             ("/dev/null", _LL_WRITE_FILE | _LL_READ_FILE | (_LL_TRUNCATE if abi >= 3 else 0))]
    rules += [(path, _LL_READS if os.path.isdir(path) else _LL_READ_FILE) for path in _readable_paths()]
    try:
        for path, access in rules:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = ctypes.create_string_buffer(struct.pack("=Qi", access, fd), 12)
                if syscall(ctypes.c_long(_LL_ADD_RULE), ctypes.c_long(ruleset),
                           ctypes.c_long(_LL_PATH_BENEATH), rule, ctypes.c_long(0)) != 0:
                    return 0
            finally:
                os.close(fd)
        return (abi if syscall(ctypes.c_long(_LL_RESTRICT), ctypes.c_long(ruleset), ctypes.c_long(0)) == 0
                else 0)
    finally:
        os.close(ruleset)


def _readable_paths() -> list[str]:
    """What the code may read besides its own directory: the standard library it can import
    (`python -I -S` puts nothing else on sys.path), the interpreter's installation (libpython),
    the system's shared-library directories and the dynamic linker's cache (extension modules
    load their libraries by name). Not /etc, /home, /root, /proc or /tmp: no credentials, no
    other process's state, no other run's files."""
    paths = {*sys.path, sys.base_prefix, sys.base_exec_prefix,
             os.path.dirname(os.path.realpath(sys.executable)),
             "/usr/lib", "/usr/lib64", "/lib", "/lib64", "/usr/local/lib", "/etc/ld.so.cache"}
    return sorted(p for p in paths if p and os.path.isabs(p) and os.path.exists(p))


class _ArgCmp(ctypes.Structure):  # libseccomp's struct scmp_arg_cmp
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


def _seccomp() -> bool:
    """A filter through libseccomp that fails `SECCOMP_DENIED` and clone() with a namespace flag
    with EPERM, and clone3() with ENOSYS (its flags sit in memory, where a filter cannot look;
    libc then falls back to clone). System calls of another ABI than the interpreter's (32-bit
    ones on x86-64) kill the process: libseccomp's default. -> whether the filter is in place
    (False without libseccomp; every other layer stays)."""
    import ctypes.util

    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError:
        return False
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_ArgCmp)]
    lib.seccomp_load.argtypes = lib.seccomp_release.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(_SCMP_ACT_ALLOW)
    if not ctx:
        return False
    try:
        def deny(call: str, errno: int, *conditions: _ArgCmp) -> bool:
            nr = lib.seccomp_syscall_resolve_name(call.encode())
            if nr < 0:  # not a system call on this architecture
                return True
            args = (_ArgCmp * len(conditions))(*conditions) if conditions else None
            return lib.seccomp_rule_add_array(ctx, _SCMP_ACT_ERRNO | errno, nr, len(conditions), args) == 0

        ok = all(deny(call, 1) for call in SECCOMP_DENIED)  # EPERM
        # clone's flags are its first argument on x86-64 and arm64; MASKED_EQ(mask, value) tests
        # (flags & mask) == value, so "any namespace flag set" takes one rule per flag
        namespace_bits = [1 << i for i in range(32) if _NAMESPACE_FLAGS >> i & 1]
        ok = ok and all(deny("clone", 1, _ArgCmp(0, _SCMP_CMP_MASKED_EQ, bit, bit)) for bit in namespace_bits)
        ok = ok and deny("clone3", 38)  # ENOSYS
        return ok and lib.seccomp_load(ctx) == 0
    finally:
        lib.seccomp_release(ctx)


def _drop_capabilities() -> None:
    """Empty bounding, effective, permitted and inheritable sets: code running as root (or as root
    of its user namespace) cannot raise its rlimits, mount, or regain them through exec."""
    libc = _libc()
    for cap in range(64):
        _prctl(_PR_CAPBSET_DROP, cap)
    header = (ctypes.c_uint32 * 2)(_CAP_VERSION_3, 0)
    libc.capset(header, (ctypes.c_uint32 * 6)())


def _block_network() -> None:
    """The fallback without a network namespace: creating sockets (other than wrapping an
    existing descriptor, which socketpair does) and resolving names raise PermissionError."""
    import _socket
    import socket

    def refuse(*_args, **_kwargs):
        raise PermissionError("network access is disabled in the sandbox")

    class Socket(socket.socket):
        def __init__(self, family=-1, type=-1, proto=-1, fileno=None):
            if fileno is None:
                refuse()
            super().__init__(family, type, proto, fileno)

    raw = _socket.socket  # socket.socket.__init__ calls `_socket.socket.__init__`, looked up at call time

    class RawSocket(raw):
        def __init__(self, family=-1, type=-1, proto=-1, fileno=None):
            if fileno is None:
                refuse()
            raw.__init__(self, family, type, proto, fileno)

    socket.socket = socket.SocketType = Socket
    _socket.socket = _socket.SocketType = RawSocket
    for module in (socket, _socket):
        for name in ("create_connection", "create_server", "getaddrinfo", "gethostbyname", "gethostbyname_ex",
                     "gethostbyaddr", "getnameinfo"):
            if hasattr(module, name):
                setattr(module, name, refuse)


def _send(fd: int, message: dict) -> None:
    try:
        os.write(fd, (json.dumps(message) + "\n").encode())  # one write under PIPE_BUF: atomic
    except OSError:
        pass


@lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, value: int) -> int:
    return _libc().prctl(ctypes.c_int(option), ctypes.c_ulong(value), ctypes.c_ulong(0), ctypes.c_ulong(0),
                         ctypes.c_ulong(0))


if __name__ == "__main__" and sys.argv[1:2] == [BOOT_ARG]:
    _warden(json.loads(sys.argv[2]))
