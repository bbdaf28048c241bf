"""End-to-end pretraining through the CLI: training, exact resume after SIGKILL, bad input."""
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import FAST


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows(run_dir) if "loss" in r}


@pytest.mark.slow
def test_tiny_pretraining_learns_and_writes_a_run(flashtrain, tmp_path):
    run = tmp_path / "run"
    p = flashtrain("pretrain", *FAST, f"hydra.run.dir={run}", "trainer.max_steps=30", "trainer.eval_every=10",
                   "trainer.save_every=10", "trainer.keep_last=2", "optim.lr=3e-3", "logger=wandb")
    assert p.returncode == 0, p.stderr[-3000:]
    metrics = rows(run)
    train = [r for r in metrics if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, 31))
    for key in ("loss", "lr", "tokens_per_s", "grad_norm", "mfu", "flops_per_token", "moe_max_over_mean"):
        assert all(key in r for r in train), key
    val = [r["val_loss"] for r in metrics if "val_loss" in r]
    assert len(val) == 3 and val[-1] < val[0] - 0.2, val  # 30 small steps: a clear but small drop
    first, last = [r["loss"] for r in train[:5]], [r["loss"] for r in train[-5:]]
    assert sum(last) < 0.9 * sum(first), (first, last)
    assert (run / "config.yaml").read_text().startswith("stage: pretrain")
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir()) == ["step_00000020",
                                                                                  "step_00000030"]
    assert (run / "checkpoints" / "latest").read_text() == "step_00000030"
    assert list((run / "wandb").glob("offline-run-*")), "offline W&B run missing"


def _kill_after_checkpoint(proc, ckpt_root: Path, tag: str, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    latest = ckpt_root / "latest"
    while time.time() < deadline:
        if latest.exists() and latest.read_text() == tag:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            return
        if proc.poll() is not None:
            pytest.fail(f"run ended before it could be killed:\n{proc.stdout.read()[-3000:]}")
        time.sleep(0.02)
    proc.kill()
    pytest.fail("checkpoint never appeared")


@pytest.mark.chaos
@pytest.mark.slow
@pytest.mark.parametrize("optim", ["adamw", "muon", "muon-host-tables"])
def test_exact_resume_after_sigkill(flashtrain, flashtrain_popen, tmp_path, optim):
    """2N steps straight == N steps, SIGKILL, resume to 2N: bitwise-identical losses after N.
    AdamW state lives in DeepSpeed's ZeRO-1 checkpoint; Muon + Sinkhorn + AdamW state in
    flashtrain's own per-rank files; host Engram tables (trainer.engram_tables=host) in each
    rank's shard files."""
    n = 5
    common = [*FAST, f"trainer.max_steps={2 * n}", f"trainer.save_every={n}", "trainer.eval_every=5",
              f"optim={optim.removesuffix('-host-tables')}"]
    if optim.endswith("-host-tables"):
        common.append("trainer.engram_tables=host")
    straight = tmp_path / "straight"
    p = flashtrain("pretrain", *common, f"hydra.run.dir={straight}")
    assert p.returncode == 0, p.stderr[-3000:]

    killed = tmp_path / "killed"
    proc = flashtrain_popen("pretrain", *common, f"hydra.run.dir={killed}")
    _kill_after_checkpoint(proc, killed / "checkpoints", f"step_{n:08d}")
    assert proc.returncode == -signal.SIGKILL
    p = flashtrain("pretrain", *common, f"hydra.run.dir={killed}", "trainer.resume=auto")
    assert p.returncode == 0, p.stderr[-3000:]

    a, b = train_losses(straight), train_losses(killed)
    assert sorted(b) == list(range(1, 2 * n + 1))  # rows past the checkpoint from the killed run dropped
    for step in range(n + 1, 2 * n + 1):
        assert a[step] == b[step], (step, a[step], b[step])  # bitwise: JSON floats round-trip exactly
    val_a = [r["val_loss"] for r in rows(straight) if "val_loss" in r]
    val_b = [r["val_loss"] for r in rows(killed) if "val_loss" in r]
    assert val_a == val_b


@pytest.mark.slow
def test_resume_keeps_wandb_run_id(flashtrain, tmp_path):
    run = tmp_path / "run"
    args = [*FAST, "logger=wandb", "trainer.save_every=2", f"hydra.run.dir={run}"]
    assert flashtrain("pretrain", *args, "trainer.max_steps=2").returncode == 0
    p = flashtrain("pretrain", *args, "trainer.max_steps=4")
    assert p.returncode == 0, p.stderr[-3000:]
    ids = {d.name.rsplit("-", 1)[-1] for d in (run / "wandb").glob("offline-run-*")}
    assert len(list((run / "wandb").glob("offline-run-*"))) == 2 and len(ids) == 1


# ---------------------------------------------------------------- bad input
def _one_line_error(p, *needles: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("flashtrain: error:")]
    assert len(errors) == 1, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]


@pytest.fixture(scope="module")
def run_with_checkpoint(tmp_path_factory):
    return tmp_path_factory.mktemp("precious")


def _checkpoint_files(run: Path) -> dict[str, int]:
    root = run / "checkpoints"
    return ({str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}
            if root.exists() else {})


@pytest.mark.parametrize("override, needles", [
    ("trainer.max_stepz=3", ["trainer.max_stepz"]),
    ("trainer.max_steps=abc", ["trainer.max_steps", "abc"]),
    ("model=huge", ["model/huge", "tiny"]),
    ("data.seq_len=???", ["missing required value", "data.seq_len"]),
    ("data=files", ["data.path"]),
    ("data=files data.path=/nonexistent/corpus", ["/nonexistent/corpus"]),
    ("trainer.compile=true trainer.activation_checkpointing=true",
     ["trainer.compile", "activation_checkpointing"]),
    ("trainer.checkpointed_layers=1", ["trainer.checkpointed_layers=1", "activation_checkpointing=true"]),
    ("trainer.activation_checkpointing=true trainer.checkpointed_layers=9",
     ["trainer.checkpointed_layers=9", "model's 6 layers"]),
    ("trainer.recompute_modules=[moe_act,mlp]", ["trainer.recompute_modules", "'mlp'", "moe_act"]),
    ("data.path=/elsewhere/corpus.jsonl", ["data.path", "stdlib", "data=files"]),  # was ignored
    ("trainer.micro_batch_size=0", ["trainer.micro_batch_size=0"]),  # was DeepSpeed's assertion
    ("optim.lr=-1", ["optim", "lr"]),  # was the optimiser's traceback
    ("launcher.nproc=0", ["launcher.nproc=0"]),  # was one process
    ("trainer.log_every=0", ["trainer.log_every=0"]),  # was a crash at the first step
    # was Hydra's search path too
    ("model=doesnotexist", ["model/doesnotexist", "(available: flash, small, tiny)"]),
])
def test_bad_input_one_line_and_nothing_lost(flashtrain, tmp_path, override, needles):
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step_00000001"
    ckpt.mkdir(parents=True)
    (ckpt / "weights.pt").write_bytes(b"x" * 100)  # stands for an earlier run's checkpoint
    before = _checkpoint_files(run)
    p = flashtrain("pretrain", *FAST, f"hydra.run.dir={run}", *override.split())
    _one_line_error(p, *needles)
    assert _checkpoint_files(run) == before


@pytest.mark.parametrize("stage, override", [
    ("sft", "init_from=/x"), ("long_context", "+init_from=/x"), ("pretrain", "++init_from=/x"),
    ("rl", "rl.policy=/x"), ("distill", "~rl.policy"),
])
def test_the_starting_weights_are_model_init_from_in_every_stage(flashtrain, tmp_path, stage, override):
    run = tmp_path / "run"
    p = flashtrain(stage, override, f"hydra.run.dir={run}", cache=False)
    key = override.partition("=")[0].lstrip("+~")
    _one_line_error(p, f"'{key}' is spelled model.init_from")
    assert "unknown config key" not in p.stderr and not run.exists()


def test_empty_corpus(flashtrain, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "empty.txt").write_text("")
    p = flashtrain("pretrain", *FAST, f"hydra.run.dir={tmp_path / 'run'}", "data=files",
                   f"data.path={corpus}")
    _one_line_error(p, str(corpus))


@pytest.mark.chaos
@pytest.mark.slow
def test_corrupt_latest_checkpoint_falls_back(flashtrain, tmp_path):
    run = tmp_path / "run"
    args = [*FAST, f"hydra.run.dir={run}", "trainer.save_every=2", "trainer.keep_last=5"]
    assert flashtrain("pretrain", *args, "trainer.max_steps=4").returncode == 0
    latest = run / "checkpoints" / "step_00000004"
    weights = next(latest.glob("mp_rank_*_model_states.pt"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a torn write
    p = flashtrain("pretrain", *args, "trainer.max_steps=6")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "step_00000004" in p.stderr and "unusable" in p.stderr
    assert (run / "checkpoints" / "step_00000004.corrupt").is_dir()  # kept for inspection, not deleted
    steps = [r["step"] for r in rows(run) if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]  # resumed from step 2; steps 3-4 were re-run
    assert (run / "checkpoints" / "latest").read_text() == "step_00000006"


@pytest.mark.chaos
def test_a_diverged_run_skips_nonfinite_steps_then_stops_with_one_line(flashtrain, tmp_path):
    """optim.lr=1e4 wrecks the weights in the first update, and every loss after it is NaN. Each
    such step keeps its batch but not its update, says so and writes no checkpoint; the third in a
    row stops the run with one line and exit 1, and `latest` stays at the last step that updated."""
    run = tmp_path / "run"
    p = flashtrain("pretrain", *FAST, f"hydra.run.dir={run}", "trainer.max_steps=12", "optim.lr=1e4",
                   "trainer.save_every=1", "trainer.max_nonfinite_steps=3")
    assert p.returncode == 1, (p.returncode, p.stderr[-3000:])
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("flashtrain: error:")]
    assert len(errors) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert (errors[0].startswith("flashtrain: error: step 4: loss nan")
            and "max_nonfinite_steps=3" in errors[0])
    assert [ln.split(":")[2].strip() for ln in p.stderr.splitlines() if "its update was skipped" in ln] == [
        "step 2", "step 3"]
    logged = [r for r in rows(run) if "loss" in r]
    assert [(r["step"], r["skipped_steps"]) for r in logged] == [(1, 0), (2, 1), (3, 2)]
    # finite, then NaN
    assert logged[0]["loss"] == logged[0]["loss"] and logged[1]["loss"] != logged[1]["loss"]
    assert (run / "checkpoints" / "latest").read_text() == "step_00000001"
    assert sorted(d.name for d in (run / "checkpoints").glob("step_*")) == ["step_00000001"]


@pytest.mark.slow
def test_two_process_data_parallel_matches_one_process(flashtrain, tmp_path):
    """launcher.nproc=2 with half the micro-batch each == one process with the whole batch:
    gradient all-reduce (Engram tables' sparse row gradients included), sharded Muon/Sinkhorn
    state and the owners' broadcast, global MoE load."""
    common = [*FAST, "trainer.max_steps=3", "trainer.save_every=3", "optim=muon", "trainer.zero_stage=1"]
    one = tmp_path / "one"
    p = flashtrain("pretrain", *common, f"hydra.run.dir={one}", "trainer.micro_batch_size=4")
    assert p.returncode == 0, p.stderr[-3000:]
    two = tmp_path / "two"
    p = flashtrain("pretrain", *common, f"hydra.run.dir={two}", "trainer.micro_batch_size=2",
                   "launcher.nproc=2")
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = train_losses(one), train_losses(two)
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for step in a:  # equal up to how label masking splits tokens between the two ranks
        assert abs(a[step] - b[step]) < 2e-3, (step, a[step], b[step])
    shards = sorted(p.name for p in (two / "checkpoints" / "step_00000003").glob("rank_*_state.pt"))
    assert shards == ["rank_00000_state.pt", "rank_00001_state.pt"]
    # ZeRO-2 (gradients reduced to their owners during the backward) takes the same steps
    zero2 = tmp_path / "zero2"
    p = flashtrain("pretrain", *common, f"hydra.run.dir={zero2}", "trainer.micro_batch_size=2",
                   "launcher.nproc=2", "trainer.zero_stage=2")
    assert p.returncode == 0, p.stderr[-3000:]
    c = train_losses(zero2)
    for step in b:  # the same sums in another order: fp32 rounding
        assert abs(b[step] - c[step]) < 1e-4, (step, b[step], c[step])


@pytest.mark.parametrize("field, value, needle", [
    ("micro_batch_size", 0, "at least 1"), ("grad_accum_steps", 0, "at least 1"),
    ("log_every", 0, "at least 1"),
    ("keep_last", 0, "at least 1"), ("save_every", -1, ">= 0"), ("eval_every", -1, ">= 0"),
    ("grad_clip", -0.5, ">= 0"), ("max_nonfinite_steps", -1, ">= 0"),
])
def test_trainer_counts_a_run_cannot_use_are_refused(field, value, needle):
    """keep_last=0 was read as 1 and a negative save / eval interval as 0; the others crashed."""
    from conf.errors import ConfigError
    from conf.trainer import TrainerConfig
    from trainer.engine import check_trainer_counts

    with pytest.raises(ConfigError, match=f"trainer.{field}={value}: must be {re.escape(needle)}"):
        check_trainer_counts(TrainerConfig(**{field: value}))
    check_trainer_counts(TrainerConfig(save_every=0, eval_every=0, grad_clip=0.0))  # 0: off / only at the end


@pytest.mark.chaos
def test_a_run_needs_no_compiler_and_no_lock_a_killed_build_left(data_cache, port_base, tmp_path):
    """A fresh process (no zygote), a C++ compiler that does not exist, and the lock file that a
    `kill -9` during DeepSpeed's JIT build of its shared-memory op leaves in the extensions cache:
    the run must finish, build nothing and not wait on the lock."""
    import subprocess
    import sys

    from tests.conftest import REPO, cli_env

    lock = tmp_path / "ext" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("")
    env = {**cli_env(port_base()), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"),
           "CXX": str(tmp_path / "no-c++"), "CC": str(tmp_path / "no-cc")}
    p = subprocess.run([sys.executable, "-m", "launch", "pretrain", *FAST, "trainer.max_steps=1",
                        f"data.cache_dir={data_cache}", f"hydra.run.dir={tmp_path / 'run'}"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "built successfully" not in p.stdout + p.stderr
    assert lock.exists() and sorted(p.name for p in lock.parent.iterdir()) == ["lock"]  # nothing built


def test_resume_with_another_model_config_is_one_line(flashtrain, tmp_path):
    run = tmp_path / "run"
    p = flashtrain("pretrain", *FAST, "trainer.max_steps=1", "trainer.save_every=1", f"hydra.run.dir={run}")
    assert p.returncode == 0, p.stderr[-3000:]
    before = _checkpoint_files(run)
    p = flashtrain("pretrain", *FAST, "trainer.max_steps=2", "model.moe_inter_dim=64", f"hydra.run.dir={run}")
    _one_line_error(p, "step_00000001 was written by another model config", "size mismatch")
    assert _checkpoint_files(run) == before


@pytest.mark.parametrize("stage, setting", [
    ("generate", "generate.checkpoint"), ("eval_long", "eval.checkpoint"),
    ("long_context", "model.init_from"), ("pretrain", "model.init_from"),
])
def test_a_missing_checkpoint_is_named_by_the_setting_that_gave_it(flashtrain, tmp_path, stage, setting):
    run = tmp_path / "run"
    extra = {"generate": ["model=tiny", "generate.prompt=x"], "eval_long": ["model=tiny"],
             "long_context": ["schedule=tiny", "logger=none"], "pretrain": [*FAST]}[stage]
    p = flashtrain(stage, *extra, f"{setting}={tmp_path / 'nowhere'}", f"hydra.run.dir={run}")
    _one_line_error(p, f"{setting}={tmp_path / 'nowhere'}: no such checkpoint or directory")
    assert not (tmp_path / "nowhere").exists() and not (run / "unused").exists()


@pytest.mark.slow
def test_image_text_pretraining_resumes_exactly(flashtrain, tmp_path):
    """tiny with a vision tower, half the micro-batches rendered-digit documents: 4 steps straight ==
    2 steps, then a resume to 4 (the image loader's position comes back with the checkpoint)."""
    common = [*FAST, "model.vision_n_layers=1", "data.image_text_ratio=0.5", "data.image_documents=64",
              "trainer.save_every=2"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    p = flashtrain("pretrain", *common, "trainer.max_steps=4", f"hydra.run.dir={straight}")
    assert p.returncode == 0, p.stderr[-3000:]
    assert flashtrain("pretrain", *common, "trainer.max_steps=2", f"hydra.run.dir={resumed}").returncode == 0
    p = flashtrain("pretrain", *common, "trainer.max_steps=4", f"hydra.run.dir={resumed}")
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = train_losses(straight), train_losses(resumed)
    assert a[3] == b[3] and a[4] == b[4], (a, b)
    p = flashtrain("pretrain", *FAST, "data.image_text_ratio=0.5", "trainer.max_steps=1",
                   f"hydra.run.dir={tmp_path / 'bad'}")
    assert p.returncode == 2 and "model.vision_n_layers" in p.stderr
