"""A set of persistent rank processes joined in one gloo group (parent side).

Note [why forkserver]: a worker must not be a fork of the test process (pytest may hold
threads and arbitrary state), so workers are started from a clean interpreter. Plain
`spawn` re-imports torch (and DTensor, pytest, ...) in every worker: a pool of 4 took
3-4 s on a 2-core machine, paid again whenever a pool is replaced after a failure or
for another world size. The `forkserver` method starts one clean server process that
imports those once (~1.5 s, once per session); each worker is then a fork of that
server, and a pool of 4 is ready and through its first call in ~0.2 s. Set
MESHSPEED_TEST_START_METHOD=spawn to use spawn instead (the default where forkserver is
unavailable).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import sys
import tempfile
import time
from multiprocessing.connection import wait
from typing import Any

import torch.distributed as dist

from meshspeed.testing import _worker
from meshspeed.testing.errors import (
    DistributedTestError,
    DistributedTimeoutError,
    RankFailure,
    cause_first,
    describe_exitcode,
    format_failures,
)

STARTUP_TIMEOUT_S = 180.0
# After one rank fails, how long the others get to report before the pool is killed.
# They are usually blocked in a collective that will never complete.
FAILURE_GRACE_S = 3.0
_STACK_DUMP_WAIT_S = 0.5


def _context() -> mp.context.BaseContext:
    method = os.environ.get("MESHSPEED_TEST_START_METHOD")
    if method is None:
        method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    ctx = mp.get_context(method)
    if method == "forkserver":
        # Imported once in the server instead of in every worker (seconds per pool on a
        # small machine). torch.distributed.tensor (DTensor, DeviceMesh; ~0.4 s) is pulled
        # in by most parallel code and even by torch.testing.assert_close; pytest (~0.3 s)
        # by every test module. Ignored if the server already runs.
        preload = [
            "torch",
            "torch.distributed",
            "torch.distributed.tensor",
            "torch.distributed.device_mesh",
            "meshspeed.testing._worker",
        ]
        if "pytest" in sys.modules:
            preload.append("pytest")
        ctx.set_forkserver_preload(preload)
    return ctx


class WorkerPool:
    """`world_size` rank processes, started together and replaced together.

    Lifecycle: started (ready for calls) -> closed. Any failed call kills the pool,
    because a rank that failed mid-collective leaves the group in an unknown state.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.closed = False
        self.pids: list[int] = []
        self._calls = 0
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._stack_files: list[str] = []
        # The rendezvous store lives here, so no port has to be guessed and then raced for.
        self._store = dist.TCPStore(_worker.MASTER_ADDR, 0, is_master=True, wait_for_workers=False)
        try:
            self._start(_context())
            self._await_ready()
        except BaseException:  # including an interrupt while starting: leave nothing behind
            self.kill()
            raise

    def _start(self, ctx: mp.context.BaseContext) -> None:
        for rank in range(self.world_size):
            # Where the rank writes its stacks when asked (SIGUSR1); created and removed here.
            fd, stacks_path = tempfile.mkstemp(prefix=f"meshspeed-rank{rank}-", suffix=".stacks")
            os.close(fd)
            self._stack_files.append(stacks_path)
            parent_end, child_end = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_worker.worker_main,
                args=(rank, self.world_size, self._store.port, os.getpid(), stacks_path, child_end),
                name=f"meshspeed-rank{rank}-of-{self.world_size}",
                daemon=False,  # ranks may start their own children (e.g. data loaders)
            )
            self._conns.append(parent_end)
            proc.start()
            child_end.close()
            self._procs.append(proc)

    # -- lifecycle ---------------------------------------------------------------------------

    def _await_ready(self) -> None:
        replies = self._collect(list(range(self.world_size)), STARTUP_TIMEOUT_S, grace=None)
        failures, pending = replies["failures"], replies["pending"]
        if failures or pending:
            detail = format_failures(failures) if failures else ""
            raise DistributedTestError(
                f"starting {self.world_size} gloo ranks failed"
                + (f"; ranks {pending} never became ready" if pending else "")
                + (f"\n{detail}" if detail else ""),
                failures,
                pending,
            )
        self.pids = [replies["messages"][rank][1] for rank in range(self.world_size)]

    def alive(self) -> bool:
        return not self.closed and all(p.is_alive() for p in self._procs)

    def close(self, timeout: float = 5.0) -> None:
        """Ask every rank to leave the group and exit; kill those that do not."""
        if self.closed:
            return
        for conn in self._conns:
            try:
                conn.send_bytes(pickle.dumps(("stop",)))
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(5.0)
        for conn in self._conns:
            conn.close()
        for path in self._stack_files:
            try:
                os.unlink(path)
            except OSError:
                pass
        self._stack_files = []
        self._store = None
        self.closed = True

    # -- calls -------------------------------------------------------------------------------

    def call(self, payload: bytes, label: str, timeout: float) -> list[Any]:
        """Run one pickled (fn, args, kwargs) on every rank; return the per-rank results."""
        if self.closed:
            raise RuntimeError("call on a closed WorkerPool")
        self._calls += 1
        call_id = self._calls
        message = pickle.dumps(("call", call_id, payload, dict(os.environ), list(sys.path)))
        for conn in self._conns:
            try:
                conn.send_bytes(message)
            except OSError:  # the rank died since the last call; _collect reports how
                pass
        replies = self._collect(list(range(self.world_size)), timeout, grace=FAILURE_GRACE_S)
        failures, pending = replies["failures"], replies["pending"]
        results: dict[int, Any] = {}
        recycle = False
        for rank, (_, reply_id, body, rank_recycles) in replies["messages"].items():
            if reply_id != call_id:  # cannot happen while failed pools are always killed
                self.kill()
                raise RuntimeError(f"rank {rank} answered call {reply_id}, expected {call_id}")
            results[rank] = pickle.loads(body)
            recycle = recycle or rank_recycles
        if failures:
            self.kill()
            raise _failure_error(label, failures, pending)
        if pending:
            stacks = self._dump_stacks(pending)
            self.kill()
            raise DistributedTimeoutError(
                f"{label} timed out after {timeout:g}s: rank(s) {pending} did not finish "
                f"(rank(s) {sorted(results)} did).\n{stacks}",
                {},
                pending,
            )
        if recycle:
            self.kill()
        return [results[rank] for rank in range(self.world_size)]

    def _collect(self, ranks: list[int], timeout: float, grace: float | None) -> dict[str, Any]:
        """Wait for one message from each rank, or its death, or the deadline.

        Once a rank has failed, the others only get `grace` more seconds.
        """
        messages: dict[int, Any] = {}
        failures: dict[int, RankFailure] = {}
        pending = set(ranks)
        deadline = time.monotonic() + timeout
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            waitables = {self._conns[r]: r for r in pending}
            waitables.update({self._procs[r].sentinel: r for r in pending})
            for ready in wait(list(waitables), timeout=remaining):
                rank = waitables[ready]
                if rank not in pending:
                    continue
                message = self._read(rank)
                if message is None:
                    failures[rank] = self._death(rank)
                elif message[0] == "startup_error":
                    failures[rank] = RankFailure(rank, "StartupError", "", message[1])
                elif message[0] == "error":
                    failures[rank] = _failure_from_fields(rank, message[2])
                else:
                    messages[rank] = message
                pending.discard(rank)
            if grace is not None and failures:
                deadline = min(deadline, time.monotonic() + grace)
                grace = None  # the grace period starts at the first failure only
        return {"messages": messages, "failures": failures, "pending": sorted(pending)}

    def _read(self, rank: int) -> Any:
        conn = self._conns[rank]
        try:
            if conn.poll():
                return pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            pass
        return None

    def _death(self, rank: int) -> RankFailure:
        proc = self._procs[rank]
        proc.join(2.0)
        text = f"worker process for rank {rank} died with {describe_exitcode(proc.exitcode)}"
        if not self.pids:  # died before it was ready
            text += (
                " while starting; see its stderr. A script that calls run_distributed "
                "needs an `if __name__ == '__main__':` guard, because workers re-import "
                "the main module."
            )
        return RankFailure(rank, "WorkerDied", text, text, exitcode=proc.exitcode)

    def _dump_stacks(self, ranks: list[int]) -> str:
        """Ask hung ranks for their Python stacks (faulthandler on SIGUSR1) before killing."""
        if not hasattr(signal, "SIGUSR1"):
            return ""
        for rank in ranks:
            try:
                os.kill(self._procs[rank].pid, signal.SIGUSR1)
            except OSError:
                pass
        time.sleep(_STACK_DUMP_WAIT_S)
        parts = []
        for rank in ranks:
            try:
                with open(self._stack_files[rank]) as f:
                    text = f.read().strip()
            except OSError:
                text = ""
            parts.append(f"--- stacks of rank {rank} ---\n{text or '(no stack dump)'}")
        return "\n".join(parts)


def _failure_from_fields(rank: int, fields: dict[str, Any]) -> RankFailure:
    exception = None
    if fields.get("exception") is not None:
        try:
            exception = pickle.loads(fields["exception"])
        except Exception:  # noqa: BLE001 - the traceback text is the primary report
            exception = None
    return RankFailure(rank, fields["exc_type"], fields["message"], fields["traceback"], exception)


def _failure_error(
    label: str, failures: dict[int, RankFailure], pending: list[int]
) -> DistributedTestError:
    failed = cause_first(failures)
    summary = "; ".join(
        f"rank {r}: {failures[r].exc_type.rsplit('.', 1)[-1]}: {failures[r].message}"
        for r in failed
    )
    lines = [f"{label} failed on rank(s) {sorted(failed)}: {summary}"]
    if pending:
        lines.append(
            f"rank(s) {pending} had not finished {FAILURE_GRACE_S:g}s after the first "
            "failure (probably blocked in a collective) and were killed"
        )
    lines.append(format_failures(failures))
    return DistributedTestError("\n".join(lines), failures, pending)
