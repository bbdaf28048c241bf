"""Rollout and reward workers: plain classes that rl/coordinator.py runs as Ray actors.

A request is a list of prompts: {"id": prompt id, "effort": 1-100, "ids": prompt token ids}.
The rollout worker answers each with `group_size` samples from the generation engine
(inference), every one stamped with the policy version of the weights that produced it; the
reward worker parses and verifies them.
"""
from __future__ import annotations

import time
from typing import Any, Optional

import torch


def place_for_rollout(modules: list[Optional[torch.nn.Module]], trainer_cfg, device: torch.device) -> None:
    """Moves the rollout's models (None entries skipped) to `device`, in the precision the trainer's
    forward runs in there (bf16 on a GPU unless trainer.precision says otherwise), so the behaviour
    log-probs are close to the ones the trainer recomputes."""
    from trainer.engine import keep_fp32_buffers, resolve_precision

    bf16 = resolve_precision(trainer_cfg, device) == "bf16"
    for module in modules:
        if module is not None:
            module.to(device=device, dtype=torch.bfloat16 if bf16 else None)
    if bf16:  # the policy's MoE balancing counters stay fp32, as the trainer keeps them
        keep_fp32_buffers(modules[0])


class RolloutWorker:
    def __init__(self, cfg, tokenizer_path: str, seed: int):
        from data.chat import ChatFormat
        from data.tokenizer import TextTokenizer
        from trainer.pretrain import build_model

        torch.set_num_threads(max(1, cfg.rl.rollout_threads))
        self.cfg, self.rl = cfg, cfg.rl
        self.tokenizer = TextTokenizer.from_file(tokenizer_path)
        self.chat = ChatFormat(self.tokenizer)
        self.model = build_model(cfg, self.tokenizer).eval()
        self.drafter = None
        if self.rl.drafter:  # drafts for the policy's weights of any version: verification keeps it exact
            from trainer.dspark import load_drafter

            self.drafter = load_drafter(self.rl.drafter, self.model.cfg, "rl.drafter")
        if self.rl.rollout_gpus > 0:  # Ray made the GPU(s) it placed this actor on visible as cuda:0
            place_for_rollout([self.model, self.drafter], cfg.trainer, torch.device("cuda"))
        self.version: Optional[int] = None  # no weights yet
        self.seed, self.calls = seed, 0
        # decode state kept across versions (set_weights loads in place): later calls replay the
        # CUDA graphs the first ones captured
        self.engines = None

    def set_weights(self, weights: tuple[int, dict[str, torch.Tensor]]) -> int:
        """(version, state dict) as PolicyTrainer.weights returns it."""
        version, state = weights
        self.model.load_state_dict(state)
        self.version = version
        return version

    def generate(self, prompts: list[dict], greedy: bool = False) -> dict[str, Any]:
        """prompts -> {"samples": group_size samples per prompt (1 when greedy), "gen_s": seconds}."""
        from inference.generate import DecodeEngines, generate

        if self.version is None:  # a restarted actor: the coordinator re-queues and sends weights
            return {"no_weights": True, "samples": [], "gen_s": 0.0}
        start = time.perf_counter()
        n = 1 if greedy else self.rl.group_size
        flat = [p for p in prompts for _ in range(n)]
        self.calls += 1
        # the cache quantises KV exactly as the QAT training forward does, and only then: the
        # behaviour log-probs are the trainer's own for prompts within the replay
        kwargs = dict(temperature=0.0 if greedy else self.rl.temperature, top_p=self.rl.top_p,
                      stop=self.chat.stop_ids(), seed=self.seed * 1_000_003 + self.calls,
                      policy_version=self.version, max_batch=self.rl.rollout_batch,
                      packed=self.cfg.model.kv_quant == "qat", replay=self.rl.rollout_replay)
        prompt_ids = [p["ids"] for p in flat]
        if self.drafter is not None:
            from inference.speculative import generate_speculative

            gens = generate_speculative(self.model, self.drafter, prompt_ids, self.rl.max_new_tokens,
                                        **kwargs)
        else:
            if self.engines is None:
                self.engines = DecodeEngines(self.model)
            compile = "inductor" if self.rl.rollout_compile and self.rl.rollout_gpus > 0 else None
            gens = generate(self.model, prompt_ids, self.rl.max_new_tokens, engines=self.engines,
                            compile=compile, **kwargs)
        samples = [{"id": p["id"], "effort": p["effort"], "prompt": p["ids"], "response": g.tokens,
                    "behaviour": g.logprobs, "version": g.policy_version, "finish": g.finish}
                   for p, g in zip(flat, gens)]
        return {"samples": samples, "gen_s": time.perf_counter() - start}


class RewardWorker:
    def __init__(self, cfg, tokenizer_path: str):
        from data.chat import ChatFormat
        from data.tokenizer import TextTokenizer
        from tasks import load_task

        self.rl = cfg.rl
        self.chat = ChatFormat(TextTokenizer.from_file(tokenizer_path))
        self.task = load_task(cfg.rl.task, **dict(cfg.rl.task_kwargs))

    def score(self, samples: list[dict], problems: dict[int, Any]) -> list[dict]:
        """Adds "task_reward" (the verifier's, in [0, 1]) and "length" (response tokens) to each."""
        out = []
        for s in samples:
            _, answer = self.chat.parse_response(s["response"])
            reward = float(self.task.verify(problems[s["id"]], answer))
            out.append({**s, "task_reward": reward, "length": len(s["response"])})
        return out
