"""What a verifiable RL task is: it samples problems (a user-turn prompt and a ground-truth
answer) and scores a model's answer text in [0, 1].

The answer text is what follows <|/think|> in the model's response (data/chat.py,
ChatFormat.parse_response). A task may also write worked reasoning for a problem, longer at a
higher reasoning effort (1-100), and the canonical answer text: the built-in SFT set
(data/sft.py) is made of these.

Users plug in their own task with `rl.task=package.module:ClassName` (or a zero-argument
factory); `load_task` resolves it, with `rl.task_kwargs` as keyword arguments.
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import random
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Optional

BUILTIN_TASKS = {
    "arithmetic": "tasks.arithmetic:Arithmetic",
    "algebra": "tasks.arithmetic:Algebra",
    "python": "tasks.python_code:PythonFunctions",
    "synth": "tasks.synthesis:SynthesizedTasks",
    "synth_propose": "tasks.synthesis:ProposeTasks",
}


@dataclass
class Problem:
    id: str  # stable: derived from the task and the problem's content (Task.problem)
    prompt: str  # the user-turn text
    answer: Any  # the ground truth, JSON-serialisable
    task: str  # the task's name
    meta: dict = field(default_factory=dict)


class Task(ABC):
    name: str = "task"

    @abstractmethod
    def sample(self, rng: random.Random) -> Problem:
        """A problem drawn from `rng` only (the same generator state gives the same problem)."""

    @abstractmethod
    def verify(self, problem: Problem, answer_text: str) -> float:
        """The reward in [0, 1] of `answer_text` for `problem`. Must not raise for any model
        output, however malformed (empty, huge, binary, not even a str)."""

    def reasoning(self, problem: Problem, effort: int) -> str:
        """Worked reasoning for `problem` whose length grows with `effort` (1-100)."""
        return ""

    def answer_text(self, problem: Problem) -> str:
        """The canonical answer text (what a perfect response puts after <|/think|>)."""
        return str(problem.answer)

    def problem(self, prompt: str, answer: Any, **meta: Any) -> Problem:
        """A Problem whose id is a digest of its task, prompt and answer: the same problem gets
        the same id however and wherever it was drawn."""
        digest = hashlib.sha1(json.dumps([self.name, prompt, answer], sort_keys=True).encode()).hexdigest()
        return Problem(f"{self.name}-{digest[:12]}", prompt, answer, self.name, meta)


def load_task(spec: str, **kwargs: Any) -> Task:
    """A built-in task name (BUILTIN_TASKS) or a dotted path, "package.module:ClassName" or
    "package.module.ClassName", to a Task subclass or to a factory returning a Task; `kwargs`
    go to its constructor. A bad spec raises ValueError naming it and what is wrong."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"task {spec!r}: expected a built-in name ({', '.join(BUILTIN_TASKS)}) or a dotted "
                         "path 'package.module:ClassName'")
    target = BUILTIN_TASKS.get(spec.strip(), spec.strip())
    module_name, sep, attr = target.partition(":")
    if not sep:
        module_name, _, attr = target.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"task {spec!r}: not a built-in task ({', '.join(BUILTIN_TASKS)}) and not a dotted "
                         "path 'package.module:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name or module_name.startswith(f"{e.name}."):  # it, not what it imports
            raise ValueError(f"task {spec!r}: module {module_name!r} not found") from None
        raise
    obj = getattr(module, attr, None)
    if obj is None:
        raise ValueError(f"task {spec!r}: module {module_name!r} has no attribute {attr!r}")
    if isinstance(obj, type) and not issubclass(obj, Task):
        raise ValueError(f"task {spec!r}: {attr} is not a subclass of tasks.Task")
    if not callable(obj):
        raise ValueError(f"task {spec!r}: {attr} is a {type(obj).__name__}, not a Task class or factory")
    try:
        inspect.signature(obj).bind(**kwargs)
    except TypeError as e:
        raise ValueError(f"task {spec!r}: cannot take task_kwargs {kwargs}: {e}") from None
    except ValueError:  # no signature to check (a builtin): let the call decide
        pass
    task = obj(**kwargs)
    if not isinstance(task, Task):
        raise ValueError(f"task {spec!r}: {attr}() returned a {type(task).__name__}, not a tasks.Task")
    return task


# ------------------------------------------------------------------------ answer parsing
_NUMBER = re.compile(r"(?<![0-9.])[-+]?[0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
MAX_DIGITS = 40  # a longer "number" is never a right answer (and int() of a huge one is slow)
MAX_SCAN = 10_000  # characters of an answer that are searched: a long one costs no more than this


def first_integer(text: Any, pattern: Optional[re.Pattern] = None) -> Optional[int]:
    """The first number in the first MAX_SCAN characters of `text` (ASCII digits only) if it is
    an integer, else None: "12", " 12 " and "12 apples" give 12; "12.0", "1e3", "twelve", "" give
    None. With `pattern` (one group), its first match's group is the number, if it matches."""
    if not isinstance(text, str):
        return None
    text = text[:MAX_SCAN]
    match = pattern.search(text) if pattern is not None else None
    token = match.group(1) if match else None
    if token is None:
        match = _NUMBER.search(text)
        token = match.group(0) if match else None
    if token is None or len(token) > MAX_DIGITS or not re.fullmatch(r"[-+]?[0-9]+", token):
        return None
    return int(token)
