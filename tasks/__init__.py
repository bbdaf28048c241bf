"""Verifiable tasks for RL post-training and the built-in SFT set: arithmetic, algebra and
Python function writing (checked in tasks/sandbox.py), or a user's own Task through a dotted path
(`load_task`); and the built-in distillation domains (tasks/distill_domains.py)."""
from tasks.base import BUILTIN_TASKS, Problem, Task, first_integer, load_task

__all__ = ["BUILTIN_TASKS", "Problem", "Task", "first_integer", "load_task"]
