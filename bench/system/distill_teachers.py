"""Distillation acceptance on CPU: make 41 teachers, run `flashtrain distill`, report per domain.

1. A base `tiny` model is trained briefly on all 42 built-in domains (tasks/distill_domains.py):
   it is the student's starting point.
2. 40 flashtrain teachers: the base fine-tuned on its domain(s) (rot1 and rot2 share one
   teacher, so two domains exercise deduplication); plus a transformers Llama (a different
   architecture, same tokenizer) trained from scratch on `length`. All in this one process.
3. Each teacher's greedy eval on its domains, then `flashtrain distill` end to end with those
   teachers (the default registry, conf/distill.py) from the base.
4. The per-domain table: reverse KL to the teacher at the start vs the end of distillation, and
   the student's eval score at start and end next to the teacher's. Written to --out.

Not in CI (teachers ~17 minutes on 2 cores, then ~75 minutes for 1000 versions). The recorded run
(distill.kl_mean at its default, domain):
    python bench/system/distill_teachers.py --work runs/distill-cpu \
      --out bench/results/system/distill-cpu.json \
      --threads 2 --eval-prompts 64 --distill rl.steps=1000 rl.prompts_per_step=32 optim.lr=5e-4 \
      optim.schedule=cosine optim.warmup_steps=0 optim.min_lr_ratio=0.1 rl.eval_every=500 distill.cpu_cache=24
    and its variant adds distill.kl_mean=token (with --skip-teachers --run run_token).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="runs/distill-cpu")
    ap.add_argument("--out", default="bench/results/system/distill-cpu.json")
    ap.add_argument("--base-steps", type=int, default=1000)
    ap.add_argument("--teacher-steps", type=int, default=60)
    ap.add_argument("--hf-steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-4,
                    help="base and flashtrain teachers (2e-3 leaves tiny copying a constant answer)")
    ap.add_argument("--eval-prompts", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (2 on 2 busy cores ran >4x slower than 1)")
    ap.add_argument("--distill", nargs="*", default=[], help="extra `flashtrain distill` overrides")
    ap.add_argument("--run", default="run", help="the distill run's directory under --work")
    ap.add_argument("--skip-teachers", action="store_true", help="reuse teachers already in --work")
    ap.add_argument("--skip-distill", action="store_true",
                    help="only rebuild the table from the run in --run")
    args = ap.parse_args()

    import torch
    from omegaconf import OmegaConf

    import conf
    from conf.distill import HF_TEACHERS, SHARED_TEACHERS
    from data import build_datasets
    from data.chat import ChatFormat
    from launch.cli import compose
    from launch.stages import all_stages
    from rl.distill.make_teachers import (
        domain_rows,
        domain_scores,
        flashtrain_model,
        hf_llama,
        save_flashtrain,
        train_rows,
    )
    from rl.distill.prompts import DomainPromptSource
    from tasks.distill_domains import BUILTIN_DOMAINS, DomainMixture

    torch.set_num_threads(args.threads)
    work = Path(args.work).resolve()
    teachers_dir = work / "teachers"
    conf.register({n: s.config for n, s in all_stages().items()})
    cfg = OmegaConf.to_object(compose("distill", ["logger=none"])[0])
    _, _, tok = build_datasets(cfg.data)
    chat = ChatFormat(tok)
    task = DomainMixture(dict.fromkeys(BUILTIN_DOMAINS))
    effort = cfg.rl.efforts[0]
    pairs = DomainPromptSource(task, chat, [effort], [1.0], cfg.rl.seed, 1).eval_prompts(args.eval_prompts)
    max_new = cfg.rl.max_new_tokens
    report: dict = {"commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                             capture_output=True, text=True).stdout.strip(),
                    "date": time.strftime("%Y-%m-%d"), "device": "cpu", "cpus": os.cpu_count(),
                    "python": sys.version.split()[0], "torch": torch.__version__, "threads": args.threads,
                    "args": vars(args)}

    # teacher -> its domains, as the default registry names them
    groups: dict[str, list[str]] = {}
    for d in BUILTIN_DOMAINS:
        groups.setdefault(HF_TEACHERS.get(d) or SHARED_TEACHERS.get(d, d), []).append(d)
    scores_file = teachers_dir / "teacher_eval.json"
    if not args.skip_teachers:
        start = time.perf_counter()
        rows = domain_rows(chat, task, list(BUILTIN_DOMAINS), 42 * 200, seed=11, effort=effort)
        base, base_cfg = flashtrain_model(cfg.model, tok, 0)
        base_loss = train_rows(base, rows, args.base_steps, args.batch, args.lr, tok.pad_id, seed=0)
        base_ckpt = save_flashtrain(base, base_cfg, teachers_dir / "base")
        base_s = time.perf_counter() - start
        print(f"base: {args.base_steps} steps in {base_s:.0f}s, loss {base_loss:.3f}", flush=True)
        scores, losses = {"base": domain_scores(base, chat, task, pairs, max_new)}, {}
        start = time.perf_counter()
        for i, (name, domains) in enumerate(sorted(groups.items())):
            hf = name in HF_TEACHERS.values()
            rows = domain_rows(chat, task, domains, 400, seed=100 + i, effort=effort)
            if hf:
                model = hf_llama(tok.vocab_size, 1000 + i).train()
                losses[name] = train_rows(model, rows, args.hf_steps, args.batch, 3e-3, tok.pad_id, seed=i,
                                          hf=True)
                model.save_pretrained(teachers_dir / name)
                # checked token by token against the student's
                tok.save(teachers_dir / name / "tokenizer.json")
            else:
                model = copy.deepcopy(base)
                losses[name] = train_rows(model, rows, args.teacher_steps, args.batch, args.lr, tok.pad_id,
                                          seed=i)
                save_flashtrain(model, base_cfg, teachers_dir / name)
            mine = [p for p in pairs if p[0]["domain"] in domains]
            scores[name] = domain_scores(model, chat, task, mine, max_new, hf=hf)
            print(f"teacher {name} ({', '.join(domains)}): loss {losses[name]:.3f} "
                  f"score {sum(v['score'] for v in scores[name].values()) / len(domains):.3f}", flush=True)
        teachers_s = time.perf_counter() - start
        scores_file.write_text(json.dumps({"base_ckpt": str(base_ckpt), "scores": scores, "losses": losses,
                                           "base_s": base_s, "teachers_s": teachers_s, "base_loss": base_loss,
                                           "eval_prompts": args.eval_prompts}))
    made = json.loads(scores_file.read_text())
    # teachers reused: score them on the student's eval set
    if made.get("eval_prompts", 16) != args.eval_prompts:
        made["scores"] = rescore_teachers(Path(made["base_ckpt"]), teachers_dir, groups, tok, chat, task,
                                          pairs, max_new)
        made["eval_prompts"] = args.eval_prompts
        scores_file.write_text(json.dumps(made))
    report["teacher_training"] = {"base_steps": args.base_steps, "base_s": round(made["base_s"], 1),
                                  "base_loss": made["base_loss"],
                                  "flashtrain_teachers": len(groups) - len(HF_TEACHERS),
                                  "hf_teachers": len(HF_TEACHERS), "teacher_steps": args.teacher_steps,
                                  "hf_steps": args.hf_steps, "all_teachers_s": round(made["teachers_s"], 1)}

    run = work / args.run
    overrides = ["logger=none", f"model.init_from={made['base_ckpt']}",
                 f"distill.teacher_root={teachers_dir}", f"distill.eval_prompts={args.eval_prompts}",
                 f"hydra.run.dir={run}", *args.distill]
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29731", "PYTHONPATH": str(REPO)}
    start = time.perf_counter()
    if not args.skip_distill:
        p = subprocess.run([sys.executable, "-m", "launch", "distill", *overrides], cwd=REPO, env=env)
        if p.returncode:
            sys.exit(f"flashtrain distill failed ({p.returncode})")
    report["distill"] = {"overrides": overrides, "wall_s": round(time.perf_counter() - start, 1)}
    if args.skip_distill and Path(args.out).exists():  # keep the measured run's wall time and overrides
        report["distill"] = json.loads(Path(args.out).read_text())["distill"]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in metrics if "eval/mean_score" in r]
    steps = [r for r in metrics if "loss" in r]
    first, last = evals[0], evals[-1]
    teacher_of = {d: name for name, ds in groups.items() for d in ds}
    table = []
    for d in BUILTIN_DOMAINS:
        t = made["scores"][teacher_of[d]][d]
        table.append({"domain": d, "teacher": teacher_of[d], "kl_start": first.get(f"eval/{d}/kl"),
                      "kl_end": last.get(f"eval/{d}/kl"), "student_score_start": first[f"eval/{d}/score"],
                      "student_score_end": last[f"eval/{d}/score"], "teacher_score": t["score"],
                      "student_exact_start": first[f"eval/{d}/exact"],
                      "student_exact_end": last[f"eval/{d}/exact"], "teacher_exact": t["exact"]})
    both = [r for r in table if r["kl_start"] is not None and r["kl_end"] is not None]
    def gap_of(r: dict, when: str) -> float:
        return round(abs(r["teacher_score"] - r[f"student_score_{when}"]), 6)

    def gap(key: str) -> float:
        return sum(abs(r["teacher_score"] - r[key]) for r in table) / len(table)

    report["summary"] = {
        "domains": len(table), "kl_fell": sum(r["kl_end"] < r["kl_start"] for r in both),
        "kl_measured": len(both),
        "kl_mean_start": sum(r["kl_start"] for r in both) / len(both),
        "kl_mean_end": sum(r["kl_end"] for r in both) / len(both),
        "score_gap_shrank": sum(gap_of(r, "end") < gap_of(r, "start") for r in table),
        "score_gap_same": sum(gap_of(r, "end") == gap_of(r, "start") for r in table),
        "score_gap_grew": sum(gap_of(r, "end") > gap_of(r, "start") for r in table),
        "score_gap_to_teacher_start": gap("student_score_start"),
        "score_gap_to_teacher_end": gap("student_score_end"),
        "student_score_mean_start": first["eval/mean_score"],
        "student_score_mean_end": last["eval/mean_score"],
        "teacher_score_mean": sum(r["teacher_score"] for r in table) / len(table),
        "train_kl_first_5": [round(r["kl"], 4) for r in steps[:5]],
        "train_kl_last_5": [round(r["kl"], 4) for r in steps[-5:]],
        "teacher_tokens_per_s": steps[-1]["teacher_tokens_per_s"],
        "teacher_swap_s": steps[-1]["teacher_swap_s"],
        "teacher_score_s": steps[-1]["teacher_score_s"], "samples_per_s": steps[-1]["samples_per_s"],
        "versions": steps[-1]["step"]}
    report["table"] = table
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{'domain':<14}{'kl start':>10}{'kl end':>10}{'student':>16}{'teacher':>9}")
    for r in table:
        kl = f"{r['kl_start'] or float('nan'):>10.4f}{r['kl_end'] or float('nan'):>10.4f}"
        print(f"{r['domain']:<14}{kl}{r['student_score_start']:>8.3f}{r['student_score_end']:>8.3f}"
              f"{r['teacher_score']:>9.3f}")
    print(json.dumps(report["summary"], indent=1))


def rescore_teachers(base_ckpt: Path, teachers_dir: Path, groups: dict[str, list[str]], tok, chat, task,
                     pairs, max_new: int) -> dict:
    """Greedy eval of the saved base and teachers, loaded from disk as the registry loads them."""
    from conf.distill import HF_TEACHERS
    from rl.distill.make_teachers import domain_scores
    from rl.distill.teachers import TeacherSpec, load_teacher
    from trainer.checkpoint import resolve_checkpoint

    def load(path: Path, name: str, arch: str, domains: list[str]):
        key = path if arch == "hf" else resolve_checkpoint(path)
        return load_teacher(TeacherSpec(str(key), name, arch, 1, tuple(domains)), tok, tok.vocab_size)

    scores = {"base": domain_scores(load(base_ckpt, "base", "flashtrain", ["all"]), chat, task, pairs,
                                    max_new)}
    for name, domains in sorted(groups.items()):
        hf = name in HF_TEACHERS.values()
        model = load(teachers_dir / name, name, "hf" if hf else "flashtrain", domains)
        scores[name] = domain_scores(model, chat, task, [p for p in pairs if p[0]["domain"] in domains],
                                     max_new, hf=hf)
        print(f"teacher {name} rescored on {len(pairs) // len(task.names)} prompts per domain: "
              f"{sum(v['score'] for v in scores[name].values()) / len(domains):.3f}", flush=True)
    return scores


if __name__ == "__main__":
    main()
