"""Shared plumbing of flashtrain's own optimisers."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class CheckedOptimizer(torch.optim.Optimizer):
    """An optimiser whose param groups, including ones added later, all pass the subclass's
    `check_group` (a static method raising ValueError); a rejected group leaves it unchanged."""

    check_group: Callable[[dict[str, Any]], None]

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], defaults: dict[str, Any]):
        type(self).check_group({**defaults, "params": []})
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        try:
            type(self).check_group(self.param_groups[-1])
        except ValueError:
            self.param_groups.pop()
            raise
