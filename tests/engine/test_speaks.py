"""The library speaks (issue 32): with no logging set-up in the user's script, rank 0
prints the start-up banner, the steps_per_print lines and wall_clock_breakdown's once; a program that configured
logging gets each line once, through its own handlers; the config key and the
environment variable quiet it (Note [meshspeed's own handler], meshspeed/process/speak.py)."""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from meshspeed.process import speak

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("speaks_script.py")
BANNER = re.compile(r"meshspeed \S+: pp 1 x dp (\d) x cp 1 x tp 1 \(\d processes\), ZeRO stage 1, "
                    r"float32, offload none$")
STEP = re.compile(r"step (\d+), loss [0-9.]+, lr 0\.001, grad norm [0-9.]+, [0-9,]+ tokens/s, "
                  r"[0-9.]+ s/step$")


def _run(argv: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MESHSPEED_", "RANK", "WORLD_SIZE",
                                                                    "LOCAL_", "MASTER_", "TORCHELASTIC"))}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, *argv], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def _phases(stdout: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {"before": []}
    current = out["before"]
    for line in stdout.splitlines():
        if line.startswith("PHASE "):
            current = out.setdefault(line.split()[1], [])
        else:
            current.append(line)
    return out


def test_rank_0_speaks_once_quiets_on_request_and_defers_to_basic_config(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = _run(["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
                 str(SCRIPT)], tmp_path)
    phases = _phases(proc.stdout)
    assert phases["before"] == phases["quiet"] == phases["env"] == phases["end"] == [], proc.stdout
    # the default: rank 0's banner, then two step lines each with its wall_clock_breakdown
    # line, once each (rank 1 says nothing)
    default = phases["default"]
    assert len(default) == 7 and all(line.startswith("[meshspeed] ") for line in default), default
    default = [line.removeprefix("[meshspeed] ") for line in default]
    banner = BANNER.match(default[0])
    assert banner and banner.group(1) == "2", default
    assert default[1].startswith("model 4,656 parameters (the whole model); 0.04 MiB of model state on rank 0")
    assert default[2] == "batch: micro batch 2 x accumulation 1 x dp 2 = 4 samples per step"
    steps = [STEP.match(line) for line in default[3::2]]
    assert [int(m.group(1)) for m in steps if m] == [2, 4], default
    assert all(re.match(rf"step {n}: time per step \(ms, mean of 2\): forward ", line)
               for n, line in zip((2, 4), default[4::2])), default
    # the script's basicConfig: the same lines, once each, through its handler only
    user = phases["user"]
    assert len(user) == 4 and all(line.startswith("USER ") for line in user), user
    assert [line.removeprefix("USER ") for line in user[:3]] == default[:3]
    assert STEP.match(user[3].removeprefix("USER ")), user


@pytest.fixture
def bare_logging(monkeypatch):
    """A fresh "meshspeed" logger and no root handlers: call it inside the test (pytest adds
    its handlers to the root logger at the start of each phase); they come back after."""
    root, log = logging.getLogger(), logging.getLogger("meshspeed")
    saved = (log.handlers[:], log.level, log.propagate)
    monkeypatch.delenv(speak.ENV, raising=False)
    monkeypatch.setenv("RANK", "0")
    # the rank comes from RANK here even where an earlier in-process test left a process group
    monkeypatch.setattr(speak.comm, "is_initialized", lambda: False)
    roots = []

    def bare():
        roots.extend(root.handlers)
        root.handlers.clear()
        log.handlers.clear()
        log.setLevel(logging.NOTSET)
        return log

    yield bare
    root.handlers.extend(h for h in roots if h not in root.handlers)
    log.handlers[:] = saved[0]
    log.setLevel(saved[1])
    log.propagate = saved[2]


def test_speak_attaches_one_handler_however_often_it_runs(bare_logging, monkeypatch):
    log = bare_logging()
    speak.speak()
    speak.speak("debug")
    ours = [h for h in log.handlers if isinstance(h, speak.MeshspeedHandler)]
    assert len(ours) == 1 and log.level == logging.DEBUG and not log.propagate
    monkeypatch.setenv("RANK", "1")  # other ranks: warnings and errors only
    speak.speak("info")
    assert log.level == logging.WARNING
    monkeypatch.setenv(speak.ENV, "loud")
    with pytest.raises(ValueError, match="MESHSPEED_LOG_LEVEL='loud' is not a log level; use one of"):
        speak.speak()


def test_speak_hands_over_to_logging_configured_later(bare_logging):
    log = bare_logging()
    speak.speak()
    logging.getLogger().addHandler(logging.NullHandler())
    speak.speak()
    assert log.handlers == [] and log.propagate and log.level == logging.NOTSET
