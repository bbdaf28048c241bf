"""The distillation prompt stream: prompts that carry a domain key, drawn in blocks per domain.

`DomainPromptSource` draws prompts in blocks of `block` consecutive indices per domain, the
domain order shuffled per cycle from (seed, cycle). So a training batch holds few domains and a
teacher load serves many samples, and (as in rl/prompts.py) a prompt is still a function of its
index alone: the cursor is the whole data state.
"""
from __future__ import annotations

import random

from rl.prompts import PromptSource
from tasks.base import Problem
from tasks.distill_domains import DomainMixture


class DomainPromptSource(PromptSource):
    """PromptSource over a DomainMixture whose prompts carry "domain": index i belongs to block
    i // block, and block b to the (b % D)-th domain of cycle b // D's shuffled order."""

    def __init__(self, task: DomainMixture, chat, efforts: list[int], weights: list[float], seed: int,
                 block: int):
        super().__init__(task, chat, efforts, weights, seed)
        if block < 1:
            raise ValueError(f"distill.domain_block={block}: must be >= 1")
        self.block = block

    def domain_of(self, index: int) -> str:
        names = self.task.names
        b = index // self.block
        order = list(names)
        random.Random(self.seed * 7_919 + b // len(names)).shuffle(order)
        return order[b % len(names)]

    def get(self, index: int):
        domain = self.domain_of(index)
        rng = random.Random(self.seed * 1_000_003 + index)
        problem = self.task.sample_domain(domain, rng)
        effort = rng.choices(self.efforts, weights=self.weights)[0]
        prompt = {"id": index, "effort": effort, "domain": domain,
                  "ids": self.chat.prompt(problem.prompt, effort)}
        return prompt, problem

    def eval_prompts(self, per_domain: int) -> list[tuple[dict, Problem]]:
        """`per_domain` fixed problems of every domain (drawn from seed + 1, so not the training
        stream's), with negative ids."""
        out = []
        for d, domain in enumerate(self.task.names):
            for i in range(per_domain):
                rng = random.Random((self.seed + 1) * 1_000_003 + d * 10_007 + i)
                problem = self.task.sample_domain(domain, rng)
                pid = -1 - len(out)
                out.append(({"id": pid, "effort": self.efforts[0], "domain": domain,
                             "ids": self.chat.prompt(problem.prompt, self.efforts[0])}, problem))
        return out
