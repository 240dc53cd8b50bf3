"""Shared vocabulary of ZeRO units: owned spans, parameter states, lifecycle errors."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class LifecycleError(RuntimeError):
    """A unit was asked for a transition its state does not allow (a bug in the caller,
    reported with the unit's name and both states rather than ignored)."""


@dataclass(frozen=True)
class Span:
    """The part of one parameter a rank owns: `numel` elements of the flattened parameter
    from `start`, stored at `offset` of the rank's shard (and of its master buffer)."""

    start: int
    numel: int
    offset: int


class ParamState(enum.Enum):
    WHOLE = "whole"  # full parameters resident (stages 1-2 always; stage 3 while gathered)
    GATHERING = "gathering"  # an all-gather is in flight (prefetch); `gather()` completes it
    SHARDED = "sharded"  # only this rank's shard resident; params hold empty placeholders
