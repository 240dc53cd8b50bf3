"""Failing together: a step that fails on one rank raises on every rank.

A save or load runs collectives between its steps; if one rank raised and the others went
on to the next collective, they would wait forever. So each step's outcome is exchanged
(one small all-gather) and every rank raises the first failure, naming the rank. Ranks also
agree on what they save or load: rank 0's directory where they name different ones, and
the same checkpoint inside it, or every rank raises.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

from meshspeed import comm
from meshspeed.checkpoint.errors import CheckpointError

T = TypeVar("T")

log = logging.getLogger("meshspeed")


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


# Note [ranks that name different checkpoint directories]
# Scripts often name the run's directory from the clock and a random suffix, computed on
# every rank before seeding (DeepSpeedExamples' HelloDeepSpeed, `train_bert_ds.py`), so each
# rank passes its own directory, and only rank 0 creates it. Refusing such a save loses the
# run; writing each rank's share under its own directory (DeepSpeed's outcome) leaves no
# directory that holds a whole checkpoint. meshspeed takes rank 0's directory for every rank:
# one complete checkpoint there, which rank 0 names once (with each rank's path) for each
# set of differing paths. A load does the same, so the script resumes unchanged. This is a
# choice of directory only: ranks that ask for different tags, or different checkpoints
# inside the one directory, still raise (`same_everywhere`), since they would save or load
# different states. Rank 0's directory must be on a file system every rank sees; where it is
# not, the other ranks' writes or reads fail with a CheckpointError naming the path.
_told: set[tuple[str, ...]] = set()


def rank0_path(what: str, path: str, group: Any = None) -> str:
    """Collective: the directory every rank uses: `path` where every rank names the same
    one, else rank 0's (absolute), which rank 0 says once, naming each rank's (Note [ranks
    that name different checkpoint directories])."""
    values = comm.all_gather_object(os.path.abspath(path), group=group)
    if len(set(values)) == 1:
        return path
    if comm.get_rank() == 0:
        key = (what, *values)
        if key not in _told:
            _told.add(key)
            lines = "; ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            log.warning("ranks disagree on the %s (%s): every rank uses rank 0's, %s, so the "
                        "checkpoint is one complete directory; pass the same path on every rank to "
                        "silence this", what, lines, values[0])
    return values[0]
