"""Test session setup: offline tracking and hub access, GPU tests skipped without a GPU, and
helpers that run the CLI as a user would (a process per run)."""
import collections
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# Set before anything imports datasets/wandb (they read these once, at import).
os.environ.update(WANDB_MODE="offline", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
                  TOKENIZERS_PARALLELISM="false", WANDB_SILENT="true")

REPO = Path(__file__).resolve().parents[1]

# Under pytest-xdist (pyproject's addopts) each worker, and every CLI process it starts, gets one
# intra-op thread: two workers on two cores with torch's default of one thread per core ran the
# suite only ~10% faster than one process, with one thread each about 2x
# (bench/reports/2026-12-06-design-history.md). Set before torch is imported, as torch reads it when its
# thread pool starts.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# Without a GPU, Triton kernels run in Triton's interpreter (read when a kernel is defined, so
# before any kernel module is imported).
torch_has_cuda = __import__("torch").cuda.is_available()
if not torch_has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.interpreter_patching import skip_nested_repatching

    skip_nested_repatching()  # the interpreter's per-helper-call re-patching (see that module)

# A small, fast pretraining setup shared by the end-to-end tests.
FAST = ["model=tiny", "data.seq_len=128", "trainer.micro_batch_size=4", "trainer.log_every=1",
        "trainer.eval_every=0", "trainer.eval_batches=2", "trainer.progress=false", "logger=none",
        "optim.warmup_steps=2"]


# Seconds each test file took on a 2-core machine (setup, call and teardown of its tests), written by
# `pytest --write-file-durations=tests/file_durations.json`. Used only to order the files.
FILE_DURATIONS = REPO / "tests" / "file_durations.json"


def pytest_addoption(parser):
    parser.addoption("--write-file-durations", metavar="PATH", default=None,
                     help="write each test file's total seconds to PATH (the order the suite runs files in)")


def pytest_collection_modifyitems(config, items):
    # The longest files first, a file's tests together and in order. With `--no-loadscope-reorder`
    # xdist hands out files in this order to whichever worker is free, so the workers finish
    # together instead of one running a long file alone at the end. A file with no recorded time
    # goes first: it may be long, and a short one costs nothing there.
    if not config.option.markexpr:
        # the `extended` tier (minutes-long integration runs) runs only when a -m expression asks
        # for it (`pytest -m extended`), so the default suite keeps to its 2-core time budget
        extended = [item for item in items if "extended" in item.keywords]
        if extended:
            config.hook.pytest_deselected(items=extended)
            items[:] = [item for item in items if "extended" not in item.keywords]
    known = json.loads(FILE_DURATIONS.read_text()) if FILE_DURATIONS.exists() else {}
    rel = {item.path: item.path.relative_to(REPO).as_posix() for item in items}
    items.sort(key=lambda item: -known.get(rel[item.path], float("inf")))
    if torch_has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_file_seconds: collections.Counter = collections.Counter()


def pytest_runtest_logreport(report):
    # on the controller (or the one process): every worker's reports pass through it
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        _file_seconds[report.nodeid.split("::")[0]] += report.duration


def pytest_sessionfinish(session):
    path = session.config.getoption("--write-file-durations")
    if path and not os.environ.get("PYTEST_XDIST_WORKER"):
        Path(path).write_text(json.dumps({f: round(s, 1) for f, s in sorted(_file_seconds.items())}, indent=1)
                              + "\n")


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    """One tokenizer/packed-data cache for the whole session (built by the first run)."""
    return tmp_path_factory.mktemp("flashtrain-cache")


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray cluster for the in-process runs of a test file, started on first use: a
    cluster's start and stop cost about 4 CPU-seconds, and each test shuts down the actors its
    coordinator started, so the tests of a file can share one."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=6, include_dashboard=False, configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def port_base():
    """Distinct MASTER_PORTs per CLI run, so runs never collide."""
    # each xdist worker (gw0, gw1, ...) draws from its own block of 2500 ports, so concurrent
    # workers never collide; the pid offset keeps two concurrent sessions apart as well
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    start = 20000 + (worker % 16) * 2500 + (os.getpid() % 100) * 10
    counter = iter(range(start, start + 1500))
    return lambda: next(counter)


def cli_env(port: int, single_process: bool = True) -> dict[str, str]:
    """The environment of a CLI run: one process with its own MASTER_PORT, or (for the local
    launcher) no process-group variables at all, so the CLI starts its ranks itself."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    if single_process:
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return env


@pytest.fixture(scope="session")
def cli_zygote():
    """CLI runs fork from a process that has imported torch, DeepSpeed and datasets once (tests/cli_zygote.py:
    ~7 s less a run on a 2-core machine); None where CUDA is present (a fork cannot use CUDA after DeepSpeed's
    import probed it) or FLASHTRAIN_TEST_FORK=0."""
    if torch_has_cuda or os.environ.get("FLASHTRAIN_TEST_FORK") == "0":
        yield None
        return
    from tests.cli_zygote import Zygote

    socket_dir = Path(tempfile.mkdtemp(prefix="flashtrain-zygote-"))  # short: Unix socket paths are
    zygote = Zygote(cli_env(0, single_process=False), REPO, socket_dir)  # limited to ~100 bytes
    yield zygote
    zygote.close()
    shutil.rmtree(socket_dir, ignore_errors=True)


def run_cli(zygote, args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """`python -m launch <args>` to completion, forked from the zygote when there is one."""
    if zygote is not None:
        return zygote.run(args, env, REPO, timeout)
    return subprocess.run([sys.executable, "-m", "launch", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture
def flashtrain(data_cache, port_base, cli_zygote):
    """Run `python -m launch <args>` to completion: returns CompletedProcess (text)."""

    def run(*args: str, timeout: float = 600, cache: bool = True) -> subprocess.CompletedProcess:
        extra = [f"data.cache_dir={data_cache}"] if cache else []
        launches = any(a.startswith("launcher.nproc=") and a != "launcher.nproc=1" for a in args) or any(
            a.startswith("launcher=") and a != "launcher=local" for a in args)
        single = not launches
        return run_cli(cli_zygote, [*args, *extra], cli_env(port_base(), single_process=single), timeout)

    return run


@pytest.fixture
def flashtrain_popen(data_cache, port_base, cli_zygote):
    """Start a one-process `python -m launch <args>` (stderr into stdout): Popen-like, for tests
    that signal a run while it trains."""

    def start(*args: str):
        args = [*args, f"data.cache_dir={data_cache}"]
        if cli_zygote is not None:
            return cli_zygote.start_run(args, cli_env(port_base()), REPO, merge_stderr=True)
        return subprocess.Popen([sys.executable, "-m", "launch", *args], cwd=REPO, env=cli_env(port_base()),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    return start


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[str]:
    """A small arithmetic text corpus whose tokenizer trains in a moment: the pretraining data of the
    CLI runs that use it (a module that needs other data defines its own `corpus`)."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    for d in range(12):
        lines = [f"{a} + {b} = {a + b}. What is {a} plus {b}? The answer is {a + b}."
                 for a, b in ((rng.randint(0, 99), rng.randint(0, 99)) for _ in range(120))]
        (root / f"doc{d}.txt").write_text("\n".join(lines))
    return ["data=files", f"data.path={root}", "data.vocab_size=512", "data.val_fraction=0.1"]
