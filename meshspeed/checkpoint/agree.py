"""Failing together: a step that fails on one rank raises on every rank.

A save or load runs collectives between its steps; if one rank raised and the others went
on to the next collective, they would wait forever. So each step's outcome is exchanged
(one small all-gather) and every rank raises the first failure, naming the rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from meshspeed import comm
from meshspeed.checkpoint.errors import CheckpointError

T = TypeVar("T")


def one_line(exc: BaseException) -> str:
    text = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())


def agree(exc: BaseException | None, group: Any = None) -> None:
    """Collective: raise on every rank if `exc` is set on any rank."""
    failures = comm.all_gather_object(None if exc is None else one_line(exc), group=group)
    bad = [(rank, msg) for rank, msg in enumerate(failures) if msg]
    if not bad:
        return
    rank, msg = bad[0]
    # the same message on every rank (the one that failed keeps its exception as the cause)
    text = f"rank {rank}: {msg}" if len(failures) > 1 else msg
    if exc is not None and isinstance(exc, CheckpointError) and text == str(exc):
        raise exc
    raise CheckpointError(text) from exc


def everywhere(fn: Callable[..., T], *args: Any, group: Any = None, **kwargs: Any) -> T:
    """Run `fn` on this rank; collective: if it raised anywhere, raise everywhere."""
    try:
        result, exc = fn(*args, **kwargs), None
    except Exception as err:  # noqa: BLE001 - any failure must reach the other ranks
        result, exc = None, err
    agree(exc, group)
    return result  # type: ignore[return-value]


def same_everywhere(what: str, value: str, group: Any = None) -> None:
    """Collective: raise on every rank unless every rank holds the same `value` (a save or
    load directory): ranks that read or write different checkpoints would otherwise go on
    with different states."""
    values = comm.all_gather_object(value, group=group)
    if len(set(values)) == 1:
        return
    common = max(values, key=values.count)
    lines = "; ".join(f"rank {r}: {v}" + (" <-- differs" if v != common else "")
                      for r, v in enumerate(values))
    raise CheckpointError(f"ranks disagree on the {what} ({lines}); pass the same path on every "
                          "rank, on a file system every rank sees")
