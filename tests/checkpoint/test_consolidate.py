"""Whole weights out of a sharded checkpoint: `consolidate`, `meshspeed convert` (streamed,
memory bounded by the largest parameter), and `save_16bit_model` under ZeRO-3."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from meshspeed import cli
from meshspeed.checkpoint import consolidate
from meshspeed.testing.harness import run_distributed
from tests.checkpoint import workers

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    return root, run_distributed(workers.save_for_export, 2, args=(str(root),))[0]


def test_consolidate_equals_the_gathered_state_dict(exported):
    root, out = exported
    state = out["fp32"]["state"]
    assert out["fp32"]["resident_numel_outside"] < sum(t.numel() for t in state.values()) // 2
    full = consolidate(root / "fp32")
    assert full.keys() == state.keys()  # tied lm_head.weight included
    assert full["lm_head.weight"] is full["tok_emb.weight"]
    for k in state:
        assert torch.equal(full[k], state[k]), k
    assert all(t.numel() and t.abs().sum() > 0 for t in state.values())  # real weights


def test_save_16bit_model_writes_real_weights_under_zero3(exported):
    root, out = exported
    saved = load_file(out["bf16"]["file"])
    state = out["bf16"]["state"]
    assert saved.keys() == state.keys()
    for k in state:
        assert saved[k].dtype == torch.bfloat16 and torch.equal(saved[k], state[k]), k
    # the bf16 weights are the fp32 masters rounded, as consolidate(dtype=bf16) computes them
    full = consolidate(root / "bf16", dtype=torch.bfloat16)
    assert all(torch.equal(full[k], saved[k]) for k in saved)
    with safe_open(out["bf16"]["file"], "pt") as f:
        assert f.metadata() == {"format": "pt"}


@pytest.mark.parametrize("dtype,torch_dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_convert_command(exported, tmp_path, dtype, torch_dtype):
    root, _ = exported
    target = tmp_path / "model.safetensors"
    assert cli.main(["convert", str(root / "fp32"), str(target), "--dtype", dtype]) == 0
    written = load_file(str(target))
    expected = consolidate(root / "fp32", dtype=torch_dtype)
    assert written.keys() == expected.keys()
    assert all(written[k].dtype == torch_dtype and torch.equal(written[k], expected[k]) for k in expected)


def test_convert_command_reports_errors(tmp_path, capsys):
    assert cli.main(["convert", str(tmp_path / "none"), str(tmp_path / "x.safetensors")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshspeed convert:") and "does not exist" in err and "\n" not in err


MEASURE = textwrap.dedent("""
    import re, sys, torch
    from meshspeed.checkpoint import convert

    def kib(field):
        return int(re.search(field + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1))

    ckpt, out, dtype = sys.argv[1], sys.argv[2], getattr(torch, sys.argv[3])
    convert(ckpt, out + ".warmup", dtype=dtype)  # first-call allocations are not the model
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak-RSS mark
    before = kib("VmRSS")
    convert(ckpt, out, dtype=dtype)
    print((kib("VmHWM") - before) * 1024)
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_convert_streams_one_parameter_at_a_time(tmp_path_factory, dtype):
    root = tmp_path_factory.getbasetemp() / "wide"
    if not root.exists():
        run_distributed(workers.save_wide, 2, args=(str(root),))
    largest, total = 8 * 2**20, (10 * 4 + 8) * 2**20  # fp32 bytes of the model
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", MEASURE, str(root), str(root / f"{dtype}.st"), dtype],
                            env=env, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    peak = int(result.stdout.split()[-1])
    assert peak < 3 * largest < total, f"peak extra memory {peak / 2**20:.1f} MiB"
