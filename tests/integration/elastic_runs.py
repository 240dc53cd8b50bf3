"""What test_elastic.py and test_elastic_hosts.py share: the agent's command line, waiting
for the script's markers, reading its log, and comparing with the uninterrupted run."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from tests.integration import elastic_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(elastic_script.__file__)
TOL = 1e-5  # Note in test_elastic.py: why not bit-equal


def agent_argv(endpoint: str, run_id: str, nproc: int, out_dir: Path, ckpt_dir: Path,
               event: str, is_host: bool | None = None, stage: int = 2) -> list[str]:
    """One host's `meshspeed run --nnodes 1:2 --master_addr A`, the documented form: meshspeed
    makes it the c10d rendezvous at A (meshspeed's wrapper: Note [the bootstrap store of a joining host]).
    last_call_timeout: a lone first host starts after 3 s, not torch's 30. `is_host`: this
    agent keeps the rendezvous's store (or not); by default, the agent on the endpoint's
    address. On one machine every agent is on it, and the first to start would keep it."""
    conf = "last_call_timeout=3" + ("" if is_host is None else f",is_host={str(is_host).lower()}")
    addr, port = endpoint.rsplit(":", 1)
    return [sys.executable, "-m", "meshspeed.cli", "run", "--nnodes", "1:2",
            "--nproc-per-node", str(nproc), "--master_addr", addr, "--master_port", port,
            "--rdzv-id", run_id, "--rdzv-conf", conf, "--max-restarts", "3",
            str(SCRIPT), str(out_dir), str(ckpt_dir), event, str(stage)]


def agent_env(victim: bool = False) -> dict[str, str]:
    # no TORCH_DISABLE_SHARE_RDZV_TCP_STORE here: `meshspeed run` must make growing work
    # without it (docs/multinode.md, "Elastic")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "OMP_NUM_THREADS": "1",
           "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    if victim:
        env["ELASTIC_VICTIM"] = "1"
    return env


def wait_for(out_dir: Path, name: str, count: int, procs: list[subprocess.Popen],
             logs: list[Path], timeout: float = 120) -> list[tuple[int, int]]:
    """(pid, agent pid) of the `count` ranks that wrote `name-<rank>`; fails the test with
    the agents' output if one of them exits first or the markers do not come in time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = sorted(out_dir.glob(f"{name}-[0-9]*"))
        if len(found) >= count:
            return [tuple(int(x) for x in f.read_text().split()) for f in found]
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.3)
    raise AssertionError(f"{count} ranks did not write {name}-<rank> in {out_dir}; agents' output:\n"
                         + tail(logs))


def tail(logs: list[Path], n: int = 3000) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-n:]}" for p in logs if p.exists())


def finish(proc: subprocess.Popen, logs: list[Path], timeout: float) -> None:
    """The job ends well within `timeout` seconds, with status 0."""
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the job did not finish in {timeout} s:\n" + tail(logs)) from None
    assert rc == 0, tail(logs)


def stop(procs: list[subprocess.Popen]) -> None:
    """Bounded clean-up: SIGTERM each agent's process group (the agent stops its workers),
    then SIGKILL what is left."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)


def attempts(log: Path) -> list[tuple[int, int, list[tuple[int, float]]]]:
    """[(world, first step, [(step, loss), ...]), ...]: one entry per start of the job."""
    out: list[tuple[int, int, list[tuple[int, float]]]] = []
    for line in log.read_text().splitlines():
        if m := re.fullmatch(r"start world (\d+) at step (\d+) accumulation \d+", line):
            out.append((int(m[1]), int(m[2]), []))
        elif m := re.fullmatch(r"world (\d+) step (\d+) loss (\S+)", line):
            out[-1][2].append((int(m[2]), float(m[3])))
    return out


def assert_like_uninterrupted(run: Path, reference: Path) -> None:
    """Every step's loss of every start and the final parameters equal the uninterrupted
    run's (same global batch) to TOL."""
    ref = dict(attempts(reference / "log.txt")[0][2])
    for world, _, steps in attempts(run / "log.txt"):
        for step, loss in steps:
            assert abs(loss - ref[step]) <= TOL * abs(ref[step]), (
                f"world {world} step {step}: loss {loss!r}, uninterrupted {ref[step]!r}")
    got, want = torch.load(run / "final.pt"), torch.load(reference / "final.pt")
    assert got.keys() == want.keys()
    for name, value in want.items():
        diff = (got[name] - value).abs().max().item()
        assert diff <= TOL, f"{name} differs from the uninterrupted run's by {diff}"
