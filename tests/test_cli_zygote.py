"""The test suite's forked CLI runs (tests/cli_zygote.py) behave as `python -m launch` does."""
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import FAST, REPO, cli_env


@pytest.fixture
def zygote(cli_zygote):
    if cli_zygote is None:
        pytest.skip("CLI runs are not forked here (CUDA present or FLASHTRAIN_TEST_FORK=0)")
    return cli_zygote


@pytest.mark.parametrize("args", [
    ["--help"],  # usage on stdout, exit 0
    ["pretraining"],  # unknown stage: one line on stderr, exit 2
    ["pretrain", "trainer.max_stepz=3"],  # a config key error, from Hydra's composition
    ["pretrain", *FAST, "trainer.micro_batch_size=0", "hydra.run.dir=RUN"],  # from the trainer
])
def test_a_forked_run_exits_and_prints_as_a_fresh_process(zygote, port_base, tmp_path, args):
    args = [a.replace("RUN", str(tmp_path / "run")) for a in args]
    fresh = subprocess.run([sys.executable, "-m", "launch", *args], cwd=REPO, env=cli_env(port_base()),
                           capture_output=True, text=True, timeout=300)
    forked = zygote.run(args, cli_env(port_base()), REPO, timeout=300)
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert forked.stdout or forked.stderr


def test_a_forked_run_gets_its_own_environment_and_can_be_killed(zygote, port_base, tmp_path, data_cache):
    run = tmp_path / "run"
    env = {**cli_env(port_base()), "ZYGOTE_TEST_PATH": "/from/the/run/env"}  # resolved by OmegaConf
    p = zygote.run(["pretrain", "data=files", "data.path=${oc.env:ZYGOTE_TEST_PATH}", "--cfg"], env, REPO,
                   timeout=300)
    assert p.returncode == 0 and "path: /from/the/run/env" in p.stdout, (p.stdout, p.stderr)

    proc = zygote.start_run(["pretrain", *FAST, "trainer.max_steps=100000", f"hydra.run.dir={run}",
                             f"data.cache_dir={data_cache}"], cli_env(port_base()), REPO, merge_stderr=True)
    deadline = time.time() + 300
    while not (run / "metrics.jsonl").exists() and time.time() < deadline:  # it trains
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.1)
    proc.kill()
    assert proc.wait(timeout=60) == -signal.SIGKILL
    with pytest.raises(subprocess.TimeoutExpired):
        zygote.start_run(["pretrain", *FAST, "trainer.max_steps=100000", f"hydra.run.dir={tmp_path / 'slow'}",
                          f"data.cache_dir={data_cache}"], cli_env(port_base()), REPO,
                         merge_stderr=False).communicate(timeout=2)
