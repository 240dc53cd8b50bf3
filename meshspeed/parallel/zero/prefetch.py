"""Stage-3 parameter fetching: gather each unit just before it runs, release it after.

Note [prefetch follows the last observed order]
During each forward (and backward) the order in which units actually run is recorded.
The next pass prefetches, at unit k of the recorded order, the units that followed it
last time, up to `prefetch_numel` elements ahead and never beyond `max_live_numel`
gathered elements. When the model takes another path (dynamic control flow), the first
unit that differs from the record switches prefetching off for the rest of the pass and a
new record is taken: units gathered ahead but not used are released at the end of the
pass, and a unit that was not prefetched is gathered on demand. A wrong guess therefore
costs memory and bandwidth for one pass, never correctness. All ranks must run the same
units in the same order (true for data parallelism over identical modules); a rank that
skips a unit would leave its peers waiting in the all-gather.
"""

from __future__ import annotations

import enum
import logging

import torch

from meshspeed.parallel.zero.flat import FlatUnit
from meshspeed.parallel.zero.lifecycle import ParamState

log = logging.getLogger("meshspeed")


class Pass(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


class OrderTrace:
    """The order units ran in last pass, and whether this pass still follows it."""

    def __init__(self):
        self.previous: list[int] = []
        self.current: list[int] = []
        self.following = False

    def start(self) -> None:
        self.current = []
        self.following = bool(self.previous)

    def record(self, index: int) -> list[int]:
        """Record that unit `index` runs now; return the units expected after it."""
        pos = len(self.current)
        self.current.append(index)
        if self.following and (pos >= len(self.previous) or self.previous[pos] != index):
            self.following = False
            log.debug("zero-3: unit order changed at position %d; prefetch off this pass", pos)
        return self.previous[pos + 1 :] if self.following else []

    def finish(self) -> None:
        self.previous = self.current

    def ends_with(self, index: int) -> bool:
        """This pass has followed the record so far and `index` ran last in it."""
        return self.following and len(self.current) == len(self.previous) and self.previous[-1] == index


class Fetcher:
    """Gathers and releases sharded units for one pass direction at a time."""

    def __init__(self, units: list[FlatUnit], prefetch_numel: int, max_live_numel: int,
                 max_ahead: int = 1):
        self.units = units
        self.prefetch_numel = prefetch_numel
        # units gathered ahead of the running one: one hides the next all-gather behind the
        # current unit's compute; more only adds live memory and, on few cores, gloo
        # threads competing with the compute thread (FSDP2 also prefetches one)
        self.max_ahead = max_ahead
        self.max_live_numel = max_live_numel
        self.traces = {Pass.FORWARD: OrderTrace(), Pass.BACKWARD: OrderTrace()}
        self.peak_gathered_bytes = 0

    def live_numel(self) -> int:
        return sum(u.layout.numel for u in self.units
                   if u.shard_params and u.state is not ParamState.SHARDED)

    def start(self, direction: Pass) -> None:
        self.traces[direction].start()

    def finish(self, direction: Pass) -> None:
        self.traces[direction].finish()

    def fetch(self, index: int, direction: Pass) -> None:
        """Unit `index` is about to run: make it whole, then prefetch what usually follows."""
        upcoming = self.traces[direction].record(index)
        if self.units[index].state is not ParamState.WHOLE:  # (a module run twice is whole)
            self.units[index].gather()
        budget = self.prefetch_numel
        for nxt in upcoming[: self.max_ahead]:
            unit = self.units[nxt]
            if unit.state is not ParamState.SHARDED:
                continue
            if unit.layout.numel > budget or self.live_numel() + unit.layout.numel > self.max_live_numel:
                break
            if not unit.ready_to_gather():  # (its shard is still being updated: gathered when due)
                break
            unit.gather_async()  # overlaps the running unit's compute
            budget -= unit.layout.numel
        self._note_peak()

    def last_in_forward(self, index: int) -> bool:
        return self.traces[Pass.FORWARD].ends_with(index)

    def release(self, index: int) -> None:
        unit = self.units[index]
        if unit.state is not ParamState.SHARDED:
            unit.release()

    def release_all(self) -> None:
        for unit in self.units:
            if unit.shard_params and unit.state is not ParamState.SHARDED:
                unit.release()

    def _note_peak(self) -> None:
        gathered = sum(u.gathered_bytes() for u in self.units)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, gathered)


class _PreBackward(torch.autograd.Function):
    """Identity on a unit's outputs whose backward gathers the unit's parameters."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        return tensors if len(tensors) > 1 else tensors[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


def attach_pre_backward(output, callback):
    """Route the tensors in `output` (tensor, tuple or list) through `_PreBackward`."""
    if isinstance(output, torch.Tensor):
        return _PreBackward.apply(callback, output) if output.requires_grad else output
    if isinstance(output, (tuple, list)):
        idx = [i for i, t in enumerate(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            return output
        wrapped = _PreBackward.apply(callback, *(output[i] for i in idx))
        wrapped = wrapped if isinstance(wrapped, tuple) else (wrapped,)
        items = list(output)
        for i, t in zip(idx, wrapped):
            items[i] = t
        return type(output)(items) if isinstance(output, tuple) else items
    return output
