"""Task synthesis (SPEC §10): the policy writes (problem, environment, verifier) triples for
Python function tasks; the sandbox (tasks/sandbox.py) keeps the ones that are verifiable,
solvable and non-trivial; the kept ones become an RL task source.

A triple is the answer text of a proposal prompt, in exactly this layout:

    Problem: Write a Python function add_3(x) that returns x plus 3.
    Solution:
    ```python
    def add_3(x):
        return x + 3
    ```
    Tests:
    ```python
    assert add_3(1) == 4
    ```

The problem is what a solver is asked; the solution is the environment's ground truth (a
reference that must pass); the tests are the verifier, run after a solver's code in the sandbox.
`parse_triple` is strict: anything else is a ParseError with a reason, counted and dropped.

Filters, each in the sandbox under the given deadlines (`check_triple`):
  verifiable   reference + tests give the same verdict twice and neither run hits a limit
  solvable     reference + tests pass
  non-trivial  tests fail when no solution is defined, and for every stub with the solution's
               name that returns a constant (None, 0, 1, -1, True, False, "", [], {}, and each
               literal the tests contain: tests whose every expected value is the same literal
               are passed by that constant) or its first argument unchanged
Proposer rewards (`proposer_reward`): correctness c (1 when the triple passed every filter,
else 0) and difficulty d = 4 p (1 - p) from the solver's pass rate p over k attempts (0 for a
task every attempt solves or none does, 1 at p = 1/2); the reward is c * ((1 - w) + w * d),
w = the difficulty weight.

Tasks:
  synth_propose  (ProposeTasks) proposal prompts; verify = the correctness reward. Its answer
                 text is a templated triple (TEMPLATES, offline and deterministic), so the
                 built-in SFT set can teach the format (`sft.builtin_task=synth_propose`); with
                 solve_fraction > 0 that share of its problems are the templated problems
                 themselves, to be solved.
  synth          (SynthesizedTasks) the solver's task: the problems of a pool file written by
                 `flashtrain synth` (or, with no pool, the templated problems); verify runs the
                 answer's code and the triple's tests in the sandbox: 1.0 if they pass, else 0.0.
rl/replay.py re-serves problems the solver failed (rl.replay_*), for this task or any other.

The tests are assert statements sharing the interpreter with the solver's code, so code that
returns an object whose __eq__ is always True defeats them; tasks/python_code.py compares
outputs outside the sandbox instead, which free-form model-written tests do not allow.
"""
from __future__ import annotations

import ast
import json
import random
import re
import secrets
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from tasks.base import Problem, Task
from tasks.python_code import extract_code
from tasks.sandbox import run_python

# the number only makes prompts distinct (the SFT eval holds out prompts by their text)
PROPOSE_PROMPT = "Propose Python task {number} about {topic}: a problem, a reference solution and tests."
MAX_PROBLEM_CHARS = 1000
MAX_CODE_CHARS = 4000
_TRIPLE = re.compile(r"\s*Problem:[ \t]*(?P<problem>[^\n]*)\n"
                     r"Solution:[ \t]*\n```python[ \t]*\n(?P<solution>.*?)```[ \t]*\n"
                     r"Tests:[ \t]*\n```python[ \t]*\n(?P<tests>.*?)```\s*", re.S)
STUB_RETURNS = ("None", "0", "1", "-1", "True", "False", "''", "[]", "{}")
FILTERS = ("verifiable", "solvable", "nontrivial")
MAX_LITERALS = 32  # stubs returning the tests' own literals, at most


# ------------------------------------------------------------------------------ the triple
@dataclass(frozen=True)
class Triple:
    problem: str  # what the solver is asked
    solution: str  # the reference (ground truth)
    tests: str  # the verifier: asserts run after the code under test
    function: str  # the name the solution defines and the tests call

    def text(self) -> str:
        """The answer text `parse_triple` reads back."""
        return (f"Problem: {self.problem}\nSolution:\n```python\n{self.solution}```\n"
                f"Tests:\n```python\n{self.tests}```\n")


class ParseError(ValueError):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason  # a short label, counted per reason


def parse_triple(text: Any) -> Triple:
    """The triple in `text` (the module docstring's layout), or ParseError(reason): "not_text",
    "layout", "too_long", "solution_syntax", "tests_syntax", "no_function", "no_assert",
    "tests_skip_function"."""
    if not isinstance(text, str):
        raise ParseError("not_text")
    match = _TRIPLE.fullmatch(text)
    if match is None:
        raise ParseError("layout")
    problem, solution, tests = match.group("problem").strip(), match.group("solution"), match.group("tests")
    if not problem or len(problem) > MAX_PROBLEM_CHARS or max(len(solution), len(tests)) > MAX_CODE_CHARS:
        raise ParseError("too_long" if problem else "layout")
    solution_tree, tests_tree = _parse_code(solution, "solution"), _parse_code(tests, "tests")
    functions = [n.name for n in solution_tree.body if isinstance(n, ast.FunctionDef)]
    if not functions:
        raise ParseError("no_function")
    if not any(isinstance(n, ast.Assert) for n in ast.walk(tests_tree)):
        raise ParseError("no_assert")
    called = {n.func.id for n in ast.walk(tests_tree)
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    function = functions[-1]  # the last one: helpers come first
    if function not in called:
        raise ParseError("tests_skip_function")
    return Triple(problem, solution, tests, function)


def _parse_code(code: str, what: str) -> ast.Module:
    try:
        return ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ParseError(f"{what}_syntax") from None


# ------------------------------------------------------------------------------ the filters
@dataclass
class Verdict:
    verifiable: bool = False
    solvable: bool = False
    nontrivial: bool = False
    reason: str = ""  # the first filter that failed and why ("" when all passed)
    sandbox_s: float = 0.0  # wall time of the sandbox runs

    @property
    def valid(self) -> bool:
        return self.verifiable and self.solvable and self.nontrivial


def check_triple(triple: Triple, wall_s: float = 5.0, cpu_s: float = 2.0, memory_mb: int = 256) -> Verdict:
    """Run the filters in order (FILTERS), stopping at the first that fails."""
    limits = {"wall_s": wall_s, "cpu_s": cpu_s, "memory_mb": memory_mb}
    verdict = Verdict()
    first, second = (run_python(triple.solution, triple.tests, **limits) for _ in range(2))
    verdict.sandbox_s = first.wall_s + second.wall_s
    hit_limit = [r.status for r in (first, second) if r.status not in ("ok", "failed", "error")]
    if hit_limit:
        verdict.reason = f"verifiable: reference run hit {hit_limit[0]}"
        return verdict
    if first.passed != second.passed:
        verdict.reason = "verifiable: two runs gave different verdicts"
        return verdict
    verdict.verifiable = True
    if not first.passed:
        verdict.reason = "solvable: the reference fails its tests"
        return verdict
    verdict.solvable = True
    passed_by, seconds = trivial_solutions_passing(triple, limits)
    verdict.sandbox_s += seconds
    if passed_by:
        verdict.reason = f"nontrivial: passed by {passed_by[0]}"
        return verdict
    verdict.nontrivial = True
    return verdict


def trivial_solutions_passing(triple: Triple, limits: dict) -> tuple[list[str], float]:
    """-> (the trivial solutions the tests accept, sandbox seconds). One sandbox run execs the
    tests once per candidate in a fresh namespace: no solution at all, then each stub. A run that
    does not report (a limit hit, a test that kills the interpreter) counts as accepting
    "unverified": a verifier that cannot be checked is not kept."""
    mark = f"@@trivial-{secrets.token_hex(8)}@@"
    stub = f"def {triple.function}(*args, **kwargs):\n    return {{}}\n"
    values = list(dict.fromkeys([*STUB_RETURNS, *test_literals(triple.tests)]))
    stubs = ["", *(stub.format(value) for value in values), stub.format("args[0] if args else None")]
    names = ["no solution", *(f"a stub returning {v}" for v in values), "a stub returning its argument"]
    harness = (f"import json as _json\n_accepted = []\n"
               f"for _stub in _json.loads({json.dumps(stubs)!r}):\n"
               f"    _ns = {{'__name__': '__main__'}}\n"
               f"    try:\n"
               f"        exec(_stub, _ns)\n"
               f"        exec({triple.tests!r}, _ns)\n"
               f"        _accepted.append(True)\n"
               f"    except BaseException:\n"
               f"        _accepted.append(False)\n"
               f"print({mark!r} + _json.dumps(_accepted))\n")
    result = run_python(harness, "", **limits)
    lines = [line for line in result.stdout.splitlines() if line.startswith(mark)]
    try:
        accepted = json.loads(lines[-1][len(mark):]) if result.passed and lines else None
    except ValueError:
        accepted = None
    if not isinstance(accepted, list) or len(accepted) != len(stubs):
        return ["unverified (the trivial-solution run did not report)"], result.wall_s
    return [name for name, ok in zip(names, accepted) if ok is True], result.wall_s


def test_literals(tests: str) -> list[str]:
    """The source of every literal in `tests` (numbers, strings, and lists, tuples, sets and
    dicts of them, negative numbers included), in order, at most MAX_LITERALS."""
    try:
        tree = ast.parse(tests)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    out: list[str] = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Constant, ast.List, ast.Tuple, ast.Set, ast.Dict, ast.UnaryOp)):
            continue
        try:
            ast.literal_eval(node)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            continue
        source = ast.unparse(node)
        if source not in out and len(source) <= 200:
            out.append(source)
        if len(out) == MAX_LITERALS:
            break
    return out


# ------------------------------------------------------------------------------ rewards
def difficulty_reward(pass_rate: float) -> float:
    """4 p (1 - p): 0 when every solver attempt passes or none does, 1 at p = 1/2."""
    if not 0.0 <= pass_rate <= 1.0:
        raise ValueError(f"pass rate {pass_rate} is outside [0, 1]")
    return 4.0 * pass_rate * (1.0 - pass_rate)


def proposer_reward(valid: bool, pass_rate: Optional[float], difficulty_weight: float = 0.5) -> float:
    """c * ((1 - w) + w * d): c = 1 for a triple that passed every filter, d the difficulty
    reward of the solver's pass rate (None: not measured, d = 0), w the difficulty weight."""
    if not 0.0 <= difficulty_weight <= 1.0:
        raise ValueError(f"difficulty weight {difficulty_weight} is outside [0, 1]")
    if not valid:
        return 0.0
    d = 0.0 if pass_rate is None else difficulty_reward(pass_rate)
    return (1.0 - difficulty_weight) + difficulty_weight * d


# ------------------------------------------------------------------------------ templates
@dataclass(frozen=True)
class Template:
    topic: str
    name: str  # function name pattern, {k} filled
    params: str  # "x" or "s, c"
    does: str  # "returns x plus {k}"
    body: str  # the return expression, {k} filled
    ks: tuple  # the constant's range
    inputs: Callable[[random.Random, Any], tuple]  # one case's arguments


def _ints(rng: random.Random, k: Any) -> tuple:
    return (rng.randint(-20, 20),)


def _words(rng: random.Random, k: Any) -> tuple:
    return ("".join(rng.choice("abcde") for _ in range(rng.randint(0, 6))),)


def _lists(rng: random.Random, k: Any) -> tuple:
    return ([rng.randint(-9, 9) for _ in range(rng.randint(0, 5))],)


TEMPLATES = (
    Template("integers", "add_{k}", "x", "returns x plus {k}", "x + {k}", (1, 9), _ints),
    Template("integers", "times_{k}", "x", "returns x times {k}", "x * {k}", (2, 9), _ints),
    Template("integers", "minus_{k}", "x", "returns x minus {k}", "x - {k}", (1, 9), _ints),
    Template("integers", "mod_{k}", "x", "returns x modulo {k}", "x % {k}", (2, 9), _ints),
    Template("integers", "is_multiple_of_{k}", "x", "returns True if x is a multiple of {k}, else False",
             "x % {k} == 0", (2, 5), _ints),
    Template("integers", "at_least_{k}", "x", "returns the larger of x and {k}", "max(x, {k})", (-5, 5),
             _ints),
    Template("strings", "repeat_{k}", "s", "returns the string s repeated {k} times", "s * {k}", (2, 4),
             _words),
    Template("strings", "first_{k}", "s", "returns the first {k} characters of the string s", "s[:{k}]",
             (1, 4), _words),
    Template("strings", "count_a_{k}", "s", "returns how many times 'a' occurs in s, plus {k}",
             "s.count('a') + {k}", (1, 5), _words),
    Template("lists", "count_over_{k}", "xs", "returns how many numbers in the list xs are greater than {k}",
             "sum(1 for v in xs if v > {k})", (-3, 3), _lists),
    Template("lists", "sum_over_{k}", "xs", "returns the sum of the numbers in the list xs greater than {k}",
             "sum(v for v in xs if v > {k})", (-3, 3), _lists),
    Template("lists", "last_{k}", "xs", "returns the last {k} items of the list xs", "xs[-{k}:]", (1, 3),
             _lists),
)
TOPICS = tuple(sorted({t.topic for t in TEMPLATES}))
CASES = 3


def _name(template: Template, k: int) -> str:
    return template.name.format(k=k if k >= 0 else f"neg{-k}")


def templated_triple(rng: random.Random, topic: Optional[str] = None) -> Triple:
    """A valid triple from TEMPLATES (of `topic`, if given), its expected values computed by the
    template's own expression: a non-trivial set of CASES cases (redrawn until no constant or
    identity stub could pass them)."""
    template = rng.choice([t for t in TEMPLATES if topic in (None, t.topic)])
    k = rng.randint(*template.ks)
    name, body = _name(template, k), template.body.format(k=k)
    solution = f"def {name}({template.params}):\n    return {body}\n"
    namespace: dict = {}
    exec(solution, namespace)  # the template's own code: expected values are the reference's by construction
    function = namespace[name]
    for _ in range(1000):
        cases = [template.inputs(rng, k) for _ in range(CASES)]
        expected = [function(*args) for args in cases]
        distinct = len({json.dumps(e) for e in expected}) > 1
        if distinct and any(e != args[0] for e, args in zip(expected, cases)):
            break
    else:  # every template's inputs vary enough that this is unreachable in practice
        raise RuntimeError(f"no non-trivial cases for {name}")
    tests = "".join(f"assert {name}({', '.join(map(repr, args))}) == {e!r}\n"
                    for args, e in zip(cases, expected))
    return Triple(f"Write a Python function {name}({template.params}) that {template.does.format(k=k)}.",
                  solution, tests, name)


# ------------------------------------------------------------------------------ the tasks
class _Sandboxed:
    def __init__(self, wall_s: float, cpu_s: float, memory_mb: int):
        if not (wall_s > 0 and cpu_s > 0 and memory_mb >= 32):
            raise ValueError(f"{self.name}: need wall_s > 0, cpu_s > 0, memory_mb >= 32; got {wall_s}, "
                             f"{cpu_s}, {memory_mb}")
        self.limits = {"wall_s": wall_s, "cpu_s": cpu_s, "memory_mb": memory_mb}

    def passes_tests(self, answer_text: Any, tests: str) -> float:
        if not isinstance(answer_text, str) or not answer_text.strip():
            return 0.0
        return 1.0 if run_python(extract_code(answer_text), tests, **self.limits).passed else 0.0


class ProposeTasks(_Sandboxed, Task):
    """Proposal prompts (a topic each); the answer text of one is a templated triple; verify is
    the proposer's correctness reward (1.0 for a triple that parses and passes every filter).
    solve_fraction: the share of problems that are templated problems to solve instead (verify:
    the answer's code passes the template's tests)."""
    name = "synth_propose"

    def __init__(self, solve_fraction: float = 0.0, wall_s: float = 5.0, cpu_s: float = 2.0,
                 memory_mb: int = 256):
        super().__init__(wall_s, cpu_s, memory_mb)
        if not 0.0 <= solve_fraction <= 1.0:
            raise ValueError(f"synth_propose: solve_fraction={solve_fraction} is outside [0, 1]")
        self.solve_fraction = solve_fraction

    def sample(self, rng: random.Random) -> Problem:
        solve = rng.random() < self.solve_fraction
        topic, number = rng.choice(TOPICS), rng.randrange(10_000)
        triple = templated_triple(rng, topic)
        if solve:
            return self.problem(triple.problem, {"kind": "solve", **asdict(triple)})
        return self.problem(PROPOSE_PROMPT.format(number=number, topic=topic),
                            {"kind": "propose", **asdict(triple)})

    def verify(self, problem: Problem, answer_text: str) -> float:
        if problem.answer["kind"] == "solve":
            return self.passes_tests(answer_text, problem.answer["tests"])
        try:
            triple = parse_triple(answer_text)
        except ParseError:
            return 0.0
        return 1.0 if check_triple(triple, **self.limits).valid else 0.0

    def answer_text(self, problem: Problem) -> str:
        answer = problem.answer
        if answer["kind"] == "solve":
            return answer["solution"]
        return Triple(answer["problem"], answer["solution"], answer["tests"], answer["function"]).text()


class SynthesizedTasks(_Sandboxed, Task):
    """The solver's task over synthesised triples: `pool` is a JSONL file of triples (what
    `flashtrain synth` writes, rows with problem, solution, tests, function; only rows whose
    "valid" is true, or that have no "valid", are used), None for the templated problems.
    verify: 1.0 when the answer's code passes the triple's tests in the sandbox."""
    name = "synth"

    def __init__(self, pool: Optional[str] = None, wall_s: float = 5.0, cpu_s: float = 2.0,
                 memory_mb: int = 256):
        super().__init__(wall_s, cpu_s, memory_mb)
        self.pool = None if pool is None else load_pool(pool)

    def sample(self, rng: random.Random) -> Problem:
        triple = rng.choice(self.pool) if self.pool is not None else templated_triple(rng)
        return self.problem(triple.problem, asdict(triple))

    def verify(self, problem: Problem, answer_text: str) -> float:
        return self.passes_tests(answer_text, problem.answer["tests"])

    def answer_text(self, problem: Problem) -> str:
        return problem.answer["solution"]


def load_pool(path: str) -> list[Triple]:
    """The valid triples of a pool file; ValueError naming the file and line when it is not one."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"synth: pool {path!r} is not a file (write one with `flashtrain synth`)")
    triples = []
    for n, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if row.get("valid", True):
                triples.append(Triple(*(str(row[k]) for k in ("problem", "solution", "tests", "function"))))
        except (ValueError, KeyError, AttributeError, TypeError) as e:
            raise ValueError(f"synth: pool {path} line {n} is not a triple row ({type(e).__name__}: {e})"
                             ) from None
    if not triples:
        raise ValueError(f"synth: pool {path} holds no valid triple")
    return triples
