"""benchmarks/infinity_frameworks.py without running a framework: what `--tutorial-config`
leaves out of the config, the table's columns, and disk_meter.py's per-interval counts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import infinity_frameworks  # lazy: benchmarks/ is on sys.path only inside this fixture

    return infinity_frameworks


def test_tutorial_config_leaves_the_tuned_knobs_unset_in_both_offloads(bench):
    tuned = bench.config(bench.parse_args(["--sub-group-size", "123"]), "/swap")
    tutorial = bench.config(bench.parse_args(["--tutorial-config"]), "/swap")
    z, t = tuned["zero_optimization"], tutorial["zero_optimization"]
    assert z["sub_group_size"] == 123 and "sub_group_size" not in t
    assert "stage3_max_live_parameters" in z and "stage3_max_live_parameters" not in t
    assert t["offload_optimizer"] == {"device": "nvme", "nvme_path": "/swap"}
    assert t["offload_param"] == {"device": "nvme", "nvme_path": "/swap"}
    # what the tutorial does not tune stays the same in both
    assert t["stage3_param_persistence_threshold"] == z["stage3_param_persistence_threshold"] == 0
    assert tutorial["gradient_clipping"] == 0.0


def _result(name: str, step: float, read: float, hwm: int) -> dict:
    io = {"read_bytes": read, "write_bytes": read / 2, "busy_fraction": 0.5, "disk_read_bytes": read,
          "disk_write_bytes": read, "wall_s": step}
    return {"framework": name, "version": "v", "params": 3e8, "model": {"d_model": 768, "n_layer": 35},
            "disk_device": "vda", "step_s": [2 * step, step, step], "step_cpu_s": [1.0] * 3,
            "fwd_bwd_s": [1.0] * 3, "step_io": [io] * 3, "hwm": hwm, "rss_start": 2**28,
            "swap_bytes_initialized": 2**30, "swap_bytes": 2**31, "losses": [1.0, 0.5, 0.25],
            "other_load": 0.0, "wall_s": 10.0, "phase_peaks": {"build": 2**30}, "swap_layout": {}}


def test_the_table_has_a_ratio_for_every_measured_column(bench):
    args = bench.parse_args([])
    results = {"meshspeed": bench.summarise(_result("meshspeed", 5.0, 4e9, 3 * 2**30)),
               "deepspeed": bench.summarise(_result("deepspeed", 10.0, 8e9, 6 * 2**30))}
    text = bench.render_markdown(results, args, "cmd")
    rows = [line for line in text.splitlines() if line.startswith("|")]
    header, ratio = rows[0], rows[-1]
    assert all(row.count("|") == header.count("|") for row in rows), rows
    cells = dict(zip(header.split("|")[2:-1], ratio.split("|")[2:-1], strict=True))
    assert cells[" step time (median of steps 2..N) "].strip() == "0.50x"
    assert cells[" read / step "].strip() == "0.50x"
    assert cells[" peak RSS (VmHWM) "].strip() == "0.50x"
    assert cells[" disk busy "].strip() == "1.00x"
    assert "DeepSpeed at 2.0B parameters, estimated" in text


def test_disk_meter_counts_a_written_file(bench, tmp_path):
    import disk_meter  # lazy: benchmarks/ joins sys.path in the fixture

    meter = disk_meter.DiskMeter(str(tmp_path))
    if meter.device is None:
        pytest.skip(f"{tmp_path} has no block device of its own (tmpfs?): nothing to count")
    before = meter.snapshot()
    data = os.urandom(1 << 20)
    with open(tmp_path / "f", "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    got = meter.delta(before, meter.snapshot())
    assert got["write_bytes"] >= len(data), got
    assert got["disk_write_bytes"] >= len(data), got
    assert 0 <= got["busy_s"] and got["wall_s"] > 0, got
