"""Arithmetic ("What is 7 + 5?") and linear equations ("Solve for x: 3x + 4 = 19") with integer
answers, checked exactly: reward 1.0 when the first integer of the answer text (for equations,
the number after "x =" if there is one) is the answer, else 0.0.

Worked reasoning by effort, three lengths a tiny model can learn to tell apart:
  1-50    none
  51-75   one line            "7 + 5 = 12"
  76-100  a chain and a check "7 + 5 = 7 + 3 + 2 = 10 + 2 = 12\\ncheck: 12 - 5 = 7"
"""
from __future__ import annotations

import operator
import random
import re
from typing import Any

from tasks.base import Problem, Task, first_integer

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
SHORT, LONG = 50, 75  # effort above SHORT: one line of reasoning; above LONG: the worked chain


def _check_int(task: str, name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{task}: {name} must be an integer >= {low}, got {value!r}")
    return value


class Arithmetic(Task):
    name = "arithmetic"

    def __init__(self, max_operand: int = 9, ops: str = "+-"):
        self.max_operand = _check_int(self.name, "max_operand", max_operand, 1)
        if not isinstance(ops, str) or not ops or set(ops) - set(OPS):
            raise ValueError(f"arithmetic: ops must be a non-empty string of {''.join(OPS)}, got {ops!r}")
        self.ops = "".join(dict.fromkeys(ops))  # each operator once, so none is drawn more often

    def sample(self, rng: random.Random) -> Problem:
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        op = rng.choice(self.ops)
        return self.problem(f"What is {a} {op} {b}?", OPS[op](a, b), a=a, b=b, op=op)

    def verify(self, problem: Problem, answer_text: str) -> float:
        value = first_integer(answer_text)
        return 1.0 if value is not None and value == problem.answer else 0.0

    def reasoning(self, problem: Problem, effort: int) -> str:
        a, b, op, result = problem.meta["a"], problem.meta["b"], problem.meta["op"], problem.answer
        if effort <= SHORT:
            return ""
        if effort <= LONG:
            return f"{a} {op} {b} = {result}"
        return "\n".join(_worked(a, b, op, result))


def _worked(a: int, b: int, op: str, result: int) -> list[str]:
    """The chain for effort 76-100: make a ten (+), flip the sign (-), tens and units or repeated
    addition (*); then a check (the inverse operation, or the swapped product) where it stays short."""
    if op == "+":
        k = 10 - a % 10  # what takes a to the next ten
        if 0 < k < b:
            return [f"{a} + {b} = {a} + {k} + {b - k} = {a + k} + {b - k} = {result}",
                    f"check: {result} - {b} = {a}"]
        return [f"{a} + {b} = {result}", f"check: {result} - {b} = {a}"]
    if op == "-":
        step = f"{a} - {b} = -({b} - {a}) = {result}" if a < b else f"{a} - {b} = {result}"
        return [step, f"check: {result} + {b} = {a}"]
    big, small = max(a, b), min(a, b)
    if small < 2:
        return [f"{a} * {b} = {result}", f"check: {small} * {big} = {result}"]
    if big >= 10:
        tens, units = big - big % 10, big % 10
        return [f"{a} * {b} = {tens} * {small} + {units} * {small} = {tens * small} + {units * small} = "
                f"{result}"]
    return [f"{a} * {b} = {' + '.join([str(big)] * small)} = {result}"]


_X_EQUALS = re.compile(r"(?<![A-Za-z0-9_])x\s*=\s*([-+]?[0-9]+(?:\.[0-9]+)?)")


class Algebra(Task):
    name = "algebra"

    def __init__(self, max_coef: int = 9):
        self.max_coef = _check_int(self.name, "max_coef", max_coef, 2)

    def sample(self, rng: random.Random) -> Problem:
        a, x, b = (rng.randint(2, self.max_coef), rng.randint(0, self.max_coef),
                   rng.randint(-self.max_coef, self.max_coef))
        c = a * x + b
        lhs = f"{a}x" if b == 0 else f"{a}x {'+' if b > 0 else '-'} {abs(b)}"
        return self.problem(f"Solve for x: {lhs} = {c}", x, a=a, b=b, c=c)

    def verify(self, problem: Problem, answer_text: str) -> float:
        value = first_integer(answer_text, _X_EQUALS)
        return 1.0 if value is not None and value == problem.answer else 0.0

    def reasoning(self, problem: Problem, effort: int) -> str:
        a, b, c, x = problem.meta["a"], problem.meta["b"], problem.meta["c"], problem.answer
        if effort <= SHORT:
            return ""
        if effort <= LONG:
            return f"x = {c} / {a} = {x}" if b == 0 else f"{a}x = {c - b}, x = {x}"
        undo = "-" if b > 0 else "+"
        lines = [] if b == 0 else [f"{a}x = {c} {undo} {abs(b)} = {c - b}"]
        check = f"{a} * {x}" if b == 0 else f"{a} * {x} {'+' if b > 0 else '-'} {abs(b)}"
        return "\n".join([*lines, f"x = {c - b} / {a} = {x}", f"check: {check} = {c}"])
