"""`meshspeed demo` end to end, through the README's entry point (the `meshspeed` console
script; `python -m meshspeed.cli` where the script is not installed): 2 ranks under
torchrun, a small model on a small corpus for a few steps. Each run takes a few seconds,
almost all of it process start-up (three interpreters importing torch, the rendezvous)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from meshspeed.demo import _check, add_arguments, memory_lines

ROOT = Path(__file__).resolve().parents[2]  # this checkout: the ranks import meshspeed from here
STEPS = 12
QUICK = ["--steps", str(STEPS), "--print-every", "1", "--corpus-bytes", "100000",
         "--seq-len", "64", "--micro-batch", "8", "--layers", "2", "--d-model", "64"]
_MIB = r"([0-9.]+) MiB"


def _command() -> list[str]:
    script = Path(sys.executable).with_name("meshspeed")
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script), "demo"]
    return [sys.executable, "-m", "meshspeed.cli", "demo"]


def _run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["TMPDIR"] = str(tmp_path)  # where --offload nvme makes its swap directory
    env["PYTHONIOENCODING"] = "utf-8"  # the sampled text may hold U+FFFD
    return subprocess.run(_command() + args, cwd=tmp_path, env=env, capture_output=True,
                          encoding="utf-8", errors="replace", timeout=300, check=False)


def _lines(text: str) -> list[str]:
    """Output lines, with tqdm's carriage-return redraws split apart."""
    return [part.strip() for line in text.splitlines() for part in line.split("\r") if part.strip()]


def _line(lines: list[str], prefix: str) -> str:
    found = [line for line in lines if line.startswith(prefix)]
    assert len(found) == 1, f"expected one {prefix!r} line, got {found}"
    return found[0]


def _mib(line: str, key: str) -> float:
    m = re.search(rf"\b{key} {_MIB}", line)
    assert m, f"no {key!r} in {line!r}"
    return float(m.group(1))


CASES = [
    pytest.param(0, [], id="stage0"),
    pytest.param(1, [], id="stage1"),
    pytest.param(2, [], id="stage2"),
    pytest.param(3, [], id="stage3"),
    pytest.param(2, ["--bf16"], id="stage2-bf16"),
    pytest.param(3, ["--offload", "nvme"], id="stage3-offload-nvme"),
]


@pytest.mark.parametrize("stage,extra", CASES)
def test_demo_trains_and_prints_its_summary(tmp_path, stage, extra):
    proc = _run(QUICK + ["--stage", str(stage)] + extra, tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert f"ZeRO stage {stage}," in proc.stdout, out[-4000:]
    # the whole model's parameters at every stage (stage 3 once counted its shard: 0.00M),
    # in meshspeed's banner and the demo's line; and no progress-bar redraws in a log
    assert "model 139,584 parameters (the whole model)" in proc.stdout, out[-4000:]
    assert "0.14M parameters, 2 ranks" in proc.stdout, out[-4000:]
    assert "\r" not in proc.stdout
    # training output, then the sampled text (free-form), then the summary
    training, rest = proc.stdout.split("--- sample (prompt 'def ') ---", 1)
    lines = _lines(rest.split("--- summary ---", 1)[1])

    losses = [float(m.group(2)) for line in _lines(training)
              if (m := re.match(r"step\s+(\d+)\s+loss\s+([0-9.]+)\s", line))]
    assert len(losses) == STEPS, lines
    assert losses[-1] < losses[0] - 0.25, f"loss did not fall: {losses}"

    final = _line(lines, "final loss (smoothed)")
    assert re.match(r"final loss \(smoothed\)\s+[0-9.]+ nats/byte", final), final
    assert re.match(r"throughput\s+[0-9,]+ tokens/s over [0-9.]+ s$", _line(lines, "throughput"))

    state = _line(lines, "model state per rank")
    params, total = _mib(state, "params"), _mib(state, "total")
    assert 0 < params <= total
    assert _mib(state, "optimizer_state") > 0
    tiers = _line(lines, "tiers per rank")
    device, host, nvme = (_mib(tiers, k) for k in ("device", "host", "nvme"))
    assert abs(device + host + nvme - total) <= 0.02, (state, tiers)  # each rounded to 0.01
    if "--offload" in extra:
        assert nvme > 0 and host > 0, tiers
        assert not list(tmp_path.glob("meshspeed-demo-nvme-*")), "swap directory left behind"
    else:
        assert host == nvme == 0 and device == total, tiers
    assert _line(lines, "perplexity")


def test_offload_with_stage_0_is_refused_in_one_line(tmp_path):
    proc = _run(QUICK + ["--stage", "0", "--offload", "cpu"], tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1, proc.stderr
    assert "--offload cpu" in err[0] and "--stage 1, 2 or 3" in err[0]
    assert "--offload none" in err[0]
    assert "training" not in proc.stdout  # refused before any rank started


@pytest.mark.parametrize("argv,expected", [
    (["--nproc", "3", "--tp", "2"], "--tp 2 must divide --nproc (3) and --heads (4); e.g. --nproc 4 --tp 2"),
    (["--nproc", "4", "--tp", "0"], "--nproc and --tp must be at least 1"),
])
def test_tp_options_are_checked_in_one_line(argv, expected):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert expected in _check(parser.parse_args(argv))


def test_memory_lines_show_categories_and_the_nested_tiers():
    mem = {"params": 2 * 2**20, "gathered_params": 0, "grads": 2**20, "total": 3 * 2**20,
           "tiers": {"device": 2**20, "host": 2 * 2**20, "nvme": 0}}
    assert memory_lines(mem) == [
        "model state per rank   params 2.00 MiB, grads 1.00 MiB, total 3.00 MiB",
        "tiers per rank         device 1.00 MiB, host 2.00 MiB, nvme 0.00 MiB",
    ]
