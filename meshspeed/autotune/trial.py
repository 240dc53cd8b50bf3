"""One measured run: the user's script under `meshspeed run`, with its config argument
replaced (DeepSpeed's arg_mappings idea), the step clock on, a timeout, and a reason
whenever it does not produce figures."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshspeed.monitor.autotune_hooks import METRICS_ENV, PROBE_ENV, STEPS_ENV

CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed-config", "--config")


class TuneError(ValueError):
    """Bad input to the tuner, said in one sentence."""


def find_config_arg(script_args: list[str]) -> str | None:
    """The config path the script is given (--deepspeed_config X / --config=X), or None."""
    for i, arg in enumerate(script_args):
        for flag in CONFIG_FLAGS:
            if arg == flag and i + 1 < len(script_args):
                return script_args[i + 1]
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
    return None


def _set_arg(args: list[str], flag: str, value: str) -> tuple[list[str], bool]:
    out, found, skip = [], False, False
    for i, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if arg == flag and i + 1 < len(args):
            out += [flag, value]
            found, skip = True, True
        elif arg.startswith(flag + "="):
            out.append(f"{flag}={value}")
            found = True
        else:
            out.append(arg)
    return out, found


def substitute(script_args: list[str], config_path: str, cfg: dict[str, Any],
               arg_mappings: dict[str, str]) -> list[str]:
    """The script's arguments with the config flag pointing at `config_path` and each
    mapped argument carrying its config key's value."""
    args, found = list(script_args), False
    for flag in CONFIG_FLAGS:
        args, hit = _set_arg(args, flag, config_path)
        found = found or hit
    if not found:
        raise TuneError("the script's arguments have no --deepspeed_config/--config PATH; add one so "
                        "each trial can be given its own config")
    for key, flag in arg_mappings.items():
        node: Any = cfg
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            raise TuneError(f"autotuning.arg_mappings names {key!r}, which the trial config does not set; "
                            f"map one of its keys, such as 'train_micro_batch_size_per_gpu'")
        args, hit = _set_arg(args, flag, str(node))
        if not hit:
            args += [flag, str(node)]
    return args


@dataclass
class RunResult:
    ok: bool
    reason: str  # "" when ok
    seconds: float  # wall clock of the whole job


def _reason(rc: int, log: str) -> str:
    low = log.lower()
    if "out of memory" in low or "outofmemoryerror" in low or rc in (-9, 137):
        return f"out of memory (exit {rc})"
    lines = log.splitlines()
    # meshspeed run's last line names the first failing rank's cause (launcher/failures.py,
    # a layer above this one)
    first = [line for line in lines if line.startswith("meshspeed run: rank ") and " failed first: " in line]
    if first:
        return f"exit {rc}: {first[-1].split(' failed first: ', 1)[1][:300]}"
    errors = [line.strip() for line in lines if "Error" in line and ":" in line]
    # torchrun's own summary lines name the child, not the error: prefer the script's line
    errors = [e for e in errors if "ChildFailedError" not in e] or errors
    return f"exit {rc}: {errors[-1][:300]}" if errors else f"exit {rc}"


def run_job(script: str, script_args: list[str], nproc: int, env: dict[str, str], log_path: Path,
            timeout: float | None) -> RunResult:
    """`meshspeed run --nproc_per_node nproc script args` in its own process group; the
    whole group is killed at the timeout."""
    cmd = [sys.executable, "-m", "meshspeed.cli", "run", "--nproc_per_node", str(nproc),
           script, *script_args]
    # the jobs import the meshspeed this tuner runs from, whatever the working directory
    home = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(filter(None, [home, os.environ.get("PYTHONPATH")]))
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **env, "PYTHONPATH": path},
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout or None)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the group we started: torchrun and its ranks
            proc.wait()
            return RunResult(False, f"timed out after {timeout:g} s", time.perf_counter() - start)
    seconds = time.perf_counter() - start
    return RunResult(rc == 0, "" if rc == 0 else _reason(rc, log_path.read_text(errors="replace")), seconds)


def probe_env(path: Path) -> dict[str, str]:
    return {PROBE_ENV: str(path)}


def trial_env(prefix: Path, start: int, end: int) -> dict[str, str]:
    return {METRICS_ENV: str(prefix), STEPS_ENV: f"{start},{end}"}


def read_metrics(prefix: Path, nproc: int) -> dict[str, float] | None:
    """The job's figures: rank 0's time (the ranks step together), the largest peak."""
    ranks = [Path(f"{prefix}.rank{r}.json") for r in range(nproc)]
    if not all(p.is_file() for p in ranks):
        return None
    figures = [json.loads(p.read_text()) for p in ranks]
    return {"step_seconds": figures[0]["step_seconds"],
            "samples_per_second": figures[0]["samples_per_second"],
            "peak_memory_bytes": max(f["peak_memory_bytes"] for f in figures),
            "step_times": figures[0].get("step_times", [])}
