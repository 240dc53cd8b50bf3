"""fp32 masters in swap files (`offload_optimizer.device: "nvme"`, Note [masters on NVMe]
in meshspeed/offload/masters.py): the same run as with the masters in memory, masters
not resident (placeholders, files, tiers), a bounded RSS, and a checkpoint round trip."""

import pytest
import torch

from meshspeed.testing import run_distributed
from meshspeed.testing.parity import assert_close_parity
from tests.offload.workers import (
    checkpoint_roundtrip,
    exact_adamw,
    masters_on_disk,
    offload,
    peak_rss_growth,
    runs_and_cleanup,
    setup,
)

SMALL = {"sub_group_size": 3000}  # several sub-groups, units split across them


def _nvme(path, params=None, **kw):
    zero = {**offload("nvme", str(path), buffer_count=kw.pop("buffer_count", 6)), **SMALL}
    if params:
        zero["offload_param"] = {"device": params, **({"nvme_path": str(path)} if params == "nvme" else {})}
    return zero


def _equal(a, b):
    assert a[0] == b[0], f"losses differ: {a[0]} vs {b[0]}"
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_masters_on_nvme_equal_masters_in_memory(stage, tmp_path):
    """Reference kernel: bit for bit the run whose masters are host buffers (cpu offload)."""
    params = "nvme" if stage == 3 else None
    setups = [setup(stage, {**offload("cpu"), **SMALL}, precision="bf16", extra_config=exact_adamw()),
              setup(stage, _nvme(tmp_path, params), precision="bf16", extra_config=exact_adamw())]
    cpu, nvme = run_distributed(runs_and_cleanup, world_size=2, args=(setups,), timeout=300)[0]
    _equal(cpu, nvme)


def test_fp32_stage3_everything_on_nvme_matches_no_offload(tmp_path):
    """fp32 with offload_param nvme: the masters are separate from the shards and swapped;
    within 1e-6 of the run without offload (fused kernel), equal with the reference one."""
    setups = [setup(3), setup(3, _nvme(tmp_path, "nvme")),
              setup(3, extra_config=exact_adamw()), setup(3, _nvme(tmp_path, "nvme"), extra_config=exact_adamw())]
    base, nv, exact, nv_exact = run_distributed(runs_and_cleanup, world_size=2, args=(setups,), timeout=300)[0]
    assert_close_parity(base, nv, rtol=1e-6, atol=1e-6)
    _equal(exact, nv_exact)
    assert list(tmp_path.iterdir()) == []  # swap directories removed with their engines


def test_masters_are_not_resident(tmp_path):
    s = setup(3, _nvme(tmp_path, "nvme"), precision="bf16", steps=2)
    r = run_distributed(masters_on_disk, world_size=2, args=(s,))[0]
    mem, psi = r["mem"], r["owned"]
    assert r["held"] and r["unit_buffers"] == 0
    assert r["placeholder_bytes"] <= 4 * 64  # one 4-byte element per master (64 tensors at most)
    assert r["files"] >= 4 * psi  # (+ padding of each unit's range)
    assert mem["master_params"] == r["files"]  # every master byte is a file byte
    # between steps the gradients are in their files, 16-bit (Note [16-bit gradient files]
    # in offload/grad_files.py): 2 bytes a parameter, each unit's file whole 4 KiB blocks
    assert 2 * psi <= mem["grads"] < r["files"]
    assert mem["tiers"]["nvme"] >= r["files"]
    assert mem["tiers"]["device"] + mem["tiers"]["host"] + mem["tiers"]["nvme"] == mem["total"]


def test_rss_drops_by_the_state_on_disk(tmp_path):
    """Measured process RSS (one rank, bf16, stage 3, offload_param nvme, ~10M parameters,
    each run in a fresh process after a warm-up): with offload_optimizer "nvme" the peak
    grows by at least 6 of the 12 bytes a parameter less than with "cpu" (fp32 masters
    4 + Adam moments 8 resident there), and stays under a cap of 40 bytes a parameter.
    Measured: ~7-8 B/param less (the swap buffer pool and allocator noise take the rest;
    at 3.7M parameters the noise, +-7 MiB, made an 8-byte bound fail one run in four).
    Not yet the issue-18 bound (what remains resident per parameter: docs/infinity.md)."""
    model = {"vocab_size": 4096, "d_model": 512, "n_layer": 2, "n_head": 4, "max_seq_len": 32}
    grow = {}
    for device in ("cpu", "nvme"):
        zero = {**_nvme(tmp_path, "nvme", buffer_count=6), "sub_group_size": 1 << 18,
                "stage3_max_live_parameters": 1 << 21, "stage3_prefetch_bucket_size": 1 << 20}
        if device == "cpu":
            zero["offload_optimizer"] = {"device": "cpu"}
        s = setup(3, zero, precision="bf16", world=1, steps=3, model=model, seq=32)
        tiny = setup(3, zero, precision="bf16", world=1, steps=3, seq=32)
        r = run_distributed(peak_rss_growth, world_size=1, args=(s, 3, tiny))[0]
        grow[device], n = r["growth"], r["numel"]
    assert grow["nvme"] + 6 * n <= grow["cpu"], {k: v / 2**20 for k, v in grow.items()}
    assert grow["nvme"] <= 40 * n, grow["nvme"] / 2**20


def test_checkpoint_round_trip_with_masters_on_nvme(tmp_path):
    swap = tmp_path / "swap"
    swap.mkdir()
    s = setup(3, _nvme(swap, "nvme"), precision="bf16", steps=6)
    tail, again = run_distributed(checkpoint_roundtrip, world_size=2, args=(s, str(tmp_path / "ckpt")))[0]
    assert tail == again


def test_initialize_peak_is_one_unit_not_the_model(tmp_path):
    """Note [units placed as they are built] (meshspeed/offload/placement.py): measured RSS
    growth of one rank from before the model is built to the end of initialize (bf16,
    stage 3, both offloads on nvme, 26M parameters in 10 units; smaller models are noisy).
    The fp32 model itself is 4 bytes a parameter; placing units as they are built adds one
    unit's master and shard on top of that, where placing them after all were built added
    every unit's fp32 master and 16-bit shard (measured 8.7-8.9 bytes a parameter then,
    4.7-4.8 now)."""
    model = {"vocab_size": 1024, "d_model": 512, "n_layer": 8, "n_head": 4, "max_seq_len": 32}
    zero = {**_nvme(tmp_path, "nvme", buffer_count=6), "sub_group_size": 1 << 18,
            "stage3_max_live_parameters": 1 << 21, "stage3_prefetch_bucket_size": 1 << 20}
    s = setup(3, zero, precision="bf16", world=1, steps=1, model=model, seq=32)
    tiny = setup(3, zero, precision="bf16", world=1, steps=1, seq=32)
    r = run_distributed(peak_rss_growth, world_size=1, args=(s, 0, tiny))[0]
    assert r["growth"] <= 6 * r["numel"], r["growth"] / r["numel"]


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_gradient_accumulation_and_clipping_equal_no_offload(stage, tmp_path):
    """gas 2 and clipping (Note [one gradient copy between steps] in
    meshspeed/offload/placement.py): the 16-bit shard accumulates over micro-steps, its fp32
    host copy is the only one kept after the boundary, and the run (reference kernel) is
    bit for bit the run without offload, whose masters read the same 16-bit shard."""
    params = "nvme" if stage == 3 else None
    kw = {"precision": "bf16", "gas": 2, "clip": 0.05, "steps": 4, "extra_config": exact_adamw()}
    setups = [setup(stage, **kw), setup(stage, _nvme(tmp_path, params), **kw)]
    base, nvme = run_distributed(runs_and_cleanup, world_size=2, args=(setups,), timeout=300)[0]
    _equal(base, nvme)
