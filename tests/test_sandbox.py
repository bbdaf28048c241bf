"""The sandbox of model-generated code (tasks/sandbox.py): right code passes, wrong or broken code
fails cleanly, and an infinite loop, a fork bomb, a memory hog, huge output, network access and
writes outside its directory are each stopped, with this process (standing in for the trainer)
unaffected. Hostile processes are tagged by name (prctl PR_SET_NAME) so that survivors can be
looked for in /proc."""
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks import sandbox
from tasks.sandbox import isolation, network_isolation, run_python

REPO = Path(__file__).resolve().parents[1]


def tag(name: str) -> str:
    """Code that renames its process (inherited by its forks) so tests can find it in /proc."""
    return f"import ctypes\nctypes.CDLL(None).prctl(15, {name.encode()!r}, 0, 0, 0)\n"


def alive(name: str) -> list[int]:
    """Live (not zombie) processes named `name`."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "comm").read_text().strip() == name:
                if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    pids.append(int(entry.name))
        except OSError:
            pass
    return pids


def unique(prefix: str) -> str:
    return f"{prefix}{os.getpid() % 100000}"[:15]


def can_spawn() -> bool:
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    forked = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 7
    return forked and subprocess.run([sys.executable, "-c", "print(42)"], capture_output=True,
                                     text=True).stdout == "42\n"


def test_right_code_passes():
    r = run_python("def add(a, b):\n    return a + b\nprint('hi')", "assert add(2, 3) == 5")
    assert (r.passed, r.status, r.returncode) == (True, "ok", 0)
    assert r.stdout == "hi\n" and r.stderr == ""
    assert r.wall_s < 5


def test_wrong_code_fails():
    r = run_python("def add(a, b):\n    return a - b", "assert add(2, 3) == 5")
    assert (r.passed, r.status) == (False, "failed")
    assert "AssertionError" in r.stderr and "tests.py" in r.stderr
    assert "_run" not in r.stderr  # the sandbox's own frames are left out of the traceback


@pytest.mark.parametrize("source",
                         ["def add(a, b) return a", "\x00", "def f():\n\treturn 1\n        return 2",
                          "\ud800 = 1"])
def test_code_that_does_not_compile_is_an_error(source):
    r = run_python(source, "assert True")
    assert (r.passed, r.status) == (False, "error")


@pytest.mark.parametrize("source", ["import sys\nsys.exit(0)", "import os\nos._exit(0)", "raise SystemExit"])
def test_exiting_before_the_tests_end_does_not_pass(source):
    r = run_python(source, "assert False")
    assert not r.passed and r.status == "failed"


def test_infinite_loop_is_stopped():
    start = time.monotonic()
    r = run_python("while True:\n    pass", "", wall_s=4.0, cpu_s=1.0)
    assert r.status in ("cpu_limit", "timeout") and not r.passed
    assert time.monotonic() - start < 4.0 + 1.0


def test_sleeping_forever_times_out():
    start = time.monotonic()
    r = run_python("import time\ntime.sleep(600)", "", wall_s=1.0)
    assert (r.status, r.passed, r.returncode) == ("timeout", False, None)
    assert time.monotonic() - start < 1.0 + 1.0


def test_fork_bomb_is_stopped_and_leaves_nothing():
    name = unique("ftbomb")
    start = time.monotonic()
    r = run_python(tag(name) + "import os\nwhile True:\n    os.fork()", "", wall_s=5.0)
    assert not r.passed and r.status != "ok"
    assert time.monotonic() - start < 5.0 + 1.0
    assert alive(name) == []
    assert can_spawn()


def test_processes_that_leave_the_session_die_with_the_run():
    """setsid() escapes os.killpg; the PID namespace (or, without one, the subreaper) gets them."""
    name = unique("ftsetsid")
    code = tag(name) + ("import os, time\nfor _ in range(4):\n    if os.fork() == 0:\n        os.setsid()\n"
                        "        time.sleep(600)\n")
    r = run_python(code, "assert True")
    assert r.passed
    assert alive(name) == []


def test_memory_hog_is_stopped():
    r = run_python("x = bytearray(2 * 1024 ** 3)\nprint('allocated')", "", memory_mb=256)
    assert (r.status, r.passed) == ("memory", False)
    assert "allocated" not in r.stdout and "MemoryError" in r.stderr


def test_network_is_unreachable():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.setblocking(False)
        port = listener.getsockname()[1]
        code = (
            "import socket\n"
            f"for address in [('127.0.0.1', {port}), ('8.8.8.8', 53)]:\n"
            "    try:\n"
            "        socket.create_connection(address, timeout=2).close()\n"
            "        print('connected', address)\n"
            "    except OSError:\n"
            "        print('blocked', address)\n")
        r = run_python(code, "assert True", wall_s=10.0)
        assert r.passed, r.stderr
        assert r.stdout.count("blocked") == 2 and "connected" not in r.stdout
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing came through


def test_network_isolation_mode_is_reported():
    assert network_isolation() in ("netns", "python")
    assert set(isolation()) == {"network", "pid_namespace", "user_namespace", "process_limit", "filesystem",
                                "syscalls"}


def test_python_level_network_block():
    """The fallback where the kernel refuses a network namespace, run in a plain subprocess."""
    code = (
        "import socket\n"
        "from tasks.sandbox import _block_network\n"
        "_block_network()\n"
        "a, b = socket.socketpair()\n"  # wrapping existing descriptors still works
        "a.sendall(b'ok')\n"
        "assert b.recv(2) == b'ok'\n"
        "for attempt in (lambda: socket.create_connection(('127.0.0.1', 9)), lambda: socket.socket(),\n"
        "                lambda: socket.getaddrinfo('localhost', 80), lambda: "
        "__import__('_socket').socket()):\n"
        "    try:\n"
        "        attempt()\n"
        "        print('open')\n"
        "    except PermissionError:\n"
        "        print('blocked')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["blocked"] * 4


def test_fallback_without_namespaces(monkeypatch):
    """With every namespace refused: Python-level network blocking, and a fork bomb (setsid
    children included) is still stopped and cleaned up."""
    src = sandbox._boot_source()
    hook = '\nif __name__ == "__main__"'
    assert hook in src
    monkeypatch.setattr(sandbox, "_boot_source",
                        lambda: src.replace(hook, "\n_unshare = lambda: set()" + hook))
    r = run_python("import socket\ntry:\n    socket.socket()\nexcept PermissionError:\n    print('blocked')",
                   "")
    assert r.passed and r.stdout == "blocked\n"
    assert (r.isolation["network"], r.isolation["pid_namespace"]) == ("python", False)
    name = unique("ftfallbk")
    bomb = tag(name) + ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(600)\n"
                        "while True:\n    os.fork()")
    r = run_python(bomb, "", wall_s=3.0)
    assert not r.passed
    assert alive(name) == []
    assert can_spawn()


def test_huge_output_is_capped():
    start = time.monotonic()
    r = run_python("while True:\n    print('x' * 1000)", "", max_output_bytes=10_000)
    assert r.status == "output_limit" and len(r.stdout) <= 10_000
    r = run_python("import sys\nsys.stderr.write('y' * 100_000_000)", "", max_output_bytes=10_000)
    assert r.status == "output_limit" and len(r.stderr) <= 10_000
    assert time.monotonic() - start < 10


def test_temporary_directory_is_private_and_removed():
    r = run_python("import os\nopen('out.txt', 'w').write('x')\nprint(os.getcwd())", "assert True")
    assert r.passed
    cwd = Path(r.stdout.strip())
    assert cwd.name.startswith("flashtrain-sandbox-") and not cwd.exists()
    assert not Path("out.txt").exists()


def test_writes_outside_the_directory_are_denied(tmp_path):
    if isolation()["filesystem"] == "none":
        pytest.skip("no Landlock here: the code may write wherever this user may")
    target = tmp_path / "escaped.txt"
    code = (f"try:\n    open({str(target)!r}, 'w').write('x')\n    print('wrote')\n"
            "except OSError:\n    print('denied')")
    r = run_python(code, "assert True")
    assert r.stdout == "denied\n" and not target.exists()


def _landlock_or_skip():
    if isolation()["filesystem"] == "none":
        pytest.skip("no Landlock here: the code may read and write wherever this user may")


def _reads(path) -> str:
    return (f"try:\n    print(open({str(path)!r}).read()[:40])\nexcept OSError as e:\n"
            "    print('denied', type(e).__name__)")


def test_reading_a_credential_file_is_denied(tmp_path, monkeypatch):
    """A file the caller can read (a ~/.netrc stand-in outside the sandbox's directory), the
    real /etc/passwd and the caller's home directory listing are all out of reach, while the
    standard library stays importable."""
    _landlock_or_skip()
    secret = tmp_path / ".netrc"
    secret.write_text("machine api.wandb.ai login user password SECRET123\n")
    for path in (secret, "/etc/passwd"):
        r = run_python(_reads(path), "assert True")
        assert r.stdout == "denied PermissionError\n", r.stdout + r.stderr
    r = run_python(f"import os\ntry:\n    os.listdir({str(Path.home())!r})\n    print('listed')\n"
                   "except OSError:\n    print('denied')", "import json, fractions, heapq, re, decimal")
    assert r.passed and r.stdout == "denied\n", r.stdout + r.stderr
    assert "SECRET123" not in r.stdout + r.stderr


def test_the_trainers_proc_entries_are_out_of_reach():
    """/proc of the caller (its environment, command line, memory) cannot be read: the sandbox
    has its own PID namespace and Landlock gives it no /proc."""
    _landlock_or_skip()
    me = os.getpid()
    for name in ("environ", "cmdline", "mem"):
        r = run_python(_reads(f"/proc/{me}/{name}"), "assert True")
        assert r.stdout.startswith("denied"), r.stdout + r.stderr


def test_ptrace_of_the_caller_fails():
    """PTRACE_ATTACH and PTRACE_SEIZE on the caller, through libc: refused (another PID
    namespace, no capabilities)."""
    code = ("import ctypes, ctypes.util, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]\n"
            f"for request in (16, 0x4206):\n    rc = libc.ptrace(request, {os.getpid()}, None, None)\n"
            "    print(rc, ctypes.get_errno() != 0)\n")
    r = run_python(code, "assert True")
    assert r.passed and r.stdout == "-1 True\n-1 True\n", r.stdout + r.stderr


SYSCALLS = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "libc.syscall.restype = ctypes.c_long\n"
            "def call(name, *args):\n    rc = getattr(libc, name)(*args)\n"
            "    print(name, rc, os.strerror(ctypes.get_errno()) if rc < 0 else '')\n")


def test_kernel_attack_surface_is_refused_by_seccomp():
    """System calls no other layer stops: PTRACE_TRACEME (which needs no target and no
    capability), io_uring_setup, a new user namespace (unshare) and bpf fail with EPERM."""
    import ctypes.util
    if ctypes.util.find_library("seccomp") is None:
        pytest.skip("no libseccomp here")
    assert isolation()["syscalls"] == "seccomp"
    import platform
    numbers = {"x86_64": (425, 321), "aarch64": (425, 280)}.get(platform.machine())
    if numbers is None:
        pytest.skip("system call numbers of this architecture not listed")
    io_uring, bpf = numbers
    params = "(ctypes.c_char * 120)()"
    code = SYSCALLS + ("call('ptrace', 0, 0, None, None)\n"
                       f"call('syscall', {io_uring}, 8, {params})\n"
                       "call('unshare', 0x10000000)\n"
                       f"call('syscall', {bpf}, 0, {params}, 120)\n")
    r = run_python(code, "assert True")
    assert r.passed, r.stdout + r.stderr
    assert r.stdout.splitlines() == [f"{name} -1 Operation not permitted" for name in
                                     ("ptrace", "syscall", "unshare", "syscall")], r.stdout


def test_the_seccomp_filter_leaves_processes_and_threads_working():
    """fork, threads and subprocess (whose clone3 gets ENOSYS and falls back to clone) still run."""
    code = ("import os, subprocess, sys, threading\npid = os.fork()\nif pid == 0:\n    os._exit(7)\n"
            "print(os.waitpid(pid, 0)[1] >> 8)\nt = threading.Thread(target=print, args=('thread',))\n"
            "t.start(); t.join()\n"
            "print(subprocess.run([sys.executable, '-I', '-S', '-c', 'print(6 * 7)'], capture_output=True,"
            " text=True).stdout.strip())\n")
    r = run_python(code, "assert True", wall_s=20.0)
    assert r.passed and r.stdout.splitlines() == ["7", "thread", "42"], r.stdout + r.stderr


def test_filling_tmp_stops_at_the_sandbox(tmp_path):
    """Writes to the shared /tmp are refused; inside its own directory a file stops at the size
    limit (EFBIG), and the directory is removed afterwards."""
    _landlock_or_skip()
    code = ("import os\ntry:\n    open('/tmp/flashtrain-fill-' + str(os.getpid()), 'wb').write(b'x')\n"
            "    print('tmp written')\nexcept OSError:\n    print('tmp denied')\n"
            "f = open('big', 'wb')\ntry:\n    while True:\n        f.write(b'x' * (1 << 20))\n"
            "except OSError as e:\n"
            f"    print('stopped', e.errno, os.path.getsize('big') <= {sandbox.FILE_BYTES})\n")
    r = run_python(code, "assert True")
    assert r.passed and r.stdout == "tmp denied\nstopped 27 True\n", r.stdout + r.stderr
    assert not list(Path("/tmp").glob("flashtrain-fill-*"))


def test_signals_do_not_reach_the_caller():
    received = []
    previous = signal.signal(signal.SIGURG, lambda *_: received.append(1))  # harmless if it leaked
    try:
        code = ("import os, signal\n"
                "for send in (lambda: os.kill(-1, signal.SIGURG), lambda: os.killpg(0, signal.SIGURG),\n"
                f"             lambda: os.kill({os.getpid()}, signal.SIGURG)):\n"
                "    try:\n        send()\n    except OSError:\n        pass\n")
        r = run_python(code, "assert True")
        time.sleep(0.1)
    finally:
        signal.signal(signal.SIGURG, previous)
    assert r.passed and received == []


def test_killed_caller_leaves_nothing_behind(tmp_path):
    """The trainer dying mid-run closes the lifeline: the code is killed, its directory and
    cgroup removed."""
    name = unique("ftorphan")
    code = tag(name) + "import os, time\nos.fork()\ntime.sleep(600)"
    driver = ("import sys\nfrom tasks.sandbox import run_python\n"
              f"run_python({code!r}, '', wall_s=600)\n")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", driver], cwd=REPO, env={**os.environ, "TMPDIR": str(tmp)})
    try:
        deadline = time.monotonic() + 20
        while len(alive(name)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(alive(name)) == 2
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 5
    while (alive(name) or list(tmp.iterdir())) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert alive(name) == [] and list(tmp.iterdir()) == []
    base = sandbox._pids_cgroup_dir()
    if base is not None:
        assert not list(Path(base).glob(f"flashtrain-sandbox-{proc.pid}-*"))


def test_forged_control_messages_do_not_pass():
    """The code can find the control pipe (its number is in argv) but not the run's nonce."""
    code = ("import json, os, sys\nfd = json.loads(sys.argv[2])['ctl_fd']\n"
            "os.write(fd, b'[' * 60000 + b'\\n{\"end\": \"ok\", \"nonce\": \"guess\"}\\n')\nos._exit(0)")
    r = run_python(code, "assert False")
    assert (r.status, r.passed) == ("failed", False)


def test_misuse_raises():
    with pytest.raises(ValueError, match="tests do not compile"):
        run_python("x = 1", "assert (")
    with pytest.raises(ValueError, match="wall_s > 0"):
        run_python("x = 1", "", wall_s=0)
    with pytest.raises(TypeError, match="must be str"):
        run_python(None, "")


def test_oversized_source_is_not_run():
    r = run_python("x = 1\n" * 300_000, "")
    assert (r.status, r.passed) == ("error", False)
