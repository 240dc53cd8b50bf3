"""Counting which parameters of a communication unit have their gradient for this backward.

Shared by data parallelism (buckets) and ZeRO (units): both launch a unit's collective
from the gradient hook of the last of its parameters to finish, and flush the units that
never completed (unused parameters) once backward returns, in a fixed order on every rank.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


class ReadinessTracker:
    """Calls `on_ready(unit_index)` once all trainable params of a unit have gradients, and
    (armed only) `on_param(unit_index, param_index)` as each of them gets its gradient."""

    def __init__(self, units_params: list[list[nn.Parameter]], on_ready: Callable[[int], None],
                 on_param: Callable[[int, int], None] | None = None):
        self.on_ready = on_ready
        self.on_param = on_param
        self.expected = [sum(p.requires_grad for p in ps) for ps in units_params]
        self.seen = [0] * len(units_params)
        self.done = [False] * len(units_params)
        self.armed = False
        self.handles = []
        for u, params in enumerate(units_params):
            for i, p in enumerate(params):
                if p.requires_grad:
                    self.handles.append(p.register_post_accumulate_grad_hook(self._hook(u, i)))

    def _hook(self, unit: int, index: int):
        def hook(_param):
            if not self.armed:
                return
            if self.on_param is not None:
                self.on_param(unit, index)
            self.seen[unit] += 1
            if self.seen[unit] == self.expected[unit]:
                self.fire(unit)

        return hook

    def fire(self, unit: int) -> None:
        if not self.done[unit]:
            self.done[unit] = True
            self.on_ready(unit)

    def arm(self, armed: bool) -> None:
        """Count gradients in the coming backward (armed) or let them accumulate silently."""
        self.armed = armed
        self.seen = [0] * len(self.seen)
        self.done = [False] * len(self.done)

    def flush(self) -> None:
        """Fire, in unit order, every unit whose parameters did not all get gradients."""
        if self.armed:
            for u in range(len(self.done)):
                if self.expected[u]:
                    self.fire(u)
        self.armed = False

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
