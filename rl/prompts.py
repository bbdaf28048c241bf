"""Where RL prompts come from: prompt index i -> (the task's problem i, a sampled effort), both
drawn from generators seeded by (seed, i). So the cursor (the next index) is the whole data
state, a re-queued prompt comes back as the same problem at the same effort, and any worker can
rebuild a prompt from its index."""
from __future__ import annotations

import random

from data.chat import ChatFormat


class PromptSource:
    def __init__(self, task, chat: ChatFormat, efforts: list[int], weights: list[float], seed: int):
        if not efforts or len(efforts) != len(weights) or min(weights) < 0 or sum(weights) <= 0:
            raise ValueError(f"rl.efforts {efforts} and rl.effort_weights {weights}: need one non-negative "
                             "weight per effort, not all zero")
        bad = [e for e in efforts if not 1 <= e <= 100]
        if bad:
            raise ValueError(f"rl.efforts: {bad} outside 1-100")
        self.task, self.chat, self.efforts, self.weights, self.seed = task, chat, efforts, weights, seed

    def get(self, index: int):
        """-> (prompt {"id", "effort", "ids"}, problem)."""
        rng = random.Random(self.seed * 1_000_003 + index)
        problem = self.task.sample(rng)
        effort = rng.choices(self.efforts, weights=self.weights)[0]
        return {"id": index, "effort": effort, "ids": self.chat.prompt(problem.prompt, effort)}, problem
