"""`flashtrain synth`: the policy proposes (problem, environment, verifier) triples, the sandbox
keeps the verifiable, solvable and non-trivial ones (tasks/synthesis.py), the same policy tries
each kept problem `attempts` times, and every proposal gets the proposer rewards. Writes

  proposals.jsonl  every proposal: its text, the parse error or each filter's verdict, the
                   solver's pass rate and the proposer rewards
  tasks.jsonl      the kept triples, one per distinct problem: the pool `rl.task=synth` reads
                   (`'+rl.task_kwargs={pool:RUN/tasks.jsonl}'`)
  synthesis.json   the counts at each step (proposed, parsed, verifiable, solvable, non-trivial),
                   their rates, parse errors and filter failures by reason, mean pass rate and
                   rewards
"""
from __future__ import annotations

import json
import random
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

import torch

from conf.errors import ConfigError
from inference.generate import generate
from tasks.synthesis import (
    FILTERS,
    ParseError,
    ProposeTasks,
    SynthesizedTasks,
    Verdict,
    check_triple,
    difficulty_reward,
    parse_triple,
    proposer_reward,
)


def check_settings(s) -> None:
    """Config errors name the key (exit 2)."""
    if s.proposals < 1 or s.attempts < 0 or s.max_new_tokens < 1 or s.solve_new_tokens < 1:
        raise ConfigError("synth: need proposals >= 1, attempts >= 0, max_new_tokens >= 1, "
                          f"solve_new_tokens >= 1; got {s.proposals}, {s.attempts}, {s.max_new_tokens}, "
                          f"{s.solve_new_tokens}")
    if not 1 <= s.effort <= 100 or not 0 < s.top_p <= 1 or s.temperature < 0:
        raise ConfigError("synth: need 1 <= effort <= 100, 0 < top_p <= 1, temperature >= 0; got "
                          f"{s.effort}, {s.top_p}, {s.temperature}")
    if not 0 <= s.difficulty_weight <= 1:
        raise ConfigError(f"synth.difficulty_weight={s.difficulty_weight}: expected a weight in [0, 1]")
    if not (s.wall_s > 0 and s.cpu_s > 0 and s.memory_mb >= 32 and s.sandbox_workers >= 1
            and s.max_batch >= 1):
        raise ConfigError("synth: need wall_s > 0, cpu_s > 0, memory_mb >= 32, sandbox_workers >= 1, "
                          f"max_batch >= 1; got {s.wall_s}, {s.cpu_s}, {s.memory_mb}, {s.sandbox_workers}, "
                          f"{s.max_batch}")


def synthesize(model, chat, s) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """`s.proposals` proposals from `model` (prompts of tasks.synthesis.ProposeTasks drawn from
    s.seed), filtered and tried -> (one row per proposal, the summary)."""
    check_settings(s)
    limits = {"wall_s": s.wall_s, "cpu_s": s.cpu_s, "memory_mb": s.memory_mb}
    proposer = ProposeTasks(**limits)
    problems = [proposer.sample(random.Random(s.seed * 1_000_003 + i)) for i in range(s.proposals)]
    texts = _answers(model, chat, [p.prompt for p in problems], s, s.max_new_tokens, s.seed)
    rows: list[dict[str, Any]] = []
    triples = []
    for i, (problem, text) in enumerate(zip(problems, texts)):
        row: dict[str, Any] = {"index": i, "prompt": problem.prompt, "text": text}
        try:
            triple = parse_triple(text)
            row.update(parsed=True, **asdict(triple))
        except ParseError as e:
            triple = None
            row.update(parsed=False, parse_error=e.reason)
        rows.append(row)
        triples.append(triple)
    with ThreadPoolExecutor(s.sandbox_workers) as pool:  # each check is sandbox subprocesses
        verdicts = list(pool.map(lambda t: check_triple(t, **limits) if t is not None else None, triples))
    for row, verdict in zip(rows, verdicts):
        if verdict is not None:
            row.update({k: getattr(verdict, k) for k in FILTERS}, reason=verdict.reason,
                       sandbox_s=verdict.sandbox_s)
        row["valid"] = verdict is not None and verdict.valid
    _solve(model, chat, [r for r in rows if r["valid"]], s, limits)
    for row in rows:
        rate = row.get("pass_rate")
        row["difficulty_reward"] = None if rate is None else difficulty_reward(rate)
        row["proposer_reward"] = proposer_reward(row["valid"], rate, s.difficulty_weight)
    return rows, summarize(rows, verdicts)


def _answers(model, chat, users: list[str], s, max_new_tokens: int, seed: int) -> list[str]:
    """The answer text (after <|/think|>) of one sample per user prompt."""
    gens = generate(model, [chat.prompt(u, s.effort) for u in users], max_new_tokens,
                    temperature=s.temperature, top_p=s.top_p, stop=chat.stop_ids(), seed=seed,
                    packed=s.packed_cache, max_batch=s.max_batch)
    return [chat.parse_response(g.tokens)[1] for g in gens]


def _solve(model, chat, rows: list[dict], s, limits: dict) -> None:
    """Each valid row's solver pass rate over s.attempts samples (none: pass_rate stays unset)."""
    if not rows or s.attempts == 0:
        return
    solver = SynthesizedTasks(**limits)
    users = [r["problem"] for r in rows for _ in range(s.attempts)]
    answers = _answers(model, chat, users, s, s.solve_new_tokens, s.seed + 1)
    tests = [r["tests"] for r in rows for _ in range(s.attempts)]
    with ThreadPoolExecutor(s.sandbox_workers) as pool:
        rewards = list(pool.map(solver.passes_tests, answers, tests))
    for j, row in enumerate(rows):
        row["pass_rate"] = sum(rewards[j * s.attempts:(j + 1) * s.attempts]) / s.attempts


def summarize(rows: list[dict], verdicts: list[Optional[Verdict]]) -> dict[str, Any]:
    n = len(rows)
    counts = {"proposed": n, "parsed": sum(r["parsed"] for r in rows)}
    for name in FILTERS:
        counts[name] = sum(bool(v is not None and getattr(v, name)) for v in verdicts)
    valid = [r for r in rows if r["valid"]]
    rates = [r["pass_rate"] for r in valid if r.get("pass_rate") is not None]
    rejected = [r["reason"] for r in rows if r["parsed"] and not r["valid"]]  # "filter: why"
    return {"counts": counts,
            "rates": {k: v / n for k, v in counts.items() if k != "proposed"},  # per proposal
            "valid": len(valid), "valid_rate": len(valid) / n,
            "distinct_valid_problems": len({r["problem"] for r in valid}),
            "parse_errors": dict(Counter(r["parse_error"] for r in rows if not r["parsed"]).most_common()),
            "filter_failures": dict(Counter(r.split(":")[0] for r in rejected).most_common()),
            "filter_reasons": dict(Counter(rejected).most_common()),
            "solver_pass_rate_mean": sum(rates) / len(rates) if rates else None,
            "difficulty_reward_mean": sum(map(difficulty_reward, rates)) / len(rates) if rates else None,
            "proposer_reward_mean": sum(r["proposer_reward"] for r in rows) / n,
            "sandbox_s": sum(r.get("sandbox_s", 0.0) for r in rows)}


def write_outputs(run_dir: Path, rows: list[dict], summary: dict) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "proposals.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen, kept = set(), []
    for r in rows:
        if r["valid"] and r["problem"] not in seen:
            seen.add(r["problem"])
            kept.append({k: r[k] for k in ("problem", "solution", "tests", "function", "pass_rate",
                                           "proposer_reward") if k in r})
    (run_dir / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    (run_dir / "synthesis.json").write_text(json.dumps(summary, indent=1))


def run_synth(cfg, run_dir: Path) -> dict[str, Any]:
    """The stage: the policy from synth.checkpoint, its proposals, the files above in run_dir."""
    from data import build_datasets
    from data.chat import ChatFormat
    from trainer.checkpoint import load_model_weights, resolve_checkpoint
    from trainer.pretrain import build_model

    s = cfg.synth
    check_settings(s)
    device = torch.device("cuda" if s.device == "auto" and torch.cuda.is_available() else
                          (s.device if s.device != "auto" else "cpu"))
    _, _, tok = build_datasets(cfg.data)
    model = build_model(cfg, tok)
    if s.checkpoint:
        load_model_weights(model, resolve_checkpoint(Path(s.checkpoint), "synth.checkpoint"))
    model.to(device).eval()
    rows, summary = synthesize(model, ChatFormat(tok), s)
    write_outputs(Path(run_dir), rows, summary)
    c = summary["counts"]
    print(f"flashtrain synth: {c['proposed']} proposed, {c['parsed']} parsed, {c['verifiable']} verifiable, "
          f"{c['solvable']} solvable, {c['nontrivial']} non-trivial; "
          f"{summary['distinct_valid_problems']} distinct tasks in {Path(run_dir) / 'tasks.jsonl'}",
          flush=True)
    return summary
