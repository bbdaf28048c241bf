"""kill -9 of a training run at given moments, then a rerun: does every rerun finish, with the
weights of an uninterrupted run (RL and distillation: every prompt trained once) and every metrics
row exactly once?

    python -m bench.system.chaos_kill [--stage pretrain|default|sft|long_context|rl|distill]
        [--kill-at 1,3,5,10] [--random 4] [--seed 0] [--steps 20] [--out FILE]

Each trial is a first run on a fresh machine: its own run dir and its own empty data cache, so
an early kill lands in the setup (tokenizer training, data packing, the engine's build) and a
later one in training or a checkpoint write (one every 2 steps, so that kills often land in
one). Only the `flashtrain` process is killed, as a user's
`kill -9 <pid>` does; whatever it leaves behind (locks, temp dirs, partial checkpoints) stays for
the rerun to cope with. The rerun is the same command (trainer.resume=auto) and must finish
within --deadline seconds. Compared with one uninterrupted run of the same command:
  bit_exact   every tensor of the final checkpoint's model states equal, bit for bit
  lost / duplicated   training rows of the uninterrupted run's metrics.jsonl missing from, or
                      repeated in, the rerun's (every step, or every trainer.log_every-th)
Besides --kill-at, --random more moments are drawn (seeded) between 0 and the uninterrupted run's
duration. --stage sft kills fine-tuning runs that start from one pretraining checkpoint (made
first), so a step lost or repeated would be a batch of prompts lost or trained twice; --stage
default kills the Quickstart's own `flashtrain pretrain`; --stage long_context a two-sub-stage
schedule (5 steps at 128 tokens, indexer warm-up, then 5 sparse at 256), compared per sub-stage.
--stage rl and --stage distill (Ray: rollout, reward, trainer and teacher actors, started by the
killed process) start from the same kind of pretraining checkpoint (distillation: also the teacher
of its two domains) and run asynchronously, so which prompts a version trains depends on timing and
the weights are not compared. Instead:
  lost        a prompt below the final checkpoint's data cursor that no metrics row trained and
              that is not waiting in its requeue, or a version with no training row
  duplicated  a prompt in two training rows, or trained and still requeued, or a version twice
Prints one JSON object; --out writes it too.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench import provenance

REPO = Path(__file__).resolve().parents[2]


DEFAULT_STEPS = 150  # `flashtrain pretrain` as the README's Quickstart runs it (conf/trainer.py)


STAGES = ("pretrain", "default", "sft", "long_context", "rl", "distill")
FROM_A_CHECKPOINT = ("sft", "rl", "distill")  # start from a pretraining checkpoint made once
RAY_STAGES = ("rl", "distill")
# two sub-stages of 5 steps each, as tests/test_long_context.py's resume test
SCHEDULE = ("schedule.stages=[{name:warm,seq_len:128,tokens:2560,micro_batch_size:4,lr:0.01,"
            "indexer:dense_warmup},{name:sparse,seq_len:256,tokens:5120,micro_batch_size:4,lr:0.003}]")


def command(stage: str, run_dir: Path, cache: Path, steps: int, init: Path | None = None) -> list[str]:
    """The run a trial kills. stage: pretrain (short, a checkpoint every 2 steps), default (the
    Quickstart's `flashtrain pretrain`, every setting at its default), sft (from `init`'s
    checkpoints, on the built-in problems, a checkpoint every 2 steps), long_context (SCHEDULE, a
    checkpoint every 2 steps), rl or distill (from `init`, `steps` versions, a checkpoint every 2,
    one actor of each role on a 3-CPU local Ray cluster, plus a teacher worker)."""
    where = [f"data.cache_dir={cache}", f"hydra.run.dir={run_dir}"]
    launch = [sys.executable, "-m", "launch"]
    if stage == "default":
        return [*launch, "pretrain", *where]
    quiet = ["trainer.log_every=1", "trainer.progress=false", "logger=none", *where]
    if stage in RAY_STAGES:
        ray = [f"model.init_from={init}", f"rl.steps={steps}", "rl.save_every=2", "rl.eval_every=0",
               "rl.prompts_per_step=4", "rl.group_size=2", "rl.max_new_tokens=8", "rl.prompts_per_request=2",
               "rl.rollout_workers=1", "rl.reward_workers=1", f"rl.ray_num_cpus={3 if stage == 'rl' else 4}",
               "rl.timeout_s=120", "trainer.torch_threads=1", *quiet]
        if stage == "rl":
            return [*launch, "rl", "rl.eval_prompts=1", *ray]
        return [*launch, "distill", "distill.only=[reverse,upper]",
                f"distill.domains.reverse.checkpoint={init}", f"distill.domains.upper.checkpoint={init}",
                "distill.teacher_workers=1", "distill.eval_prompts=1", "distill.domain_block=2",
                "distill.teacher_batch=4", *ray]
    common = ["model=tiny", "trainer.micro_batch_size=4", "trainer.save_every=2", "trainer.eval_every=0",
              *quiet]
    if stage == "long_context":
        return [*launch, "long_context", SCHEDULE, *common]
    common.append(f"trainer.max_steps={steps}")
    if stage == "sft":
        return [*launch, "sft", f"model.init_from={init}", "sft.builtin_samples=200", "sft.seq_len=128",
                "eval.problems=0", *common]
    return [*launch, "pretrain", "data.seq_len=128", *common]


def environment(port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               WANDB_MODE="offline", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_to_end(cmd: list[str], env: dict[str, str], log: Path, deadline: float) -> tuple[int | None, float]:
    """(exit code, seconds); exit code None when the run was still going at the deadline."""
    start = time.monotonic()
    with open(log, "a") as out:
        p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True)
        try:
            return p.wait(timeout=deadline), time.monotonic() - start
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            return None, time.monotonic() - start


def killed_at(cmd: list[str], env: dict[str, str], log: Path, run_dir: Path, seconds: float) -> dict:
    """Start the run, SIGKILL its main process after `seconds` -> what it had done by then:
    training rows written, complete checkpoints, a checkpoint half written (its staging dir),
    and the last line of its output (the setup phase, before training starts)."""
    with open(log, "a") as out:
        p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True)
        try:
            code = p.wait(timeout=seconds)
            return {"finished_before_the_kill": code}
        except subprocess.TimeoutExpired:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
    left = outlived(p.pid)
    dirs = [d / "checkpoints" for d in stage_dirs(run_dir)]
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return {"steps_logged": sum(step_counts(run_dir).values()),
            "checkpoints": sum(len(list(c.glob("step_*/manifest.json"))) for c in dirs if c.is_dir()),
            "checkpoint_half_written": any(c.is_dir() and any(c.glob(".tmp_*")) for c in dirs),
            "last_output": lines[-1][:100] if lines else "", "processes_left": left}


def session_processes(sid: int) -> list[int]:
    """Live processes of session `sid` (the killed run started one: its workers, Ray's servers)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # session id; zombies are already dead
            out.append(int(stat.parent.name))
    return out


def outlived(sid: int, grace: float = 15.0) -> int:
    """How many processes of the killed run's session were still alive `grace` seconds after the
    kill (a killed driver's Ray servers and actors should follow it). They are then killed, so
    that the rerun starts on a machine the leftovers do not load."""
    deadline = time.monotonic() + grace
    while session_processes(sid) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = session_processes(sid)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(left)


def stage_dirs(run_dir: Path) -> list[Path]:
    """Where a run keeps its checkpoints and metrics: long_context's sub-stage dirs, in order, or
    the run dir itself."""
    return sorted(run_dir.glob("stage_*")) or [run_dir]


def latest_checkpoint(run_dir: Path) -> Path:
    ckpts = stage_dirs(run_dir)[-1] / "checkpoints"
    return ckpts / (ckpts / "latest").read_text().strip()


def final_weights(run_dir: Path):
    import torch

    from trainer.checkpoint import model_state

    return {k: v.clone() for k, v in model_state(latest_checkpoint(run_dir)).items() if torch.is_tensor(v)}


def training_rows(run_dir: Path) -> list[tuple[str, dict]]:
    """(sub-stage dir name, row) for every training row (one with a loss) of the run's metrics."""
    out = []
    for d in stage_dirs(run_dir):
        if (d / "metrics.jsonl").exists():
            rows = (json.loads(ln) for ln in (d / "metrics.jsonl").read_text().splitlines() if ln.strip())
            out += [(d.name, r) for r in rows if "loss" in r]
    return out


def step_counts(run_dir: Path) -> Counter:
    """Training rows per step; keyed "<sub-stage dir>/<step>" where a run has sub-stages."""
    staged = len(stage_dirs(run_dir)) > 1
    return Counter(f"{d}/{r['step']}" if staged else r["step"] for d, r in training_rows(run_dir))


def prompt_accounting(run_dir: Path, steps: int) -> dict:
    """An RL or distillation run that finished: every prompt below the final checkpoint's data
    cursor trained in exactly one metrics row or still waiting in the checkpoint's requeue, and
    every version 1..steps logged once."""
    import torch

    from trainer.checkpoint import TRAINER_STATE

    state = torch.load(latest_checkpoint(run_dir) / TRAINER_STATE, map_location="cpu",
                       weights_only=True)["rl"]
    rows = [r for _, r in training_rows(run_dir)]
    trained = Counter(pid for r in rows for pid in r["prompt_ids"])
    versions = Counter(r["step"] for r in rows)
    requeued = set(state["requeue"])
    lost = [f"prompt {p}" for p in range(state["cursor"]) if p not in trained and p not in requeued]
    lost += [f"version {v}" for v in range(1, steps + 1) if not versions[v]]
    duplicated = [f"prompt {p}" for p in sorted(trained) if trained[p] > 1 or p in requeued]
    duplicated += [f"version {v}" for v in sorted(versions) if versions[v] > 1]
    return {"prompts_trained": len(trained), "cursor": state["cursor"], "requeued": len(requeued),
            "lost": lost, "duplicated": duplicated}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kill-at", default="1,3,5,10", help="seconds after the start, comma-separated")
    p.add_argument("--random", type=int, default=4,
                   help="more kill moments, drawn between 0 and the run's duration")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stage", choices=STAGES, default="pretrain",
                   help="default: the Quickstart's `flashtrain pretrain` as is (150 steps; --steps is "
                        "ignored); long_context: its two sub-stages (--steps is ignored)")
    p.add_argument("--steps", type=int, default=20, help="training steps (rl, distill: policy versions)")
    p.add_argument("--deadline", type=float, default=900.0, help="seconds a rerun may take")
    p.add_argument("--work", type=Path, default=None, help="where the runs go (default: a temp dir)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    import torch

    work = args.work or Path(tempfile.mkdtemp(prefix="flashtrain-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    port = 21000 + os.getpid() % 1000
    steps = DEFAULT_STEPS if args.stage == "default" else args.steps
    init = None
    if args.stage in FROM_A_CHECKPOINT:  # the pretrained weights every run starts from, made once
        code, _ = run_to_end(command("pretrain", work / "init", work / "init_cache", 2), environment(port),
                             work / "init.log", args.deadline)
        if code != 0:
            raise SystemExit(f"the pretraining run {args.stage} starts from failed (exit {code}): see "
                             f"{work / 'init.log'}")
        init = work / "init" / "checkpoints"
        port += 1

    def cmd_for(root: Path) -> list[str]:
        return command(args.stage, root / "run", root / "cache", steps, init)

    ref_dir = work / "reference"
    code, ref_s = run_to_end(cmd_for(ref_dir), environment(port), work / "reference.log", args.deadline)
    if code != 0:
        raise SystemExit(f"the uninterrupted run failed (exit {code}): see {work / 'reference.log'}")
    exact = args.stage not in RAY_STAGES  # asynchronous RL: the weights depend on timing
    want = final_weights(ref_dir / "run") if exact else None
    logged = step_counts(ref_dir / "run")  # the steps a metrics row is written for (trainer.log_every)
    reference = {} if exact else prompt_accounting(ref_dir / "run", steps)
    rng = random.Random(args.seed)
    moments = [float(s) for s in args.kill_at.split(",") if s] + [
        round(rng.uniform(0.5, ref_s), 1) for _ in range(args.random)]
    trials = []
    for i, seconds in enumerate(moments):
        trial = work / f"trial_{i:02d}"
        trial.mkdir()
        cmd, env = cmd_for(trial), environment(port + 1 + i)
        doing = killed_at(cmd, env, trial.with_suffix(".log"), trial / "run", seconds)
        rerun, rerun_s = run_to_end(cmd, env, trial.with_suffix(".log"), args.deadline)
        row = {"kill_at_s": seconds, "at_the_kill": doing, "rerun_exit": rerun, "rerun_s": round(rerun_s, 1),
               "hang": rerun is None}
        if rerun == 0 and exact:
            got = final_weights(trial / "run")
            row["bit_exact"] = got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
            counts = step_counts(trial / "run")
            row["lost"] = [s for s in sorted(logged, key=str) if counts[s] == 0]
            row["duplicated"] = sorted((s for s, n in counts.items() if n > 1), key=str)
        elif rerun == 0:
            row.update(prompt_accounting(trial / "run", steps))
            row["resumed"] = "resumed at version" in trial.with_suffix(".log").read_text(errors="replace")
        trials.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    out = {**provenance.header("bench/system/chaos_kill.py"), "stage": args.stage,
           "command": cmd_for(work / "TRIAL")[2:], "steps": steps, "uninterrupted_s": round(ref_s, 1),
           **({"uninterrupted": reference} if reference else {}),
           "trials": trials, "all_resumed": all(t.get("rerun_exit") == 0 for t in trials),
           **({"all_bit_exact": all(t.get("bit_exact") for t in trials)} if exact else {}),
           "nothing_lost_or_duplicated": all(t.get("rerun_exit") == 0 and not t["lost"]
                                             and not t["duplicated"]
                                             for t in trials)}
    return provenance.emit(out, args.out)


if __name__ == "__main__":
    main()
