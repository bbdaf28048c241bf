"""Optimizer steps whose loss or gradient is not finite (NaN/Inf): their update is skipped, the
run says so, and a run that produces nothing else stops with one line.

A skipped step still consumes its batch and counts as a step (as a loss-scaled fp16 step that
overflows does in DeepSpeed and Megatron), so the data order and the checkpoint cadence stay
those of the uninterrupted run; the learning-rate schedule does not advance, and the MoE router
biases are not moved by that step's load."""
from __future__ import annotations

import contextlib
import sys

import torch

from conf.errors import RunFailure
from trainer.distributed import all_reduce_sum_


@contextlib.contextmanager
def update_skipped(optimizer: torch.optim.Optimizer):
    """engine.step() at an accumulation boundary without the optimizer's update, for an optimizer
    the DeepSpeed engine drives as it is (ZeRO-0 and flashtrain's own optimizers): it follows the
    contract of DeepSpeed's own ZeRO and bf16 optimizers, which leave the parameters alone and set
    `overflow` when the gradient norm is not finite. The engine then counts a skipped step, does
    not step the schedule, and clears the gradients."""
    optimizer.step = lambda *args, **kwargs: None  # instance attribute: shadows the class's step
    optimizer.overflow = True
    try:
        yield
    finally:
        del optimizer.step
        optimizer.overflow = False


def boundary_step(engine, optimizer: torch.optim.Optimizer, not_finite_here: bool, step: int) -> bool:
    """engine.step() at an accumulation boundary, without the update when the step's loss or
    gradient is not finite on some rank (`not_finite_here`: on this one; every rank must skip or
    none, and one rank's NaN reaches the others only through the gradient reduction). DeepSpeed's
    ZeRO and bf16 optimizers skip such a step themselves; an optimizer the engine drives as it is
    (`optimizer`) skips through `update_skipped`. Returns whether the update was skipped (also when
    DeepSpeed skipped it on its own); a non-finite step whose update was applied anyway stops the
    run."""
    nonfinite = all_reduce_sum_(torch.tensor([float(not_finite_here)], dtype=torch.float64)).item() > 0
    skipped_before = engine.skipped_steps
    with (update_skipped(optimizer) if nonfinite and engine.optimizer is optimizer
          else contextlib.nullcontext()):
        engine.step()
    skipped = engine.skipped_steps > skipped_before
    if nonfinite and not skipped:
        raise RunFailure(f"step {step}: the loss or gradient is not finite and the optimizer "
                         f"({type(engine.optimizer).__name__}) applied the update anyway; the run stops: its "
                         "checkpoints hold the weights from before it")
    return skipped


class NonFiniteSteps:
    """Counts skipped steps; `limit` in a row (0: no limit) stop the run."""

    def __init__(self, limit: int, is_main: bool):
        self.limit, self.is_main = limit, is_main
        self.in_a_row = self.total = 0

    def record(self, step: int, skipped: bool, detail: str) -> None:
        if not skipped:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.total += 1
        if self.limit and self.in_a_row >= self.limit:
            raise RunFailure(f"step {step}: {detail}, for {self.in_a_row} steps in a row "
                             f"(trainer.max_nonfinite_steps={self.limit}): the run stops; its checkpoints "
                             "hold weights from before the first of them")
        if self.is_main:
            print(f"flashtrain: warning: step {step}: {detail}; its update was skipped "
                  f"({self.in_a_row} in a row, {self.total} in this process)", file=sys.stderr, flush=True)
