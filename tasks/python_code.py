"""Function-writing tasks: "Write a Python function add(a, b) that ..."; the answer text is the
function's source (a ```python fence around it is fine), run in the sandbox (tasks/sandbox.py).

The check does not trust asserts inside the sandbox: the code shares the interpreter with them
and can defeat them (a result whose __eq__ is always True). The harness instead prints the
results as JSON and they are compared here, outside, with the expected values, which never
enter the sandbox: reward 1.0 when every case matches exactly (types included, True is not 1),
else 0.0.
"""
from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from typing import Any, Optional

from tasks.arithmetic import LONG, SHORT
from tasks.base import Problem, Task
from tasks.sandbox import run_python

RESULTS_MARK = "@@flashtrain-results@@"  # starts the harness's output line
_FENCE = re.compile(r"```[^\n`]*\n(.*?)(?:```|\Z)", re.S)


@dataclass(frozen=True)
class Function:
    signature: str  # "add(a, b)"
    does: str  # what the prompt says it does, after "that"
    plan: str  # the one-line approach (reasoning at effort 51-75)
    reference: str  # a solution (the canonical answer text)
    cases: tuple  # ((args, expected), ...), all JSON values

    @property
    def name(self) -> str:
        return self.signature.split("(")[0]


FUNCTIONS = (
    Function("add(a, b)", "returns the sum of a and b", "return a + b",
             "def add(a, b):\n    return a + b\n", (([1, 2], 3), ([-5, 5], 0), ([100, 23], 123))),
    Function("reverse_string(s)", "returns the string s reversed", "slice with step -1",
             "def reverse_string(s):\n    return s[::-1]\n",
             ((["abc"], "cba"), ([""], ""), (["ab c"], "c ba"))),
    Function("max_of_list(xs)", "returns the largest number in the non-empty list xs",
             "keep the largest seen",
             "def max_of_list(xs):\n    return max(xs)\n", (([[3, 1, 2]], 3), ([[-5, -2]], -2), ([[7]], 7))),
    Function("min_of_list(xs)", "returns the smallest number in the non-empty list xs",
             "keep the smallest seen",
             "def min_of_list(xs):\n    return min(xs)\n", (([[3, 1, 2]], 1), ([[-5, -2]], -5), ([[7]], 7))),
    Function("is_even(n)", "returns True if the integer n is even, else False", "n % 2 == 0",
             "def is_even(n):\n    return n % 2 == 0\n",
             (([4], True), ([7], False), ([0], True), ([-3], False))),
    Function("factorial(n)", "returns n! for an integer n >= 0", "multiply 1..n, 0! = 1",
             "def factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n"
             "    return result\n",
             (([0], 1), ([1], 1), ([5], 120), ([10], 3628800))),
    Function("fizzbuzz(n)", 'returns "FizzBuzz" if n is divisible by 15, "Fizz" if by 3, "Buzz" if by 5, '
             "else str(n)", "test 15 first, then 3, then 5",
             'def fizzbuzz(n):\n    if n % 15 == 0:\n        return "FizzBuzz"\n    if n % 3 == 0:\n'
             '        return "Fizz"\n    if n % 5 == 0:\n        return "Buzz"\n    return str(n)\n',
             (([3], "Fizz"), ([5], "Buzz"), ([15], "FizzBuzz"), ([7], "7"))),
    Function("count_vowels(s)", "returns how many letters of s are vowels (a, e, i, o, u, either case)",
             "count letters in 'aeiou' after lower()",
             'def count_vowels(s):\n    return sum(c in "aeiou" for c in s.lower())\n',
             ((["hello"], 2), (["AEIOU xyz"], 5), ([""], 0))),
    Function("sum_list(xs)", "returns the sum of the numbers in the list xs (0 if empty)", "add them up",
             "def sum_list(xs):\n    return sum(xs)\n", (([[1, 2, 3]], 6), ([[]], 0), ([[-1, 1, 5]], 5))),
    Function("is_palindrome(s)", "returns True if the string s reads the same backwards, else False",
             "compare s with s[::-1]", "def is_palindrome(s):\n    return s == s[::-1]\n",
             ((["racecar"], True), (["abc"], False), ([""], True), (["abba"], True))),
    Function("fibonacci(n)", "returns the n-th Fibonacci number, with fibonacci(0) = 0 and fibonacci(1) = 1",
             "iterate a, b = b, a + b n times",
             "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
             "    return a\n",
             (([0], 0), ([1], 1), ([10], 55), ([20], 6765))),
    Function("square(n)", "returns n times n", "return n * n",
             "def square(n):\n    return n * n\n", (([3], 9), ([-4], 16), ([0], 0))),
    Function("absolute(n)", "returns the absolute value of the integer n", "negate it if negative",
             "def absolute(n):\n    return -n if n < 0 else n\n", (([-3], 3), ([0], 0), ([5], 5))),
    Function("count_char(s, c)", "returns how many times the character c occurs in the string s",
             "s.count(c)", "def count_char(s, c):\n    return s.count(c)\n",
             ((["banana", "a"], 3), (["", "x"], 0), (["aaa", "b"], 0))),
    Function("unique_sorted(xs)", "returns the distinct values of the list xs in increasing order",
             "sorted(set(xs))", "def unique_sorted(xs):\n    return sorted(set(xs))\n",
             (([[3, 1, 3, 2]], [1, 2, 3]), ([[]], []), ([[5, 5]], [5]))),
    Function("gcd(a, b)", "returns the greatest common divisor of the positive integers a and b",
             "Euclid: a, b = b, a % b until b is 0",
             "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n",
             (([12, 18], 6), ([7, 5], 1), ([10, 10], 10))),
    Function("word_count(s)", "returns the number of whitespace-separated words in the string s",
             "len(s.split())", "def word_count(s):\n    return len(s.split())\n",
             ((["hello world"], 2), (["  a  b c "], 3), ([""], 0))),
)


class PythonFunctions(Task):
    name = "python"

    def __init__(self, wall_s: float = 5.0, cpu_s: float = 2.0, memory_mb: int = 256):
        if not (wall_s > 0 and cpu_s > 0 and memory_mb >= 32):
            raise ValueError(f"python: need wall_s > 0, cpu_s > 0, memory_mb >= 32; got {wall_s}, {cpu_s}, "
                             f"{memory_mb}")
        self.limits = {"wall_s": wall_s, "cpu_s": cpu_s, "memory_mb": memory_mb}

    def sample(self, rng: random.Random) -> Problem:
        f = rng.choice(FUNCTIONS)
        prompt = f"Write a Python function {f.signature} that {f.does}."
        cases = [[list(args), expected] for args, expected in f.cases]
        return self.problem(prompt, {"function": f.name, "cases": cases, "reference": f.reference})

    def tests(self, problem: Problem) -> str:
        """The harness run after the answer's code: the function on every case's arguments, the
        results printed as one JSON line."""
        args = json.dumps([args for args, _ in problem.answer["cases"]])
        return (f"import json as _json\n"
                f"_results = [{problem.answer['function']}(*_args) for _args in _json.loads({args!r})]\n"
                f"print({RESULTS_MARK!r} + _json.dumps(_results))\n")

    def verify(self, problem: Problem, answer_text: str) -> float:
        if not isinstance(answer_text, str) or not answer_text.strip():
            return 0.0
        result = run_python(extract_code(answer_text), self.tests(problem), **self.limits)
        if not result.passed:
            return 0.0
        lines = [line for line in result.stdout.splitlines() if line.startswith(RESULTS_MARK)]
        expected = json.dumps([expected for _, expected in problem.answer["cases"]])
        return 1.0 if lines and _canonical(lines[-1][len(RESULTS_MARK):]) == expected else 0.0

    def reasoning(self, problem: Problem, effort: int) -> str:
        f = next(f for f in FUNCTIONS if f.name == problem.answer["function"])
        if effort <= SHORT:
            return ""
        if effort <= LONG:
            return f.plan
        args, expected = f.cases[0]
        return f"{f.plan}\ncheck: {f.name}({', '.join(map(repr, args))}) == {expected!r}"

    def answer_text(self, problem: Problem) -> str:
        return problem.answer["reference"]


def extract_code(text: str) -> str:
    """The first fenced block's content if there is one, else the whole text."""
    match = _FENCE.search(text)
    return match.group(1) if match else text


def _canonical(payload: str) -> Optional[str]:
    """JSON text re-serialised the way the expected values are, or None if it is not JSON."""
    try:
        value: Any = json.loads(payload)
        return json.dumps(value)
    except (ValueError, RecursionError):
        return None
