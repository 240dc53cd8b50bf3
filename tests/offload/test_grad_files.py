"""Gradients in their NVMe slot (Note [gradients in their NVMe slot] in
meshspeed/offload/grad_files.py): with `offload_optimizer.device: "nvme"` each unit's
reduced gradient goes to a file as it lands, and the engine's boundary (unscale, overflow
skip, clipping norm, clip) runs on what was recorded on the way, bit for bit the run
that keeps the gradients in memory."""

import pytest
import torch

from meshspeed.testing import run_distributed
from tests.offload.workers import (
    exact_adamw,
    grads_between_backward_and_step,
    io_per_step,
    offload,
    setup,
    skipped_run,
)


def _everything_on_nvme(path, stage=3):
    zero = {**offload("nvme", str(path), buffer_count=8), "sub_group_size": 3000}
    if stage == 3:
        zero["offload_param"] = {"device": "nvme", "nvme_path": str(path)}
    return zero


def test_fp16_overflow_skips_and_clipping_equal_gradients_in_memory(tmp_path):
    """fp16 from a loss scale of 2**20: the first steps overflow and are skipped on every
    rank, the scale comes down and the rest step on loss-scaled 16-bit gradient files,
    clipping is active; skips, norms, losses and parameters are those of the same run
    without offload."""
    fp16 = {"fp16": {"enabled": True, "initial_scale_power": 20, "loss_scale_window": 2,
                     "hysteresis": 1}, **exact_adamw()}
    kw = {"precision": "fp16", "clip": 0.05, "steps": 6, "extra_config": fp16}
    setups = [setup(3, **kw), setup(3, _everything_on_nvme(tmp_path), **kw)]
    base, nvme = run_distributed(_both, world_size=2, args=(setups,), timeout=300)[0]
    assert 0 < base[2] < 6, f"the run was meant to skip some steps and take some, skipped {base[2]}"
    assert nvme[2] == base[2], f"skipped steps: {nvme[2]} with gradient files, {base[2]} without"
    assert nvme[3] == base[3], f"last gradient norm {nvme[3]} vs {base[3]}"
    assert nvme[0] == base[0], f"losses differ: {nvme[0]} vs {base[0]}"
    for name in base[1]:
        assert torch.equal(nvme[1][name], base[1][name]), name


def _both(setups):
    return [skipped_run(s) for s in setups]


@pytest.mark.parametrize("stage", [2, 3])
def test_no_gradient_held_in_memory_and_safe_get_full_grad_reads_the_file(stage, tmp_path):
    kw = {"precision": "bf16", "extra_config": exact_adamw()}
    setups = [setup(stage, **kw), setup(stage, _everything_on_nvme(tmp_path, stage), **kw)]
    base, nvme = run_distributed(_grads_both, world_size=2, args=(setups,), timeout=300)[0]
    for name, g in base["grads"].items():
        assert nvme["grads"][name] is not None, name
        assert torch.equal(nvme["grads"][name], g), name
    # the files hold each rank's owned range in bf16; nothing of it stays in memory
    assert 2 * nvme["owned"] <= nvme["grad_files"] < 4 * nvme["owned"]
    # memory_breakdown counts the gradients from their files: none is in memory
    assert nvme["mem"]["grads"] == nvme["grad_files"], nvme["mem"]
    assert base["mem"]["grads"] >= 2 * base["owned"]  # (the run without offload keeps them)


def _grads_both(setups):
    return [grads_between_backward_and_step(s) for s in setups]


def _io(setups):
    return [io_per_step(s) for s in setups]


def test_each_rank_moves_only_its_own_slices(tmp_path):
    """Bandwidth-centric partitioning (ZeRO-Infinity, Section 6.1): at dp 2 each rank reads
    and writes its own 1/2 of every state, so a step moves half the bytes per rank that
    it moves at dp 1 (and the two ranks together the same total), and the bytes are the
    per-parameter sum of what a step touches: the 16-bit shard read for forward and for
    backward and written once, fp32 masters and two moments each read and written, and the
    16-bit gradient written at the boundary and read by the step (Note [16-bit gradient
    files]): 2 bytes a parameter each way, not fp32's 4."""
    kw = {"precision": "bf16", "steps": 2, "extra_config": exact_adamw()}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    one = run_distributed(_io, world_size=1, args=([setup(3, _everything_on_nvme(tmp_path / "a"), world=1, **kw)],),
                          timeout=300)[0][0]
    two = run_distributed(_io, world_size=2, args=([setup(3, _everything_on_nvme(tmp_path / "b"), world=2, **kw)],),
                          timeout=300)
    two = [r[0] for r in two]
    per_param_read, per_param_write = 2 * 2 + 3 * 4 + 2, 2 + 3 * 4 + 2
    for r in (one, *two):
        # files are written in 4 KiB-aligned requests, so allow a little over the exact sum
        assert per_param_read * r["owned"] <= r["read"] <= 1.1 * per_param_read * r["owned"] + (1 << 20), r
        assert per_param_write * r["owned"] <= r["write"] <= 1.1 * per_param_write * r["owned"] + (1 << 20), r
    assert abs(sum(r["owned"] for r in two) - one["owned"]) <= 2 * 64  # shards padded to equal size
    for r in two:
        assert r["owned"] * 2 <= one["owned"] + 2 * 64
