"""Verifiable tasks for RL post-training and the built-in SFT set: arithmetic, algebra and
Python function writing (checked in rl/sandbox.py), or a user's own Task through a dotted path
(`load_task`)."""
from rl.tasks.base import BUILTIN_TASKS, Problem, Task, first_integer, load_task

__all__ = ["BUILTIN_TASKS", "Problem", "Task", "first_integer", "load_task"]
