"""The RL coordinator: streams prompts to rollout actors, their samples to reward actors and
scored groups to the trainer actors, and new weights back to the rollout actors.

Asynchronous (rl.async_, the default): rollouts keep going while the trainer trains, on the
newest weights each rollout worker has received; every sample carries the version that made
it and the trainer masks tokens more than rl.max_staleness versions old. Synchronous: generate
a batch, score it, train, push weights, repeat.

Admission control: at most prompts_per_step * max(max_staleness, 1) prompts are admitted and not
yet trained (queued, generating, scoring or waiting), so rollouts cannot run further ahead than
staleness allows and nothing is generated only to be dropped for being too old.

Failed cases (rl.replay_fraction > 0): a prompt whose every sample scored 0 enters a bounded
replay buffer (rl/replay.py); each newly admitted prompt is, with that probability (drawn from
the prompt index), the oldest live failed problem instead of the index's own, at the index's
effort. The buffer and the replayed problems of re-queued prompts are in the checkpoint.

Fault tolerance: rollout and reward actors restart on failure (Ray max_restarts); a call that
fails or outlives rl.timeout_s re-queues its prompts (a restarted rollout worker gets the
newest weights before its next call). A prompt's samples are accepted only while the prompt is
admitted and not yet handed to the trainer, so a prompt is trained exactly once.
"""
from __future__ import annotations

import dataclasses
import random
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from rl.algorithm import FlatRewardWatch, group_advantages, percentile, shaped_reward
from rl.replay import FailedCaseReplay
from tasks.base import Problem


@dataclass
class _Call:
    kind: str  # gen | score | train | weights | save
    actor: int = -1
    prompts: list[int] = field(default_factory=list)
    deadline: float = 0.0
    payload: Any = None


class Coordinator:
    RETRYABLE = ("gen", "score")  # call kinds whose actor restarts and whose work is retried

    def __init__(self, cfg, run_dir: Path, tokenizer_path: str, policy: Optional[str], log):
        import ray

        from data.chat import ChatFormat
        from data.tokenizer import TextTokenizer
        from rl.policy import PolicyTrainer
        from rl.prompts import PromptSource
        from rl.workers import RewardWorker, RolloutWorker
        from tasks import load_task
        from trainer.distributed import free_port

        self.ray, self.cfg, self.rl, self.log = ray, cfg, cfg.rl, log
        rl = self.rl
        if rl.steps <= 0 or rl.prompts_per_step <= 0 or rl.group_size < 2 or rl.max_staleness < 0:
            from conf.errors import ConfigError
            raise ConfigError("rl: need steps > 0, prompts_per_step > 0, group_size >= 2, max_staleness >= 0;"
                              f" got {rl.steps}, {rl.prompts_per_step}, {rl.group_size}, {rl.max_staleness}")
        per_rank = rl.prompts_per_step * rl.group_size // max(rl.trainer_workers, 1)
        if rl.ppo_epochs < 1 or not 1 <= rl.minibatches <= per_rank:
            from conf.errors import ConfigError
            raise ConfigError(f"rl: need ppo_epochs >= 1 and 1 <= minibatches <= the {per_rank} samples a "
                              f"trainer rank gets per step; got {rl.ppo_epochs}, {rl.minibatches}")
        if not 0.0 <= rl.replay_fraction <= 1.0:
            from conf.errors import ConfigError
            raise ConfigError(f"rl.replay_fraction={rl.replay_fraction}: expected a share in [0, 1]")
        try:
            self.replay = (FailedCaseReplay(rl.replay_capacity, rl.replay_max_age, rl.replay_max_serves)
                           if rl.replay_fraction > 0 else None)
        except ValueError as e:
            from conf.errors import ConfigError
            raise ConfigError(f"rl.replay_capacity/replay_max_age/replay_max_serves: {e}") from None
        self.replayed: dict[int, Problem] = {}  # admitted prompts serving a replayed problem
        self.step_replayed = 0
        chat = ChatFormat(TextTokenizer.from_file(tokenizer_path))
        self.task = load_task(rl.task, **dict(rl.task_kwargs))
        self.source = PromptSource(self.task, chat, list(rl.efforts), list(rl.effort_weights), rl.seed)
        self.eval_source = PromptSource(self.task, chat, [50], [1.0], rl.seed + 7919)  # held-out problems
        Rollout = ray.remote(num_cpus=1, num_gpus=rl.rollout_gpus, max_restarts=-1,
                             max_task_retries=0)(RolloutWorker)
        Reward = ray.remote(num_cpus=1, max_restarts=-1, max_task_retries=0)(RewardWorker)
        Trainer = ray.remote(num_cpus=1, num_gpus=rl.trainer_gpus, max_restarts=0)(PolicyTrainer)
        port, W = free_port(), rl.trainer_workers
        self.trainers = [Trainer.remote(cfg, tokenizer_path, policy, str(run_dir), {
            "RANK": str(r), "WORLD_SIZE": str(W), "LOCAL_RANK": "0" if rl.trainer_gpus else str(r),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}) for r in range(W)]
        self.rollouts = [Rollout.remote(cfg, tokenizer_path, rl.seed + i) for i in range(rl.rollout_workers)]
        self.rewards = [Reward.remote(cfg, tokenizer_path) for _ in range(rl.reward_workers)]
        self.problems: dict[int, Any] = {}
        self.prompts: dict[int, dict] = {}
        self.admitted: dict[int, str] = {}  # prompt id -> queued | gen | score | ready
        self.queue: deque[int] = deque()
        self.ready: dict[int, list[dict]] = {}  # prompt id -> its scored samples
        self.pending: dict[Any, _Call] = {}
        self.cursor, self.version = 0, 0
        self.trained: set[int] = set()
        self.duplicates = 0  # prompts trained twice: must stay 0
        self.restarts = {"rollout": 0, "reward": 0}
        self.flat = FlatRewardWatch(self.rl.flat_reward_warn_steps)
        self.samples_trained, self.train_s, self.wall_start = 0, 0.0, time.perf_counter()
        self.samples_at_wall_start = 0  # a resumed run's rate counts only this process's samples
        # seconds inside rollout workers' generate calls and the tokens they drew: generation's own rate
        self.gen_s, self.gen_tokens = 0.0, 0
        self.weights_ref = None
        self.busy_rollout: set[int] = set()
        self.next_reward = 0

    # ------------------------------------------------------------------ state
    def state(self) -> dict[str, Any]:
        """What a resume needs besides the trainer's own: the data cursor and every admitted,
        untrained prompt (their rollouts are not saved: they are generated again)."""
        state = {"cursor": self.cursor, "version": self.version, "requeue": sorted(self.admitted),
                 "samples_trained": self.samples_trained}
        if self.replay is not None:
            state["replay"] = self.replay.state()
            state["replayed"] = [[pid, dataclasses.asdict(p)] for pid, p in sorted(self.replayed.items())
                                 if pid in self.admitted]
        return state

    def restore(self, state: dict[str, Any]) -> None:
        self.cursor, self.version = state["cursor"], state["version"]
        self.samples_trained = state.get("samples_trained", 0)
        replayed = {}
        if self.replay is not None and "replay" in state:
            self.replay.restore(state["replay"])
            replayed = {pid: Problem(**p) for pid, p in state["replayed"]}
        for pid in state["requeue"]:
            self._admit(pid, replayed.get(pid, False))

    def _admit(self, pid: int, replayed: Optional[Problem] | bool = None) -> None:
        """replayed: the failed problem this prompt serves; None: draw whether it serves one;
        False: it serves its index's own problem."""
        self.prompts[pid], self.problems[pid] = self.source.get(pid)
        if replayed is None and self.replay is not None:
            replayed = (random.Random(f"replay-{self.rl.seed}-{pid}").random() < self.rl.replay_fraction
                        and self.replay.take(self.version)) or False
        if isinstance(replayed, Problem):
            prompt = self.prompts[pid]
            self.prompts[pid] = {**prompt, "ids": self.source.chat.prompt(replayed.prompt, prompt["effort"])}
            self.problems[pid] = self.replayed[pid] = replayed
        self.admitted[pid] = "queued"
        self.queue.append(pid)

    def _limit(self) -> int:
        """Admitted, untrained prompts. A batch starts generating only once the batch s places
        ahead of it has gone to the trainer (at version V - s, whose weights the workers get
        before that generation call), so it trains at lag <= s = max_staleness. With s = 0
        async still overlaps one batch, whose samples arrive a version late and are masked:
        use rl.async=false for strictly on-policy training."""
        return self.rl.prompts_per_step * max(self.rl.max_staleness, 1)

    # ------------------------------------------------------------------ calls
    def _call(self, ref, call: _Call) -> None:
        call.deadline = time.monotonic() + self.rl.timeout_s
        self.pending[ref] = call

    def _push_weights(self, workers: Optional[list[int]] = None) -> None:
        self.weights_ref = self.trainers[0].weights.remote()
        for i in workers if workers is not None else range(len(self.rollouts)):
            self._call(self.rollouts[i].set_weights.remote(self.weights_ref), _Call("weights", i))

    def _dispatch_rollouts(self) -> None:
        training = any(c.kind == "train" for c in self.pending.values())
        if self.rl.async_:
            while len(self.admitted) < self._limit():
                self._admit(self.cursor)
                self.cursor += 1
        elif training:  # synchronous: nothing is generated while the trainer trains
            return
        elif not self.admitted:  # synchronous: a batch at a time, on the newest weights
            for _ in range(self.rl.prompts_per_step):
                self._admit(self.cursor)
                self.cursor += 1
        for i in range(len(self.rollouts)):
            if i in self.busy_rollout or not self.queue:
                continue
            batch = [self.queue.popleft() for _ in range(min(self.rl.prompts_per_request, len(self.queue)))]
            for pid in batch:
                self.admitted[pid] = "gen"
            self.busy_rollout.add(i)
            self._call(self.rollouts[i].generate.remote([self.prompts[p] for p in batch]),
                       _Call("gen", i, batch))

    def _dispatch_training(self) -> None:
        if (any(c.kind in ("train", "save") for c in self.pending.values())
                or len(self.ready) < self.rl.prompts_per_step):
            return
        pids = sorted(self.ready)[:self.rl.prompts_per_step]
        groups = [self.ready.pop(pid) for pid in pids]
        for pid in pids:
            self.admitted.pop(pid)
            if pid in self.trained:
                self.duplicates += 1
            self.trained.add(pid)
        samples = [s for g in groups for s in g]
        rl = self.rl
        if self.replay is not None:
            for pid, group in zip(pids, groups):
                self.replay.feedback(self.problems[pid], [s["task_reward"] for s in group], self.version)
            self.step_replayed = sum(self.replayed.pop(pid, None) is not None for pid in pids)
        shaped = shaped_reward(torch.tensor([s["task_reward"] for s in samples]),
                               torch.tensor([s["length"] for s in samples]),
                               torch.tensor([s["effort"] for s in samples]), rl.max_new_tokens,
                               rl.length_penalty_base, rl.length_penalty_scale)
        adv = group_advantages(shaped, rl.group_size, rl.adv_std_floor)
        warning = self.flat.update(adv, sum(s["task_reward"] for s in samples) / len(samples))
        if warning:
            print(warning, flush=True)
        for s, r, a in zip(samples, shaped.tolist(), adv.tolist()):
            s["reward"], s["advantage"] = r, a
        refs = self._train_calls(samples)
        self._call(refs[0], _Call("train", payload=(samples, refs[1:])))

    def _train_calls(self, samples: list[dict]) -> list:
        """One train_step call per trainer rank (flashtrain distill adds teacher heads)."""
        return [t.train_step.remote(samples) for t in self.trainers]

    def _dispatch_more(self) -> None:
        """Calls of further roles, after rollouts and training (flashtrain distill: teachers)."""

    def _actor_of(self, call: _Call):
        return (self.rollouts if call.kind == "gen" else self.rewards)[call.actor]

    # ------------------------------------------------------------------ results
    def _failed(self, call: _Call, error: BaseException) -> None:
        """A rollout or reward call died or timed out: its prompts go back to the queue."""
        kind = "rollout" if call.kind == "gen" else "reward"
        self.restarts[kind] += 1
        print(f"flashtrain rl: {kind} actor {call.actor} failed ({type(error).__name__}); "
              f"re-queueing prompts {call.prompts}", flush=True)
        for pid in call.prompts:
            if pid in self.admitted and self.admitted[pid] in ("gen", "score"):
                self.admitted[pid] = "queued"
                self.queue.appendleft(pid)
        if call.kind == "gen":
            self.busy_rollout.discard(call.actor)
            if self.weights_ref is not None:  # a restarted worker starts without weights
                self._call(self.rollouts[call.actor].set_weights.remote(self.weights_ref),
                           _Call("weights", call.actor))

    def _done(self, call: _Call, result: Any) -> Optional[dict]:
        if call.kind == "gen" and result.get("no_weights"):  # restarted since its last call
            self._failed(call, RuntimeError("the worker lost its weights"))
            return None
        if call.kind == "gen":
            self.busy_rollout.discard(call.actor)
            self.gen_s += result["gen_s"]
            self.gen_tokens += sum(len(s["response"]) for s in result["samples"])
            samples = [s for s in result["samples"] if self.admitted.get(s["id"]) == "gen"]
            if samples:
                ids = sorted({s["id"] for s in samples})
                for pid in ids:
                    self.admitted[pid] = "score"
                w = self.next_reward = (self.next_reward + 1) % len(self.rewards)
                problems = {pid: self.problems[pid] for pid in ids}
                self._call(self.rewards[w].score.remote(samples, problems), _Call("score", w, ids))
        elif call.kind == "score":
            by_prompt: dict[int, list[dict]] = {}
            for s in result:
                by_prompt.setdefault(s["id"], []).append(s)
            for pid, group in by_prompt.items():
                if self.admitted.get(pid) == "score" and len(group) == self.rl.group_size:
                    self._scored(pid, group)
        elif call.kind == "train":
            samples, others = call.payload
            stats = [result] + self.ray.get(others, timeout=self.rl.timeout_s)
            self.version = result["version"]
            self.samples_trained += len(samples)
            self.train_s += max(s["train_s"] for s in stats)
            self._push_weights()
            return self._row(samples, stats)
        return None

    def _scored(self, pid: int, group: list[dict]) -> None:
        """A prompt's scored group is complete: ready to train (flashtrain distill: to its teacher)."""
        self.admitted[pid] = "ready"
        self.ready[pid] = group

    def _row(self, samples: list[dict], stats: list[dict]) -> dict:
        wall = time.perf_counter() - self.wall_start
        row: dict[str, Any] = {"step": self.version, "loss": sum(s["loss"] for s in stats) / len(stats),
                               # which prompts this version trained: with the checkpoint's cursor and
                               # requeue, metrics.jsonl shows each prompt trained once across resumes
                               "prompt_ids": sorted({s["id"] for s in samples}),
                               **{k: stats[0][k] for k in ("clip_frac", "truncated_frac", "behaviour_kl")
                                  if k in stats[0]},  # policy-loss stats (distillation may have none)
                               "reward": sum(s["reward"] for s in samples) / len(samples),
                               "task_reward": sum(s["task_reward"] for s in samples) / len(samples),
                               "samples": self.samples_trained, "elapsed_s": wall,
                               "samples_per_s": (self.samples_trained - self.samples_at_wall_start) / wall,
                               "trainer_idle_frac": max(0.0, 1 - self.train_s / wall),
                               # tokens drawn per second of one worker's generate calls, prefills included
                               "rollout_tokens_per_s": self.gen_tokens / self.gen_s if self.gen_s else 0.0,
                               "stale_samples": sum(s["stale_samples"] for s in stats),
                               "stale_tokens": sum(s["stale_tokens"] for s in stats),
                               "version_lag_mean": (sum(self.version - 1 - s["version"] for s in samples)
                                                    / len(samples)),
                               "restarts_rollout": self.restarts["rollout"],
                               "restarts_reward": self.restarts["reward"]}
        stale_lengths = [n for s in stats for n in s["stale_lengths"]]
        if self.replay is not None:  # the share of this version's prompts that were failed cases; the buffer
            row["replay_frac"] = self.step_replayed / len({s["id"] for s in samples})
            row["replay_size"] = len(self.replay)
        if stale_lengths:
            row["stale_len_mean"] = sum(stale_lengths) / len(stale_lengths)
            row["stale_len_p90"] = percentile(stale_lengths, 90)
        for effort in sorted({s["effort"] for s in samples}):
            part = [s for s in samples if s["effort"] == effort]
            lengths = [s["length"] for s in part]
            key = f"effort_{effort}"
            row[f"{key}/reward"] = sum(s["reward"] for s in part) / len(part)
            row[f"{key}/accuracy"] = sum(s["task_reward"] >= 1.0 for s in part) / len(part)
            row[f"{key}/len_mean"] = sum(lengths) / len(lengths)
            row[f"{key}/len_p90"] = percentile(lengths, 90)
        return row

    # ------------------------------------------------------------------ evaluation and saving
    def evaluate(self) -> dict[str, float]:
        """Greedy answers to held-out problems at each configured effort: accuracy and length."""
        row: dict[str, float] = {"step": self.version}
        for effort in sorted(set(self.rl.efforts)):
            prompts, problems = [], {}
            for i in range(self.rl.eval_prompts):
                _, problem = self.eval_source.get(i)
                p = {"id": -1 - i, "effort": effort, "ids": self.source.chat.prompt(problem.prompt, effort)}
                prompts.append(p)
                problems[p["id"]] = problem
            out = self.ray.get(self.rollouts[0].generate.remote(prompts, greedy=True),
                               timeout=self.rl.timeout_s)
            scored = self.ray.get(self.rewards[0].score.remote(out["samples"], problems),
                                  timeout=self.rl.timeout_s)
            row[f"eval/effort_{effort}/accuracy"] = sum(s["task_reward"] >= 1.0 for s in scored) / len(scored)
            row[f"eval/effort_{effort}/len_mean"] = sum(s["length"] for s in scored) / len(scored)
        return row

    def save(self) -> None:
        refs = [t.save.remote(self.state()) for t in self.trainers]
        self.ray.get(refs, timeout=self.rl.timeout_s)

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict[str, Any]:
        rl, ray = self.rl, self.ray
        states = ray.get([t.resume.remote(self.cfg.trainer.resume) for t in self.trainers],
                         timeout=rl.timeout_s)
        if states[0] is not None:
            self.restore(states[0])
            print(f"flashtrain rl: resumed at version {self.version}, cursor {self.cursor}, "
                  f"{len(self.queue)} prompts re-queued", flush=True)
        self._push_weights()
        last: dict[str, Any] = {}
        if states[0] is None:
            self._drain_weights()
            first = self.evaluate()
            self.log(first)
            last.update(first)
        self.wall_start, self.samples_at_wall_start = time.perf_counter(), self.samples_trained
        self.gen_s, self.gen_tokens = 0.0, 0  # from the same start as samples_per_s
        while self.version < rl.steps:
            self._dispatch_rollouts()
            self._dispatch_training()
            self._dispatch_more()
            ready, _ = ray.wait(list(self.pending), num_returns=1, timeout=1.0)
            now = time.monotonic()
            for ref in ready:
                call = self.pending.pop(ref)
                try:
                    result = ray.get(ref)
                except ray.exceptions.RayActorError as e:  # the actor died (Ray restarts it)
                    if call.kind in self.RETRYABLE:
                        self._failed(call, e)
                    elif call.kind == "weights":
                        self._call(self.rollouts[call.actor].set_weights.remote(self.weights_ref),
                                   _Call("weights", call.actor))
                    else:
                        raise RuntimeError(f"rl: a trainer actor died during {call.kind}: {e}") from e
                    continue
                row = self._done(call, result)
                if row is not None:
                    self.log(row)
                    last.update(row)
                    if rl.save_every and self.version % rl.save_every == 0 and self.version < rl.steps:
                        self.save()
                    if rl.eval_every and self.version % rl.eval_every == 0 and self.version < rl.steps:
                        self._drain_weights()
                        ev = self.evaluate()
                        self.log(ev)
                        last.update(ev)
            for ref, call in list(self.pending.items()):
                if now > call.deadline:
                    if call.kind not in self.RETRYABLE:
                        raise TimeoutError(f"rl: a {call.kind} call took longer than "
                                           f"rl.timeout_s={rl.timeout_s}")
                    del self.pending[ref]
                    # restarted by Ray; its prompts go back to the queue
                    ray.kill(self._actor_of(call), no_restart=False)
                    self._failed(call, TimeoutError(f"{call.kind} call over {rl.timeout_s}s"))
        self.save()
        self._drain_weights()
        final = self.evaluate()
        self.log(final)
        last.update(final)
        last.update({"duplicates": self.duplicates, "trained_prompts": len(self.trained)})
        return last

    def _drain_weights(self) -> None:
        """Wait for outstanding weight pushes (evaluation must see the newest weights)."""
        refs = [r for r, c in self.pending.items() if c.kind == "weights"]
        for r in refs:
            self.pending.pop(r)
        if refs:
            self.ray.get(refs, timeout=self.rl.timeout_s)

    def shutdown(self) -> None:
        for actor in self.rollouts + self.rewards + self.trainers:
            self.ray.kill(actor)
