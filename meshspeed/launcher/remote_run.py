"""Run a `RemoteJob` from the launching machine: check, start, stream, stop.

ssh: first every host checks the master address (preflight.py), all at once; one problem
stops the launch in one sentence. Then one ssh per host runs that host's share under the
guard (guard.py). Every line a host prints comes here prefixed by host and rank
(``[node1 r3] loss 1.23``; torchrun puts the rank in, and lines of the host's agent get
``[node1]``). The first host that fails, or SIGINT/SIGTERM here, stops the job on every
host: the ssh pipes are closed, each guard stops its host's processes and exits, and a
host still running after STOP_GRACE_S has its ssh killed (its guard then sees its parent
go). The exit status is 0, the failing host's status (its name said on stderr), or
128+signal.

pdsh: the same command on every host through one pdsh (pdsh prefixes each line with the
host). openmpi / slurm: the one mpirun / srun command is printed, then this process becomes it.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from meshspeed.launcher import failures, preflight, remote_plan
from meshspeed.launcher.remote_plan import RemoteJob

PREFLIGHT_TIMEOUT_S = 60
STOP_GRACE_S = 20.0


def _say(message: str) -> None:
    print(f"meshspeed run: {message}", file=sys.stderr, flush=True)


def check_hosts(job: RemoteJob) -> str | None:
    """Every host's preflight, in parallel: None when all pass, else one sentence."""
    def ask(host):
        try:
            done = subprocess.run(remote_plan.preflight_argv(job, host), stdin=subprocess.DEVNULL, check=False,
                                  capture_output=True, text=True, timeout=PREFLIGHT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return host, None, f"did not answer over ssh within {PREFLIGHT_TIMEOUT_S} s"
        lines = done.stdout.strip().splitlines()
        for line in lines:
            if line.startswith("warning "):
                _say(f"warning: on {host}, {line.removeprefix('warning ')}")
        words = lines[-1:] or [""]
        kind, _, rest = words[0].partition(" ")
        if kind == "ok":
            return host, rest, None
        if kind == "problem":
            return host, None, rest
        detail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return host, None, f"cannot be reached to check it ({detail})"

    with ThreadPoolExecutor(len(job.hosts)) as pool:
        answers = list(pool.map(ask, job.hosts))
    example = next((addr for _, addr, problem in answers if problem is None), None)
    for host, _, problem in answers:
        if problem is None:
            continue
        if problem.startswith(("did not answer", "cannot be reached")):
            return f"meshspeed run: {host} {problem}"
        return preflight.sentence(host, job.master_addr, problem, example)
    return None


class _Printer:
    """Writes lines of several hosts to our stdout/stderr, whole lines at a time. A host's
    last line naming its first failing rank (failures.py) is kept back in `causes`: the
    job's report ends with the failed host's one, once (SshRun.run)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.causes: dict[str, str] = {}

    def pump(self, stream, out, host: str) -> None:
        mine = f"[{host} r".encode()
        for line in iter(stream.readline, b""):
            text = line.decode(errors="replace").rstrip("\n")
            if text.startswith(failures.FIRST_PREFIX) and failures.FIRST_MARK in text:
                rank, cause = text.removeprefix(failures.FIRST_PREFIX).split(failures.FIRST_MARK, 1)
                self.causes[host] = failures.first_line(rank, cause, host)
                continue
            if not line.startswith(mine):
                line = f"[{host}] ".encode() + line
            with self.lock:
                out.buffer.write(line if line.endswith(b"\n") else line + b"\n")
                out.buffer.flush()


class SshRun:
    """One ssh per host; see the module docstring."""

    def __init__(self, job: RemoteJob):
        self.job = job
        self.procs: dict[str, subprocess.Popen] = {}
        self.failed: tuple[str, int] | None = None
        self.signalled: int | None = None
        self.changed = threading.Condition()

    def _on_signal(self, signum, _frame) -> None:
        with self.changed:
            self.signalled = self.signalled or signum
            self.changed.notify_all()

    def _wait_host(self, host: str, proc: subprocess.Popen) -> None:
        proc.wait()
        with self.changed:
            if proc.returncode != 0 and self.failed is None and self.signalled is None:
                self.failed = (host, proc.returncode)
            self.changed.notify_all()

    def _stop_all(self) -> None:
        """Close every ssh's stdin (each guard then stops its host), wait, kill stragglers."""
        for proc in self.procs.values():
            try:
                proc.stdin.close()
            except OSError:
                pass
        for host, proc in self.procs.items():
            try:
                proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                _say(f"{host} did not stop within {STOP_GRACE_S:.0f} s; closing its connection")
                proc.kill()
                proc.wait()

    def run(self) -> int:
        printer, threads = _Printer(), []
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            for host in self.job.hosts:
                # a session of its own: a Ctrl-C at the terminal reaches us only, and we
                # stop the hosts in order instead of every ssh dying at once
                proc = subprocess.Popen(remote_plan.ssh_argv(self.job, host), stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        start_new_session=True)
                self.procs[host] = proc
                threads += [threading.Thread(target=printer.pump, args=(proc.stdout, sys.stdout, host), daemon=True),
                            threading.Thread(target=printer.pump, args=(proc.stderr, sys.stderr, host), daemon=True),
                            threading.Thread(target=self._wait_host, args=(host, proc), daemon=True)]
                for thread in threads[-3:]:
                    thread.start()
            with self.changed:
                while (self.failed is None and self.signalled is None
                       and any(p.poll() is None for p in self.procs.values())):
                    self.changed.wait(1.0)
            if self.failed is not None:
                others = [h for h, p in self.procs.items() if p.poll() is None]
                if others:
                    _say(f"{self.failed[0]} failed (exit status {self.failed[1]}); stopping the job on "
                         f"{', '.join(others)}")
            elif self.signalled is not None:
                _say(f"{signal.Signals(self.signalled).name}: stopping the job on every host")
            self._stop_all()
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
        for thread in threads:
            thread.join(5.0)
        if self.signalled is not None:
            return 128 + self.signalled
        if self.failed is not None:
            host, status = self.failed
            what = "could not be reached over ssh" if status == 255 else f"failed with exit status {status}"
            _say(f"the job failed: {host} {what}")
            if host in printer.causes:  # the cause last (Note [the first failure is the cause])
                print(printer.causes[host], file=sys.stderr, flush=True)
            return status
        return 0


def run_pdsh(job: RemoteJob) -> int:
    """One pdsh for every host. SIGINT/SIGTERM here: pdsh is given two SIGINTs, its own
    "abort" (it then kills its ssh clients, and each host's guard sees its sshd go)."""
    argv, env = remote_plan.pdsh_argv(job)
    _say(" ".join(argv[:-1]) + " '...'")
    received: list[int] = []
    proc = subprocess.Popen(argv, env={**os.environ, **env}, stdin=subprocess.DEVNULL, start_new_session=True)

    def forward(signum, _frame):
        received.append(signum)
        _say(f"{signal.Signals(signum).name}: stopping the job on every host")
        for _ in range(2):
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGINT)
            time.sleep(0.2)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        status = proc.wait()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    return 128 + received[0] if received else status


def exec_one(argv: list[str]) -> int:
    """Print the launcher command, then become it (mpirun / srun own the job from here)."""
    _say(shlex.join(argv))
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvp(argv[0], argv)
    except FileNotFoundError:
        _say(f"{argv[0]} is not on PATH; install it or pick another --launcher")
        return 127
    return 0  # not reached


def run(job: RemoteJob) -> int:
    """Start `job` with its launcher; the exit status for `meshspeed run`."""
    if job.launcher == "openmpi":
        return exec_one(remote_plan.mpirun_argv(job))
    if job.launcher == "slurm":
        return exec_one(remote_plan.srun_argv(job))
    problem = check_hosts(job)
    if problem is not None:
        print(problem, file=sys.stderr, flush=True)
        return 2
    if job.launcher == "pdsh":
        return run_pdsh(job)
    return SshRun(job).run()
