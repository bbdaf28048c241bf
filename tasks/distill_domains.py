"""Synthetic distillation domains (rl/distill/prompts.py streams their prompts).

A domain is a deterministic transform of a short input: text transforms of a lowercase word
("reverse: f d c a b" -> "b a c d f") and arithmetic on a number ("add7: 4 5" -> "5 2"). Inputs
and answers are written one character per token (letters and digits space-separated): the BPE
tokenizer merges letter runs ("fdcab" is " fd", "c", "ab"), which turns a one-step transform
into a spelling problem a `tiny` model does not solve in a few hundred steps. Each is a Task
(tasks), so the reward worker verifies answers as in RL; the reward is graded, 1.0 for an
exact answer and otherwise the character similarity to it (difflib ratio) times 0.5, so a tiny
model's near misses still rank.

`DomainMixture` puts many domains behind one Task (verify dispatches on the problem's domain).
This module imports nothing heavy: conf/distill.py reads the domain names from it.
"""
from __future__ import annotations

import difflib
import random
from collections.abc import Callable
from typing import Any, Optional

from conf.distill import BUILTIN_DOMAINS
from tasks.base import Problem, Task, load_task

LETTERS = "abcdefgh"
VOWELS = set("ae")


def _shift(k: int) -> Callable[[str], str]:
    return lambda w: "".join(LETTERS[(LETTERS.index(c) + k) % len(LETTERS)] for c in w)


TEXT: dict[str, Callable[[str], str]] = {
    "reverse": lambda w: w[::-1],
    "upper": str.upper,
    "capital": str.capitalize,
    "upper_reverse": lambda w: w[::-1].upper(),
    "first": lambda w: w[0],
    "last": lambda w: w[-1],
    "first2": lambda w: w[:2],
    "last2": lambda w: w[-2:],
    "double": lambda w: "".join(c + c for c in w),
    "repeat": lambda w: w + w,
    "mirror": lambda w: w + w[::-1],
    "sort": lambda w: "".join(sorted(w)),
    "sort_desc": lambda w: "".join(sorted(w, reverse=True)),
    "length": lambda w: str(len(w)),
    "count_a": lambda w: str(w.count("a")),
    "rot1": _shift(1),
    "rot2": _shift(2),
    "unrot1": _shift(-1),
    "no_vowels": lambda w: "".join(c for c in w if c not in VOWELS) or "-",
    "rotl": lambda w: w[1:] + w[0],
    "rotr": lambda w: w[-1] + w[:-1],
    "swap_ends": lambda w: w[-1] + w[1:-1] + w[0],
    "odd": lambda w: w[::2],
}
ARITHMETIC: dict[str, Callable[[int], int]] = {
    **{f"add{k}": lambda n, k=k: n + k for k in (1, 2, 3, 5, 7, 10, 20)},
    **{f"sub{k}": lambda n, k=k: n - k for k in (1, 2, 5, 10)},
    **{f"mul{k}": lambda n, k=k: n * k for k in (2, 3, 4, 5, 10)},
    **{f"mod{k}": lambda n, k=k: n % k for k in (2, 3, 5)},
}


def spell(text: str) -> str:
    """One token per character: "-12" -> "- 1 2"."""
    return " ".join(text)


class TransformDomain(Task):
    """One built-in domain: prompt "<name>: <input>", answer the transform of the input."""

    def __init__(self, name: str):
        if name not in TEXT and name not in ARITHMETIC:
            raise ValueError(f"domain {name!r}: not a built-in domain (known: {', '.join(BUILTIN_DOMAINS)})")
        self.name = name

    def sample(self, rng: random.Random) -> Problem:
        if self.name in TEXT:
            x = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 6)))
            return self.problem(f"{self.name}: {spell(x)}", spell(TEXT[self.name](x)))
        n = rng.randint(0, 99)
        return self.problem(f"{self.name}: {spell(str(n))}", spell(str(ARITHMETIC[self.name](n))))

    def verify(self, problem: Problem, answer_text: str) -> float:
        if not isinstance(answer_text, str):
            return 0.0
        got, want = answer_text.strip()[:200], str(problem.answer)
        if got == want:
            return 1.0
        return 0.5 * difflib.SequenceMatcher(None, got, want).ratio()


class DomainMixture(Task):
    """Many domains behind one Task. domains: name -> task spec (None: the built-in domain of
    that name; else a built-in task name or dotted path, tasks/base.py load_task)."""
    name = "domains"

    def __init__(self, domains: dict[str, Optional[str]]):
        if not domains:
            raise ValueError("domains: need at least one domain")
        self.domains = {d: TransformDomain(d) if spec is None else load_task(spec)
                        for d, spec in domains.items()}
        self.names = sorted(self.domains)

    def sample_domain(self, domain: str, rng: random.Random) -> Problem:
        problem = self.domains[domain].sample(rng)
        problem.meta = {**problem.meta, "domain": domain}
        return problem

    def sample(self, rng: random.Random) -> Problem:
        return self.sample_domain(rng.choice(self.names), rng)

    def verify(self, problem: Problem, answer_text: Any) -> float:
        return self.domains[problem.meta["domain"]].verify(problem, answer_text)

    def answer_text(self, problem: Problem) -> str:
        return self.domains[problem.meta["domain"]].answer_text(problem)
