"""How many valid tasks the synthesis pipeline gets from a policy (rl/synthesis.py): of N
proposals, how many parse, pass each sandbox filter (verifiable, solvable, non-trivial), are
distinct, and, for an SFT run on the built-in `synth_propose` demonstrations, how many are not a
verbatim copy of one; the solver's pass rate and the proposer rewards. One entry per run and
temperature.

    python -m bench.experiments.task_synthesis --run SFT_RUN [--run PRETRAIN_RUN] \
        [--proposals 64] [--attempts 4] [--temperatures 0,1] \
        [--out bench/results/experiments/task-synthesis-cpu.json]

A run is a pretraining or SFT run directory (its config.yaml and checkpoints/). The SFT run
that makes `tiny` write triples (bench/reports/2026-12-06-task-synthesis.md):

    flashtrain sft model.init_from=PRETRAIN_RUN/checkpoints sft.builtin_task=synth_propose \
        '+sft.builtin_task_kwargs={solve_fraction:0.5}' trainer.max_steps=150 ...
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from omegaconf import OmegaConf

from bench import provenance
from conf.synth import SynthSettings
from rl.synthesis import synthesize


def load_policy(run: Path):
    """The run's model (its own config), newest checkpoint, tokenizer and stage config."""
    from data import build_datasets
    from launch.stages import all_stages
    from trainer.checkpoint import load_model_weights, resolve_checkpoint
    from trainer.pretrain import build_model

    saved = OmegaConf.load(run / "config.yaml")
    stage = all_stages()[saved.get("stage", "pretrain")].config
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(stage), saved))
    _, _, tok = build_datasets(cfg.data)
    model = build_model(cfg, tok)
    load_model_weights(model, resolve_checkpoint(run / "checkpoints", "--run"))
    return model.eval(), tok, cfg


def demonstrations(cfg) -> set[str]:
    """The proposal answers of an SFT run's built-in set (what trainer/sft.py trained on), or
    an empty set for any other run."""
    from data.sft import builtin_conversations, heldout_problems, load_sft_task

    sft = getattr(cfg, "sft", None)
    if sft is None or sft.source != "builtin" or sft.builtin_task != "synth_propose":
        return set()
    task = load_sft_task(sft.builtin_task, sft.builtin_task_kwargs)
    exclude = frozenset(p.prompt for p in heldout_problems(task, max(0, cfg.eval.problems), cfg.eval.seed))
    conversations = builtin_conversations(task, sft.builtin_samples, sft.builtin_seed, [50], exclude)
    return {c.messages[1].content for c in conversations if c.messages[0].content.startswith("Propose")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", type=Path, action="append", required=True, help="a pretraining or SFT run")
    ap.add_argument("--proposals", type=int, default=64)
    ap.add_argument("--attempts", type=int, default=4)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--effort", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--rows", type=Path, help="a directory for each entry's proposals (JSONL)")
    args = ap.parse_args()

    from data.chat import ChatFormat

    entries = []
    for run in args.run:
        model, tok, cfg = load_policy(run)
        demos = demonstrations(cfg)
        for temperature in (float(t) for t in args.temperatures.split(",")):
            s = dataclasses.replace(SynthSettings(), proposals=args.proposals, attempts=args.attempts,
                                    effort=args.effort, temperature=temperature, seed=args.seed,
                                    packed_cache=cfg.model.kv_quant == "qat", device="cpu")
            start = time.perf_counter()
            rows, summary = synthesize(model, ChatFormat(tok), s)
            valid = [r for r in rows if r["valid"]]
            entry = {"run": str(run), "stage": cfg.stage, "model": cfg.model.name, "temperature": temperature,
                     "effort": args.effort, "attempts": args.attempts, **summary,
                     "wall_s": time.perf_counter() - start,
                     "examples": {"valid": [r["text"] for r in valid[:3]],
                                  "rejected": [{"text": r["text"], "why": r.get("reason") or r["parse_error"]}
                                               for r in rows if not r["valid"]][:3]}}
            if demos:
                novel = {r["problem"] for r in valid if r["text"] not in demos}
                entry["valid_not_a_demonstration"] = sum(r["text"] not in demos for r in valid)
                entry["distinct_novel_problems"] = len(novel)
            entries.append(entry)
            if args.rows:
                args.rows.mkdir(parents=True, exist_ok=True)
                name = f"{run.name}-t{temperature:g}.jsonl"
                (args.rows / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
            print(f"{run} T={temperature}: {summary['counts']}", flush=True)
    provenance.emit({**provenance.header("task_synthesis"), "entries": entries}, args.out)


if __name__ == "__main__":
    main()
