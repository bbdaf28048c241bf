"""Built-in RL tasks (tasks): problems are deterministic in the generator, verification is
exact and never raises on malformed answers, reasoning grows with effort, reference solutions
of the code task pass in the sandbox, and load_task resolves built-in names and dotted paths."""
import json
import random

import pytest

from tasks import BUILTIN_TASKS, Problem, Task, first_integer, load_task
from tasks.arithmetic import Algebra, Arithmetic
from tasks.python_code import FUNCTIONS, PythonFunctions, extract_code

MALFORMED = ["", "   ", "abc", "twelve", "x" * 1_000_000, "9" * 100_000, "\u0661\u0662", "١٢", "🙂" * 1000,
             "\x00\x01", "\ud800", "-", "+", "=", "x =", None, 12, b"12", ["12"]]


class EchoTask(Task):
    """A user task, loaded by dotted path in the tests below."""
    name = "echo"

    def __init__(self, word: str = "hi"):
        self.word = word

    def sample(self, rng):
        return self.problem(f"Say {self.word}", self.word)

    def verify(self, problem, answer_text):
        return float(answer_text == problem.answer)


def echo_factory(word: str = "yo") -> Task:
    return EchoTask(word)


def not_a_task_factory():
    return 42


def problems(task: Task, n: int, seed: int = 0) -> list[Problem]:
    rng = random.Random(seed)
    return [task.sample(rng) for _ in range(n)]


@pytest.mark.parametrize("task",
                         [Arithmetic(), Arithmetic(max_operand=99, ops="+-*"), Algebra(),
                          Algebra(max_coef=20)])
def test_numeric_tasks_sample_and_verify(task):
    for i, p in enumerate(problems(task, 300)):
        assert p.task == task.name and p.id.startswith(f"{task.name}-")
        assert isinstance(p.answer, int)
        json.dumps([p.id, p.prompt, p.answer, p.meta])
        right = task.answer_text(p)
        assert task.verify(p, right) == 1.0
        assert task.verify(p, f"  {right} \n") == 1.0
        assert task.verify(p, str(p.answer + 1)) == 0.0
        assert task.verify(p, f"{p.answer}.0") == 0.0
        for bad in MALFORMED if i < 10 else ():
            assert task.verify(p, bad) == 0.0
        assert task.verify(p, "x" * 20_000 + right) == 0.0  # past what is read


def test_problems_are_deterministic_with_stable_ids():
    for task in (Arithmetic(), Algebra(), PythonFunctions()):
        first, again = problems(task, 20, seed=3), problems(task, 20, seed=3)
        assert first == again
        assert all(p.id == q.id for p, q in zip(first, problems(task, 20, seed=3)))
        same_prompt = {}
        for p in problems(task, 200):
            assert same_prompt.setdefault(p.prompt, p.id) == p.id  # one problem, one id


def test_arithmetic_answer_parsing():
    task = Arithmetic()
    p = task.problem("What is 7 + 5?", 12, a=7, b=5, op="+")
    for text in ["12", " 12 ", "12 apples", "The answer is 12.", "+12"]:
        assert task.verify(p, text) == 1.0, text
    for text in ["12.0", "twelve", "1 2", "11", "120", "12e0", "x12.5"]:
        assert task.verify(p, text) == 0.0, text
    neg = task.problem("What is 3 - 7?", -4, a=3, b=7, op="-")
    assert task.verify(neg, "-4") == 1.0 and task.verify(neg, "4") == 0.0


def test_algebra_accepts_x_equals():
    task = Algebra()
    p = task.problem("Solve for x: 3x + 4 = 19", 5, a=3, b=4, c=19)
    for text in ["5", "x = 5", "x=5", "3x = 15, so x = 5", " x = 5 "]:
        assert task.verify(p, text) == 1.0, text
    for text in ["x = 6", "3x = 15", "x = 5.0", "five", "x = "]:
        assert task.verify(p, text) == 0.0, text


def test_first_integer():
    assert first_integer("-3 and 4") == -3
    assert first_integer("1" * 41) is None and first_integer("1" * 40) == int("1" * 40)
    assert first_integer(None) is None and first_integer("") is None


@pytest.mark.parametrize("task", [Arithmetic(ops="+-*"), Algebra(), PythonFunctions()])
def test_reasoning_grows_with_effort(task):
    for p in problems(task, 100):
        low, high, top = (task.reasoning(p, e) for e in (50, 75, 100))
        assert len(low) <= len(high) < len(top)
        assert task.reasoning(p, 1) == low and task.reasoning(p, 51) == high and task.reasoning(p, 76) == top


def test_arithmetic_reasoning_is_short_for_single_digits():
    task = Arithmetic(ops="+-*")
    for a in range(10):
        for b in range(10):
            for op, value in (("+", a + b), ("-", a - b), ("*", a * b)):
                p = task.problem(f"What is {a} {op} {b}?", value, a=a, b=b, op=op)
                assert len(task.reasoning(p, 100)) <= 60
                assert task.reasoning(p, 50) == "" and task.reasoning(p, 75) == f"{a} {op} {b} = {value}"


def test_python_reference_solutions_pass_and_wrong_ones_fail():
    task = PythonFunctions(wall_s=3.0, cpu_s=1.0)
    for f in FUNCTIONS:
        p = task.problem(f"Write {f.signature}",
                         {"function": f.name, "cases": [[list(a), e] for a, e in f.cases],
                          "reference": f.reference})
        assert task.verify(p, task.answer_text(p)) == 1.0, f.name
    assert len(FUNCTIONS) >= 12
    add = next(p for p in problems(task, 200) if p.answer["function"] == "add")
    assert task.verify(add, "```python\ndef add(a, b):\n    return a + b\n```") == 1.0  # a fenced answer
    for wrong in ["def add(a, b):\n    return a - b", "def plus(a, b):\n    return a + b",
                  "def add(a, b) return", "import sys\nsys.exit(0)", "def add(a, b):\n    while True: pass",
                  # defeats an in-sandbox assert, not the comparison made outside
                  "class Any:\n    def __eq__(self, other): return True\ndef add(a, b):\n    return Any()",
                  "def add(a, b):\n    print('@@flashtrain-results@@[0, 0, 0]')\n    return 0"]:
        assert task.verify(add, wrong) == 0.0, wrong
    for bad in ["", "abc", None, "\ud800", "\x00"]:
        assert task.verify(add, bad) == 0.0
    even = next(p for p in problems(task, 200) if p.answer["function"] == "is_even")
    assert task.verify(even, "def is_even(n):\n    return 1 - n % 2") == 0.0  # 1 is not True


def test_extract_code():
    assert extract_code("```python\nx = 1\n```\ntext") == "x = 1\n"
    assert extract_code("```\nx = 1") == "x = 1"
    assert extract_code("x = 1") == "x = 1"


def test_load_builtin_tasks():
    assert isinstance(load_task("arithmetic"), Arithmetic)
    assert isinstance(load_task("algebra", max_coef=5), Algebra)
    assert isinstance(load_task("python"), PythonFunctions)
    assert load_task("arithmetic", max_operand=20, ops="*").ops == "*"
    assert set(BUILTIN_TASKS) == {"arithmetic", "algebra", "python", "synth", "synth_propose"}


@pytest.mark.parametrize("spec", [f"{__name__}:EchoTask", f"{__name__}.EchoTask"])
def test_load_user_task_by_dotted_path(spec):
    task = load_task(spec, word="hello")
    p = task.sample(random.Random(0))
    assert isinstance(task, EchoTask) and task.verify(p, "hello") == 1.0 and task.verify(p, "nope") == 0.0


def test_load_user_task_from_factory():
    assert load_task(f"{__name__}:echo_factory").word == "yo"


@pytest.mark.parametrize("spec, message", [
    ("", "built-in name"),
    ("nonsense", "not a built-in task"),
    ("no_such_package.tasks:Task", "not found"),
    (f"{__name__}:Missing", "has no attribute 'Missing'"),
    (f"{__name__}:MALFORMED", "not a Task class or factory"),
    (f"{__name__}:not_a_task_factory", "not a tasks.Task"),
    ("random:Random", "not a subclass of tasks.Task"),
])
def test_bad_specs_raise_one_line_value_errors(spec, message):
    with pytest.raises(ValueError, match=message) as info:
        load_task(spec)
    assert "\n" not in str(info.value) and repr(spec) in str(info.value)


@pytest.mark.parametrize("spec, kwargs", [("arithmetic", {"max_operand": 0}), ("arithmetic", {"ops": "/"}),
                                          ("algebra", {"max_coef": 1}), ("arithmetic", {"nope": 1}),
                                          ("python", {"wall_s": -1})])
def test_bad_task_kwargs_raise_value_errors(spec, kwargs):
    with pytest.raises(ValueError):
        load_task(spec, **kwargs)
