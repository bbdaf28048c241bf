"""The distillation coordinator: the RL coordinator (rl/coordinator.py: admission, version tags,
staleness, rollouts, rewards, training, weights, faults, save/resume) with one more role in the
pipeline. After a prompt's samples are scored they wait for their domain's teacher; a teacher
worker that is idle takes the waiting samples of one of its teachers, preferring one it has
loaded, and sends back each token's teacher view (rl/distill/teachers.py); then the prompt is
ready to train.

Batching by domain: prompts come in blocks of one domain (rl/distill/prompts.py), and a teacher
is called once `distill.teacher_batch` of its samples wait or training is waiting for them
(they belong to the oldest `prompts_per_step` untrained prompts), so one teacher load serves
many tokens.

Teacher faults: teacher workers restart (Ray max_restarts); a call that fails or outlives
rl.timeout_s puts its prompts back among the waiting ones, and the samples are scored again.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

from conf.errors import UserError
from rl.coordinator import Coordinator, _Call


class DistillCoordinator(Coordinator):
    RETRYABLE = ("gen", "score", "teach")
    teacher_worker: Optional[type] = None  # the teacher actor class (None: rl.distill.teachers.TeacherWorker)

    def __init__(self, cfg, run_dir: Path, tokenizer_path: str, policy: Optional[str], log,
                 student_vocab: int, teachers: tuple):
        """teachers: (domain -> teacher key, teacher specs), from rl.distill.teachers.resolve_teachers."""
        from data.chat import ChatFormat
        from data.tokenizer import TextTokenizer
        from rl.distill.prompts import DomainPromptSource
        from rl.distill.teachers import TeacherWorker, place_teachers

        if cfg.rl.ppo_epochs != 1 or cfg.rl.minibatches != 1:
            from conf.errors import ConfigError
            raise ConfigError("distill takes one optimizer step per version: "
                              f"rl.ppo_epochs={cfg.rl.ppo_epochs} and rl.minibatches={cfg.rl.minibatches} "
                              "must be 1")
        self.routes, specs = teachers
        super().__init__(cfg, run_dir, tokenizer_path, policy, log)
        d, rl, ray = cfg.distill, self.rl, self.ray
        self.distill = d
        chat = ChatFormat(TextTokenizer.from_file(tokenizer_path))
        self.source = DomainPromptSource(self.task, chat, list(rl.efforts), list(rl.effort_weights), rl.seed,
                                         d.domain_block)
        Teacher = ray.remote(num_cpus=1, num_gpus=d.teacher_gpus, max_restarts=-1,
                             max_task_retries=0)(self.teacher_worker or TeacherWorker)
        device = "cuda" if d.teacher_gpus else "cpu"
        self.hosted = place_teachers(specs, d.teacher_workers)
        self.teachers = [Teacher.remote(h, tokenizer_path, student_vocab, d.max_resident, d.cpu_cache,
                                        d.teacher_threads, device, d.wire_dtype) for h in self.hosted]
        self.hosts = {s.key: [a for a, h in enumerate(self.hosted) if s in h] for s in specs}
        self.names = {s.key: s.name for s in specs}
        self.waiting: dict[str, list[int]] = {s.key: [] for s in specs}  # teacher -> scored prompts
        self.scored: dict[int, list[dict]] = {}  # prompt -> its scored samples, waiting for a teacher
        self.busy_teacher: set[int] = set()
        # as each worker last said
        self.loaded: dict[int, list[str]] = {a: [] for a in range(len(self.teachers))}
        self.heads: dict[str, Any] = {}  # teacher key -> LM head, for hidden-state teachers
        self.heads_sent: list[set[str]] = [set() for _ in self.trainers]  # per trainer rank
        self.restarts["teacher"] = 0
        self.worker_stats: dict[int, dict] = {}
        self.teacher_tokens, self.teacher_score_s, self.teacher_swap_s = 0, 0.0, 0.0

    # ------------------------------------------------------------------ start
    def check_teachers(self) -> None:
        """Every teacher loads (on the worker that hosts it) and has the student's vocabulary;
        otherwise a UserError naming each teacher that does not."""
        errors = sorted({e for errs in self.ray.get([t.check.remote() for t in self.teachers]) for e in errs})
        if errors:
            raise UserError("; ".join(errors))
        self.loaded = dict(enumerate(self.ray.get([t.resident_keys.remote() for t in self.teachers])))

    def run(self) -> dict[str, Any]:
        self.check_teachers()
        return super().run()

    # ------------------------------------------------------------------ teacher calls
    def _scored(self, pid: int, group: list[dict]) -> None:
        domain = self.prompts[pid]["domain"]
        for s in group:
            s["domain"] = domain
        self.admitted[pid] = "teach"
        self.scored[pid] = group
        self.waiting[self.routes[domain]].append(pid)

    def _due(self, key: str) -> bool:
        pids = self.waiting[key]
        if not pids:
            return False
        if len(pids) * self.rl.group_size >= self.distill.teacher_batch:
            return True
        oldest = sorted(self.admitted)[:self.rl.prompts_per_step]  # the next training batch
        return min(pids) <= oldest[-1]

    def _dispatch_more(self) -> None:
        for a in range(len(self.teachers)):
            if a in self.busy_teacher:
                continue
            due = [k for k in self.waiting if a in self.hosts[k] and self._due(k)]
            if not due:
                continue
            # a teacher already loaded here first (no swap), then the one with most waiting
            key = max(due, key=lambda k: (k in self.loaded[a], len(self.waiting[k])))
            take = max(1, self.distill.teacher_batch // self.rl.group_size)
            pids, self.waiting[key] = self.waiting[key][:take], self.waiting[key][take:]
            for pid in pids:
                self.admitted[pid] = "teaching"
            seqs = [(s["prompt"], s["response"]) for pid in pids for s in self.scored[pid]]
            self.busy_teacher.add(a)
            meta, outputs, head = self._score_call(a, key, seqs)
            self._call(meta, _Call("teach", a, pids, payload=(key, outputs, head)))

    def _score_call(self, a: int, key: str, seqs: list) -> tuple:
        """Teacher worker `a` scores `seqs` with teacher `key`: refs (meta, outputs, head). Only
        meta is fetched here; outputs and the head go to the trainer as references, so the
        teacher's bytes move from its worker to the trainer without passing through the driver."""
        return self.teachers[a].score.options(num_returns=3).remote(key, seqs,
                                                                    with_head=key not in self.heads)

    def _actor_of(self, call: _Call):
        return self.teachers[call.actor] if call.kind == "teach" else super()._actor_of(call)

    def _failed(self, call: _Call, error: BaseException) -> None:
        if call.kind != "teach":
            return super()._failed(call, error)
        self.restarts["teacher"] += 1
        key = call.payload[0]
        print(f"flashtrain distill: teacher worker {call.actor} failed ({type(error).__name__}) scoring "
              f"{self.names[key]!r}; retrying prompts {call.prompts}", flush=True)
        self.busy_teacher.discard(call.actor)
        self.loaded[call.actor] = []  # restarted: nothing loaded
        back = [pid for pid in call.prompts if self.admitted.get(pid) == "teaching"]
        for pid in back:
            self.admitted[pid] = "teach"
        self.waiting[key] = back + self.waiting[key]

    def _done(self, call: _Call, result: Any) -> Optional[dict]:
        if call.kind != "teach":
            return super()._done(call, result)
        key, outputs, head = call.payload
        self.busy_teacher.discard(call.actor)
        self._took(call.actor, key, result, head)
        j = 0
        for pid in call.prompts:  # outputs come in the order the call sent the samples
            group = self.scored.pop(pid)
            for s in group:
                s.update(teacher=key, teacher_kind=result["kind"], teacher_out=(outputs, j))
                j += 1
            self.admitted[pid] = "ready"
            self.ready[pid] = group
        return None

    def _took(self, a: int, key: str, meta: dict, head) -> None:
        """Book a finished teacher call: worker a's loaded teachers, the head's reference, times."""
        self.loaded[a] = meta["resident"]
        if meta["kind"] == "hidden" and key not in self.heads:
            self.heads[key] = head
        self.teacher_tokens += meta["tokens"]
        self.teacher_score_s += meta["score_s"]
        self.teacher_swap_s += meta["swap_s"]
        self.worker_stats[a] = meta["stats"]  # cumulative per worker (a restarted one starts over)

    # ------------------------------------------------------------------ training
    def _new_heads(self, rank: int, samples: list[dict]) -> dict[str, Any]:
        """The LM heads of `samples`' hidden-state teachers that trainer `rank` has not had yet."""
        keys = {s["teacher"] for s in samples if s["teacher_kind"] == "hidden"} - self.heads_sent[rank]
        self.heads_sent[rank] |= keys
        return {k: self.heads[k] for k in keys}

    def _train_calls(self, samples: list[dict]) -> list:
        return [t.train_step.remote(samples, self._new_heads(r, samples))
                for r, t in enumerate(self.trainers)]

    def _row(self, samples: list[dict], stats: list[dict]) -> dict:
        row = super()._row(samples, stats)
        kl: dict[str, list[float]] = {}
        for st in stats:
            for domain, (total, n) in st["kl_by_domain"].items():
                acc = kl.setdefault(domain, [0.0, 0])
                acc[0], acc[1] = acc[0] + total, acc[1] + n
        tokens = sum(n for _, n in kl.values())
        row["kl"] = sum(t for t, _ in kl.values()) / max(tokens, 1)
        row.update({f"kl/{d}": t / max(n, 1) for d, (t, n) in sorted(kl.items())})
        wall = time.perf_counter() - self.wall_start
        row.update({"teacher_tokens_per_s": (self.teacher_tokens
                                             / max(self.teacher_score_s + self.teacher_swap_s, 1e-9)),
                    "teacher_tokens": self.teacher_tokens, "teacher_swap_s": self.teacher_swap_s,
                    "teacher_score_s": self.teacher_score_s,
                    "teacher_busy_frac": min(1.0,
                                             (self.teacher_score_s + self.teacher_swap_s) / max(wall, 1e-9)),
                    "restarts_teacher": self.restarts["teacher"], "domains_in_batch": len(kl),
                    **{f"teacher_{k}": sum(w[k] for w in self.worker_stats.values())
                       for k in ("swaps", "from_cpu", "from_disk")}})
        return row

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> dict[str, float]:
        """Per domain, greedy answers to distill.eval_prompts fixed problems: the task score
        (1 exact, partial credit below), exact-match rate, and the reverse KL to the domain's
        teacher on those answers."""
        ray, t = self.ray, self.rl.timeout_s
        pairs = self.source.eval_prompts(self.distill.eval_prompts)
        prompts, problems = [p for p, _ in pairs], {p["id"]: q for p, q in pairs}
        out = ray.get(self.rollouts[0].generate.remote(prompts, greedy=True), timeout=t)
        scored = ray.get(self.rewards[0].score.remote(out["samples"], problems), timeout=t)
        domain_of = {p["id"]: p["domain"] for p in prompts}
        for s in scored:
            s.update(domain=domain_of[s["id"]], version=self.version)
        by_key: dict[str, list[dict]] = {}
        for s in scored:
            if s["response"]:
                by_key.setdefault(self.routes[s["domain"]], []).append(s)
        for key, group in sorted(by_key.items()):
            kind, outputs = self._score_now(key, group)
            for j, s in enumerate(group):
                s.update(teacher=key, teacher_kind=kind, teacher_out=(outputs, j))
        taught = [s for g in by_key.values() for s in g]
        kl = (ray.get(self.trainers[0].kl_eval.remote(taught, self._new_heads(0, taught)), timeout=t)
              if taught else {})
        row: dict[str, float] = {"step": self.version}
        for domain in self.source.task.names:
            part = [s for s in scored if s["domain"] == domain]
            row[f"eval/{domain}/score"] = sum(s["task_reward"] for s in part) / len(part)
            row[f"eval/{domain}/exact"] = sum(s["task_reward"] >= 1.0 for s in part) / len(part)
            if domain in kl:
                row[f"eval/{domain}/kl"] = kl[domain][0] / max(kl[domain][1], 1)
        for name in ("score", "exact", "kl"):
            vals = [v for k, v in row.items() if k.endswith(f"/{name}")]
            if vals:
                row[f"eval/mean_{name}"] = sum(vals) / len(vals)
        return row

    def _score_now(self, key: str, group: list[dict]) -> tuple:
        """A teacher call outside the pipeline (evaluation) -> (kind, outputs ref); a worker that
        fails or outlives rl.timeout_s (killed, so Ray restarts it) gets one retry, on the next
        replica or on itself restarted."""
        seqs = [(s["prompt"], s["response"]) for s in group]
        hosts = self.hosts[key]
        for attempt in range(2):
            a = hosts[attempt % len(hosts)]
            meta_ref, outputs, head = self._score_call(a, key, seqs)
            try:
                meta = self.ray.get(meta_ref, timeout=self.rl.timeout_s)
            except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError) as e:
                if attempt:
                    raise
                if isinstance(e, self.ray.exceptions.GetTimeoutError):  # hung: restart it, as in the pipeline
                    self.ray.kill(self.teachers[a], no_restart=False)
                self.restarts["teacher"] += 1
                self.loaded[a] = []
                continue
            self._took(a, key, meta, head)
            return meta["kind"], outputs
        raise RuntimeError(f"distill: teacher {self.names[key]!r} failed twice")

    def shutdown(self) -> None:
        super().shutdown()
        for actor in self.teachers:
            self.ray.kill(actor)
