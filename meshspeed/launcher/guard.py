"""The remote side of a launch: run one host's share, and stop all of it when the launcher goes.

    python -m meshspeed.launcher.guard --host node1 [--no-stdin] -- COMMAND...

runs COMMAND (that host's `meshspeed run`) and stops it, with every process it started,
when any of these happens:
- its stdin reaches end of file: ssh forwards the launcher's end of the pipe, which closes
  when `meshspeed run` stops, is interrupted or is killed, or when pdsh kills its ssh
  (--no-stdin turns this off, for a launcher that gives the command no stdin);
- its parent changes: sshd's session process ended (the connection dropped);
- it gets SIGTERM, SIGINT or SIGHUP.
Stopping is SIGTERM to COMMAND's process group (torchrun's agent then stops its workers),
then, after GRACE_S, SIGKILL to every process still below the guard (Note [no orphans]).
Exits with COMMAND's status, or 128+signal when it was stopped.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

GRACE_S = 10.0
POLL_S = 0.2
PR_SET_CHILD_SUBREAPER = 36

# Note [no orphans]
# torchrun's agent starts each worker in a session of its own, so a signal to the agent's
# process group does not reach the workers, and a worker whose agent died is re-parented
# to init, out of anyone's sight. The guard makes itself a child subreaper (prctl
# PR_SET_CHILD_SUBREAPER, Linux): every process started below it that loses its parent
# is re-parented to the guard instead, so "every process below the guard" stays a tree
# the guard can walk in /proc and kill, whatever died first.


def _set_subreaper() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: descendants of a dead agent may survive
        pass


def descendants(root: int) -> list[int]:
    """Every process below `root` (from /proc), parents before children."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # it ended while we looked
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name may hold spaces and ')'
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill_all_below() -> None:
    """SIGKILL every process below the guard until none is left (reaping as they go)."""
    for _ in range(50):
        pids = descendants(os.getpid())
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _reap()
        time.sleep(POLL_S)


def _reap() -> None:
    """Collect the orphans re-parented to us (subreaper), so they do not linger as zombies."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _say(message: str) -> None:
    """To stderr, if anyone still reads it: when the connection is gone, writing to it
    fails (EPIPE), and the guard must go on to stop its processes all the same."""
    try:
        print(message, file=sys.stderr, flush=True)
    except OSError:
        pass


class Guard:
    def __init__(self, host: str, command: list[str], watch_stdin: bool):
        self.host, self.command, self.watch_stdin = host, command, watch_stdin
        self.stop_reason: str | None = None
        self.stopped = threading.Event()

    def stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
        self.stopped.set()

    def _watch_stdin(self) -> None:
        # os.read, not sys.stdin: a daemon thread blocked in a buffered read holds the
        # buffer's lock, and the interpreter aborts at exit when it cannot take it
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        self.stop("the connection to the launcher closed")

    def run(self) -> int:
        _set_subreaper()
        parent = os.getppid()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda signum, _frame: self.stop(f"signal {signal.Signals(signum).name}"))
        child = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, start_new_session=True)
        if self.watch_stdin:
            threading.Thread(target=self._watch_stdin, daemon=True).start()
        while child.poll() is None and not self.stopped.wait(POLL_S):
            if os.getppid() != parent:
                self.stop("the launcher's connection ended")
        if child.poll() is None:
            _say(f"meshspeed guard on {self.host}: {self.stop_reason}; stopping this host's processes")
            try:
                os.killpg(child.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                child.wait(GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        _kill_all_below()
        child.wait()
        if self.stop_reason is not None and child.returncode in (0, None):
            return 128 + signal.SIGTERM
        return child.returncode if child.returncode >= 0 else 128 - child.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshspeed.launcher.guard")
    parser.add_argument("--host", default=os.uname().nodename, help="this host's name, for messages")
    parser.add_argument("--no-stdin", action="store_true", help="do not stop at end of stdin")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("missing the command to run (after --)")
    return Guard(args.host, command, not args.no_stdin).run()


if __name__ == "__main__":
    sys.exit(main())
