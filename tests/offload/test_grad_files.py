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
    """fp16 from a loss scale of 2**40: the first steps overflow and are skipped on every
    rank, the scale comes down, clipping is active; skips, norms, losses and parameters
    are those of the same run without offload."""
    fp16 = {"fp16": {"enabled": True, "initial_scale_power": 40, "loss_scale_window": 2,
                     "hysteresis": 1}, **exact_adamw()}
    kw = {"precision": "fp16", "clip": 0.05, "steps": 6, "extra_config": fp16}
    setups = [setup(3, **kw), setup(3, _everything_on_nvme(tmp_path), **kw)]
    base, nvme = run_distributed(_both, world_size=2, args=(setups,), timeout=300)[0]
    assert base[2] > 0, "the run was meant to overflow at least once"
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
    # the files hold each rank's owned range in fp32; nothing of it stays in memory
    assert nvme["grad_files"] >= 4 * nvme["owned"]
    # memory_breakdown counts the gradients from their files: none is in memory
    assert nvme["mem"]["grads"] == nvme["grad_files"], nvme["mem"]
    assert base["mem"]["grads"] >= 2 * base["owned"]  # (the run without offload keeps them)


def _grads_both(setups):
    return [grads_between_backward_and_step(s) for s in setups]
