"""kill -9 of a pretraining or SFT run at given moments, then a rerun: does every rerun finish, with
the weights of an uninterrupted run and every metrics row exactly once?

    python -m bench.chaos_kill [--stage pretrain|default|sft] [--kill-at 1,3,5,10] [--random 4] [--seed 0]
                               [--steps 20] [--out FILE]

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
default kills the Quickstart's own `flashtrain pretrain`. Prints one JSON object; --out writes it too.
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

REPO = Path(__file__).resolve().parents[1]


DEFAULT_STEPS = 150  # `flashtrain pretrain` as the README's Quickstart runs it (conf/trainer.py)


def command(stage: str, run_dir: Path, cache: Path, steps: int, init: Path | None = None) -> list[str]:
    """The run a trial kills. stage: pretrain (short, a checkpoint every 2 steps), default (the
    Quickstart's `flashtrain pretrain`, every setting at its default) or sft (from `init`'s
    checkpoints, on the built-in problems, a checkpoint every 2 steps)."""
    where = [f"data.cache_dir={cache}", f"hydra.run.dir={run_dir}"]
    if stage == "default":
        return [sys.executable, "-m", "launch", "pretrain", *where]
    common = ["model=tiny", "trainer.micro_batch_size=4", f"trainer.max_steps={steps}", "trainer.save_every=2",
              "trainer.log_every=1", "trainer.eval_every=0", "trainer.progress=false", "logger=none", *where]
    if stage == "sft":
        return [sys.executable, "-m", "launch", "sft", f"init_from={init}", "sft.builtin_samples=200",
                "sft.seq_len=128", "eval.problems=0", *common]
    return [sys.executable, "-m", "launch", "pretrain", "data.seq_len=128", *common]


def environment(port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               WANDB_MODE="offline", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_to_end(cmd: list[str], env: dict[str, str], log: Path, deadline: float) -> tuple[int | None, float]:
    """(exit code, seconds); exit code None when the run was still going at the deadline."""
    start = time.monotonic()
    with open(log, "a") as out:
        p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
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
        p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = p.wait(timeout=seconds)
            return {"finished_before_the_kill": code}
        except subprocess.TimeoutExpired:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
    ckpts = run_dir / "checkpoints"
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return {"steps_logged": sum(step_counts(run_dir).values()) if (run_dir / "metrics.jsonl").exists() else 0,
            "checkpoints": len(list(ckpts.glob("step_*/manifest.json"))) if ckpts.is_dir() else 0,
            "checkpoint_half_written": ckpts.is_dir() and any(ckpts.glob(".tmp_*")),
            "last_output": lines[-1][:100] if lines else ""}


def final_weights(run_dir: Path):
    import torch

    from trainer.checkpoint import model_state

    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    return {k: v.clone() for k, v in model_state(run_dir / "checkpoints" / latest).items() if torch.is_tensor(v)}


def step_counts(run_dir: Path) -> Counter:
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return Counter(r["step"] for r in rows if "loss" in r)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kill-at", default="1,3,5,10", help="seconds after the start, comma-separated")
    p.add_argument("--random", type=int, default=4, help="more kill moments, drawn between 0 and the run's duration")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stage", choices=("pretrain", "default", "sft"), default="pretrain",
                   help="default: the Quickstart's `flashtrain pretrain` as is (150 steps; --steps is ignored)")
    p.add_argument("--steps", type=int, default=20)
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
    if args.stage == "sft":  # the pretrained weights every SFT run starts from, made once
        code, _ = run_to_end(command("pretrain", work / "init", work / "init_cache", 2), environment(port),
                             work / "init.log", args.deadline)
        if code != 0:
            raise SystemExit(f"the pretraining run SFT starts from failed (exit {code}): see {work / 'init.log'}")
        init = work / "init" / "checkpoints"
        port += 1

    def cmd_for(root: Path) -> list[str]:
        return command(args.stage, root / "run", root / "cache", steps, init)

    ref_dir = work / "reference"
    code, ref_s = run_to_end(cmd_for(ref_dir), environment(port), work / "reference.log", args.deadline)
    if code != 0:
        raise SystemExit(f"the uninterrupted run failed (exit {code}): see {work / 'reference.log'}")
    want = final_weights(ref_dir / "run")
    logged = step_counts(ref_dir / "run")  # the steps a metrics row is written for (trainer.log_every)
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
        if rerun == 0:
            got = final_weights(trial / "run")
            row["bit_exact"] = got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
            counts = step_counts(trial / "run")
            row["lost"] = [s for s in sorted(logged) if counts[s] == 0]
            row["duplicated"] = sorted(s for s, n in counts.items() if n > 1)
        trials.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    out = {"benchmark": "bench/chaos_kill.py", "stage": args.stage, "command": cmd_for(work / "TRIAL")[2:],
           "commit": provenance.commit(), "date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU",
           "versions": {"python": sys.version.split()[0], "torch": torch.__version__},
           "steps": steps, "uninterrupted_s": round(ref_s, 1), "trials": trials,
           "all_resumed": all(t.get("rerun_exit") == 0 for t in trials),
           "all_bit_exact": all(t.get("bit_exact") for t in trials),
           "nothing_lost_or_duplicated": all(t.get("rerun_exit") == 0 and not t["lost"] and not t["duplicated"]
                                             for t in trials)}
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return out


if __name__ == "__main__":
    main()
