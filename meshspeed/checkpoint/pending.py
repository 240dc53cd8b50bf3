"""Asynchronous saves: one background writer per engine, and where its failure surfaces.

A save with `checkpoint.async_save` snapshots the state (a host copy) and returns; a
thread writes the files and, on global rank 0, publishes the checkpoint once every rank's
marker is there (Note [publishing a checkpoint] in writer.py), so the thread never calls a
collective. The outcome is reported at the next chance:

* `raise_pending_errors(engine)` (cheap, local; the engine calls it from `step()`) raises
  a finished save's failure on the rank where it happened;
* the next `save_checkpoint` / `load_checkpoint` first waits for the save in flight and
  raises its failure on every rank;
* `engine.destroy()` (or leaving `with engine:`) waits and raises it on every rank;
* at interpreter exit the (non-daemon) thread is waited for; a failure is logged and the
  process exits with status 1, so that a scheduler does not count a lost final
  checkpoint as success.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable

from meshspeed.checkpoint.agree import agree, one_line
from meshspeed.checkpoint.errors import CheckpointError

log = logging.getLogger("meshspeed")


class PendingSave:
    """One background save: runs `job` in a non-daemon thread and keeps its exception."""

    def __init__(self, label: str, job: Callable[[], None]):
        self.label = label
        self.error: BaseException | None = None
        self._job = job
        self.thread = threading.Thread(target=self._run, name=f"meshspeed-save-{label}", daemon=False)
        _all.add(self)
        self.thread.start()

    def _run(self) -> None:
        try:
            self._job()
        except BaseException as err:  # noqa: BLE001 - reported on the next engine call
            self.error = err

    def done(self) -> bool:
        return not self.thread.is_alive()

    def join(self) -> BaseException | None:
        self.thread.join()
        _all.discard(self)
        return self.error


_pending: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> PendingSave
_all: set[PendingSave] = set()


def start(engine, label: str, job: Callable[[], None]) -> None:
    if engine in _pending:
        raise RuntimeError("an asynchronous save is already in flight; wait_for_pending first")
    _pending[engine] = PendingSave(label, job)


def _failure(save: PendingSave) -> CheckpointError:
    err = CheckpointError(f"asynchronous checkpoint save {save.label} failed: {one_line(save.error)}")
    err.__cause__ = save.error
    return err


def wait_for_pending(engine) -> None:
    """Collective: finish this engine's save in flight; raise its failure on every rank."""
    save = _pending.pop(engine, None)
    error = None
    if save is not None and save.join() is not None:
        error = _failure(save)
    agree(error)


def raise_pending_errors(engine) -> None:
    """Local and non-blocking: raise if this rank's finished background save failed."""
    save = _pending.get(engine)
    if save is not None and save.done():
        del _pending[engine]
        _all.discard(save)
        if save.error is not None:
            raise _failure(save)


def in_flight(engine) -> bool:
    save = _pending.get(engine)
    return save is not None and not save.done()


@atexit.register
def _wait_at_exit() -> None:
    failed = False
    for save in list(_all):
        if save.join() is not None:
            log.error("%s", _failure(save))
            failed = True
    if failed:
        # an exception raised here would be printed and ignored (exit status 0); the
        # handlers registered before this one (logging's among them) are skipped by
        # os._exit, so flush what they would have
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
