"""Long-context retrieval: one decisive line deep in a long context (docs/ARCHITECTURE.md §10's warned-about
failure mode), built from the validation corpus.

  needle  "# the secret number of <key> is <value>" hidden at a depth, asked for at the end
  kv      several such lines with different keys; one of them is asked for

A sample counts as correct when the model's greedy prediction of every value token, given
the prompt, is right (teacher-forced). For each Full and Reindex layer we also record
whether the query that predicts the first value token selected (top-k) a compressed entry
holding the value, and for pool layers whether the value was in the layer-20 pool.
"""
from __future__ import annotations

import dataclasses
import json
import random
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from conf.errors import ConfigError
from conf.eval_long import EvalLongConfig
from data import build_datasets
from trainer.checkpoint import load_model_weights, resolve_checkpoint
from trainer.pretrain import build_model

KEYS = ("heron", "walnut", "copper", "lantern", "meadow", "quartz", "saffron", "harbor", "falcon", "juniper",
        "cobalt", "orchid", "granite", "willow", "ember", "thistle")
TASKS = ("needle", "kv")


@dataclasses.dataclass
class Sample:
    tokens: list[int]  # prompt + answer
    answer_start: int  # first answer token's index
    answer_len: int
    value_positions: list[int]  # where the decisive value tokens sit in the context


def _line(tok, key: str, value: str) -> tuple[list[int], list[int]]:
    """Tokens of the needle line and the offsets of its value tokens inside it."""
    head = tok.encode(f"\n# the secret number of {key} is")
    value_ids = tok.encode(f" {value}")
    return head + value_ids + tok.encode("\n"), list(range(len(head), len(head) + len(value_ids)))


def make_sample(tok, filler: list[int], length: int, depth: float, task: str, kv_pairs: int,
                rng: random.Random) -> Sample:
    keys = rng.sample(KEYS, kv_pairs if task == "kv" else 1)
    values = {k: str(rng.randrange(10_000, 100_000)) for k in keys}
    target = keys[0]
    question = tok.encode(f"\n# the secret number of {target} is")
    answer = tok.encode(f" {values[target]}")
    lines = {k: _line(tok, k, values[k]) for k in keys}
    room = length - len(question) - len(answer) - sum(len(t) for t, _ in lines.values())
    if room < 16:
        raise ConfigError(f"eval.lengths: {length} tokens cannot hold the task ({task})")
    filler_part = list(filler[:room])
    # the asked-for line at `depth`, the other keys (kv) at random depths
    inserts = sorted([(int(depth * room), 0, target)] + [(rng.randrange(room), i + 1, k)
                                                         for i, k in enumerate(keys[1:])])
    context: list[int] = []
    value_positions: list[int] = []
    done = 0
    for at, _, key in inserts:
        context += filler_part[done:at]
        done = at
        line, offsets = lines[key]
        if key == target:
            value_positions = [len(context) + o for o in offsets]
        context += line
    context += filler_part[done:]
    tokens = context + question + answer
    return Sample(tokens, len(context) + len(question), len(answer), value_positions)


@torch.no_grad()
def score(model, sample: Sample, device: torch.device) -> dict[str, Any]:
    ids = torch.tensor([sample.tokens[:-1]], device=device)
    out = model(ids, keep_runtime=True)
    first = sample.answer_start - 1  # the position that predicts the first answer token
    pred = out.logits[0, first:first + sample.answer_len].argmax(-1).tolist()
    rt = out.runtime
    row: dict[str, Any] = {
        "correct": pred == sample.tokens[sample.answer_start:sample.answer_start + sample.answer_len]}
    for spec in model.plan.layers:
        if not spec.has_indexer_query:
            continue
        entries = {p // spec.compress_ratio for p in sample.value_positions}
        chosen = set(rt.topk[spec.layer_id][0, first].tolist())
        row[f"topk_hit/L{spec.layer_id}"] = bool(entries & chosen)
        pool = (rt.pool.get(spec.layer_id, rt.pool.get(spec.kv_source))
                if spec.mode == "reindex" or spec.builds_pool else None)
        if pool is not None:
            row[f"pool_hit/L{spec.layer_id}"] = bool(entries & set(pool[0, first].tolist()))
    return row


def run_eval_long(cfg: EvalLongConfig, run_dir: Path) -> list[dict[str, Any]]:
    ev = cfg.eval
    bad = [t for t in ev.tasks if t not in TASKS]
    if bad:
        raise ConfigError(f"eval.tasks: unknown {bad}, expected a subset of {TASKS}")
    device = torch.device("cuda" if ev.device == "auto" and torch.cuda.is_available() else
                          (ev.device if ev.device != "auto" else "cpu"))
    _, val, tok = build_datasets(cfg.data)
    filler = [t for i in range(len(val)) for t in val[i]["input_ids"].tolist()
              if t not in (tok.bos_id, tok.eos_id)]
    if len(filler) < max(ev.lengths):
        raise ConfigError(f"the validation split has {len(filler)} tokens, fewer than eval.lengths max "
                          f"{max(ev.lengths)}")
    model_cfg = dataclasses.replace(cfg.model, max_seq_len=max(cfg.model.max_seq_len, max(ev.lengths)))
    model = build_model(dataclasses.replace(cfg, model=model_cfg), tok)
    if ev.checkpoint:
        load_model_weights(model, resolve_checkpoint(Path(ev.checkpoint), "eval.checkpoint"))
    model.to(device).eval()
    rng = random.Random(ev.seed)
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for task in ev.tasks:
        for length in ev.lengths:
            for depth in ev.depths:
                for _ in range(ev.samples):
                    start = rng.randrange(0, len(filler) - length)
                    sample = make_sample(tok, filler[start:], length, depth, task, ev.kv_pairs, rng)
                    groups[(task, length)].append(score(model, sample, device))
    table = []
    for (task, length), rows in groups.items():
        entry = {"task": task, "length": length, "samples": len(rows)}
        for key in rows[0]:
            entry[key] = sum(float(r[key]) for r in rows) / len(rows)
        table.append(entry)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / "eval_long.json").write_text(json.dumps(table, indent=1))
    (Path(run_dir) / "eval_long.md").write_text(markdown_table(table))
    print(markdown_table(table))
    return table


def markdown_table(table: list[dict[str, Any]]) -> str:
    cols = list(table[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in table:
        lines.append("| " + " | ".join(f"{row[c]:.2f}" if isinstance(row[c], float) else str(row[c])
                                        for c in cols) + " |")
    return "\n".join(lines) + "\n"
