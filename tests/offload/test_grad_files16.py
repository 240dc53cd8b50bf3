"""16-bit gradient files (Note [16-bit gradient files] in meshspeed/offload/grad_files.py):
a unit's file holds its reduced shard in the training dtype, loss-scaled under fp16 and
unscaled on read. The step's gradient I/O is 2 bytes a parameter each way, and the
results are bit for bit those of the run that keeps its gradients in memory, the fp32
reduction (`communication_data_type fp32`) and gradient accumulation included."""

import os
from types import SimpleNamespace

import pytest
import torch

from meshspeed.offload import close, grad_files
from meshspeed.offload.aio import SwapEngine
from meshspeed.offload.grad_files import GradFiles, _widen
from meshspeed.offload.hostmem import ALIGN, host_empty
from meshspeed.testing import run_distributed
from meshspeed.testing.parity import full_state_dict
from tests.offload.workers import (
    _engine,
    exact_adamw,
    setup,
    skipped_run,
    train_counting_last_step,
)

# a model whose step moves some MiB (the 4 KiB file alignment is then a small part of it)
MODEL = {"vocab_size": 512, "d_model": 64}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", [1, 5000, 300_001])
@pytest.mark.parametrize("room", [0, 4096 * 7])
def test_widening_in_place_equals_float(dtype, numel, room):
    """Note [widening in place]: 16-bit values read into the top of an fp32 buffer come
    out as `.float()` of them, infinities and NaN included, for a buffer just large
    enough (room 0) and a larger one."""
    g = torch.Generator().manual_seed(numel)
    values = (torch.randn(numel, generator=g) * 1e3).to(dtype)
    values[:: 97] = float("inf")
    values[1:: 89] = float("nan")
    nbytes = -(-numel * 4 // ALIGN) * ALIGN + room
    buf = host_empty(nbytes // 4, align=ALIGN)
    h = (nbytes - numel * 2) // ALIGN * ALIGN
    narrow = buf.view(torch.uint8)[h : h + numel * 2].view(dtype)
    narrow.copy_(values)
    _widen(buf, narrow, h, numel)
    assert torch.equal(buf[:numel].nan_to_num(), values.float().nan_to_num())
    assert torch.equal(buf[:numel].isnan(), values.isnan())


def _nvme(path, **extra) -> dict:
    return {"sub_group_size": 30_000, "stage3_param_persistence_threshold": 0,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(path), "buffer_count": 8},
            "offload_param": {"device": "nvme", "nvme_path": str(path)}, **extra}


def _grad_io(s, wide: bool) -> dict:
    """Bytes the swap engines read and wrote in the last step (io_totals), this rank's
    owned count, and the final state; `wide`: gradient files forced to fp32 (the files
    before 16-bit ones), for the byte count to compare with."""
    narrow = grad_files.file_dtype
    if wide:  # (ranks may serve later tests: put it back)
        grad_files.file_dtype = lambda unit: torch.float32
    try:
        engine = _engine(s)
        losses, moved = train_counting_last_step(engine, s)
        out = {**moved, "owned": sum(sl.end - sl.start for sl in engine.strategy.owned_slices()),
               "units": len(engine.strategy.units), "losses": losses, "state": full_state_dict(engine)}
        close(engine)
    finally:
        grad_files.file_dtype = narrow
    return out


def _io_both(setups):
    return [_grad_io(s, wide) for s, wide in zip(setups, (False, True))]


def test_a_step_reads_and_writes_two_bytes_of_gradient_per_parameter(tmp_path):
    """The same bf16 step with 16-bit and with fp32 gradient files: the 16-bit one reads
    and writes 2 bytes a parameter less (io_totals), every other transfer the same, and
    trains to the same losses and parameters (the fp32 file held the 16-bit value)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    kw = {"precision": "bf16", "steps": 2, "world": 1, "model": MODEL, "extra_config": exact_adamw()}
    setups = [setup(3, _nvme(tmp_path / "a"), **kw), setup(3, _nvme(tmp_path / "b"), **kw)]
    narrow, wide = run_distributed(_io_both, world_size=1, args=(setups,), timeout=300)[0]
    owned = narrow["owned"]
    assert owned > 100_000, owned
    # reads are of the owned runs, exact; each unit's write is rounded up to 4 KiB
    assert wide["read"] - narrow["read"] == 2 * owned, (wide["read"], narrow["read"], owned)
    slack = ALIGN * narrow["units"]
    assert abs(wide["write"] - narrow["write"] - 2 * owned) <= slack, (wide["write"], narrow["write"], owned)
    assert narrow["losses"] == wide["losses"]
    for name, value in wide["state"].items():
        assert torch.equal(narrow["state"][name], value), name


def _runs(setups):
    return [skipped_run(s) for s in setups]


@pytest.mark.parametrize("world", [1, 2])
def test_bf16_and_fp16_with_fp32_reduction_and_accumulation_equal_gradients_in_memory(world, tmp_path):
    """bf16, and fp16 from a loss scale that overflows at first and then steps scaled, each reducing in fp32 over
    two micro-steps with clipping active: the NVMe run (16-bit gradient files) and the
    run without offload take the same skips, norms, losses and parameters, bit for bit:
    the reduced shard is 16-bit when it lands, whatever the reduction ran in."""
    # 2**20: the first step overflows, the next ones are taken at 2**19
    fp16 = {"fp16": {"enabled": True, "initial_scale_power": 20, "loss_scale_window": 2,
                     "hysteresis": 1}}
    common = {"communication_data_type": "fp32", **exact_adamw()}
    kw = {"clip": 0.05, "steps": 4, "gas": 2, "world": world, "model": MODEL}
    setups = []
    for precision, extra in (("bf16", {}), ("fp16", fp16)):
        (tmp_path / precision).mkdir()
        for zero in ({"stage3_param_persistence_threshold": 0}, _nvme(tmp_path / precision)):
            setups.append(setup(3, zero, precision=precision, extra_config={**common, **extra}, **kw))
    runs = run_distributed(_runs, world_size=world, args=(setups,), timeout=300)[0]
    assert 0 < runs[2][2] < 4, f"the fp16 run was meant to skip some steps and take some, skipped {runs[2][2]}"
    for name, base, nvme in (("bf16", runs[0], runs[1]), ("fp16", runs[2], runs[3])):
        assert nvme[2] == base[2], f"{name}: skipped steps {nvme[2]} with gradient files, {base[2]} without"
        assert nvme[3] == base[3], f"{name}: last gradient norm {nvme[3]} vs {base[3]}"
        assert nvme[0] == base[0], f"{name}: losses differ: {nvme[0]} vs {base[0]}"
        for key in base[1]:
            assert torch.equal(nvme[1][key], base[1][key]), (name, key)


def _unit(dtype, values, spans):
    masters = [torch.nn.Parameter(torch.zeros(n)) for _, n in spans]
    return SimpleNamespace(dtype=dtype, grad_shard=values.to(dtype),
                           spans=[SimpleNamespace(offset=o, numel=n) for o, n in spans], masters=masters)


@pytest.mark.parametrize("narrow", [torch.bfloat16, torch.float16])
def test_a_round_trip_through_the_files_is_the_in_memory_arithmetic(narrow, tmp_path):
    """GradFiles alone, a 16-bit unit next to an fp32 one in one sub-group: what `finish`
    and `read` give back is the shard widened, times 1/loss scale, times the clip
    coefficient (the in-memory order); the norms are those of the unscaled fp32 spans;
    the 16-bit file is 2 bytes an element (rounded up to 4 KiB), the fp32 one 4."""
    g = torch.Generator().manual_seed(0)
    units = [_unit(narrow, torch.randn(5000, generator=g) * 300, [(0, 1200), (1200, 3800)]),
             _unit(torch.float32, torch.randn(5000, generator=g), [(0, 5000)])]
    files = GradFiles(str(tmp_path), SwapEngine(), SimpleNamespace(units=units))
    files.loss_scale = 2.0 ** 10
    for unit in units:
        files.land(unit)
    files.wait()
    assert [os.path.getsize(files.path(u)) for u in (0, 1)] == [12288, 20480]

    def expected(u, lo, n, coef=None):
        out = units[u].grad_shard[lo : lo + n].float() * (1.0 / 2 ** 10)
        return out if coef is None else out * coef

    for unit in units:
        for s, m in zip(unit.spans, unit.masters):
            want = torch.linalg.vector_norm(expected(units.index(unit), s.offset, s.numel))
            assert torch.equal(files.norms([m]), want.reshape(1))
    coef = torch.tensor(0.37)
    files.clip_(coef)
    runs = [(0, 0, 0, 1200), (1, 0, 1200, 3000), (0, 1200, 4200, 3800)]  # (unit, file, buffer, numel)
    buf = host_empty(8192, align=ALIGN)
    for request in files.read_runs(runs, buf):
        request.wait()
    files.finish(runs, buf)
    for u, f, b, n in runs:
        assert torch.equal(buf[b : b + n], expected(u, f, n, coef)), (u, f)
    assert torch.equal(files.read(units[0], 1000, 700), expected(0, 1000, 700, coef))
    files.close()


def test_landing_reuses_its_buffers_within_the_bound_and_still_finds_inf_and_nan(tmp_path):
    """Note [landing without fresh pages]: the write copies of equal-sized units are reused
    once their writes are done, the copies pending and spare stay within max_pending_bytes
    plus one, and the files hold the shards. The overflow check reads the norm first: a
    finite norm means no inf or NaN; a norm that overflowed on finite values (1e30 squared)
    does not count as an overflow, an inf or a NaN does."""
    g = torch.Generator().manual_seed(1)
    units = [_unit(torch.bfloat16, torch.randn(6000, generator=g), [(0, 2000), (2000, 4000)])
             for _ in range(12)]
    files = GradFiles(str(tmp_path), SwapEngine(), SimpleNamespace(units=units),
                      max_pending_bytes=3 * 12288)
    copies = set()
    for unit in units:
        files.land(unit)
        copies.add(files._pending[-1][1].data_ptr())
        held = sum(t.nbytes for _, t in files._pending) + sum(t.nbytes for t in files._spares)
        assert held <= files.max_pending_bytes + 12288
    files.wait()
    assert len(copies) < len(units), "no write copy was reused"
    assert not files.nonfinite
    for unit in units:
        assert torch.equal(files.read(unit, 0, 6000), unit.grad_shard.float())
    files.reset()

    def lands(values, dtype=torch.float32):
        units[:] = [_unit(dtype, values, [(0, values.numel())])]
        files._unit_index.clear()  # (a new unit object at index 0)
        files.land(units[0])
        found, files.nonfinite = files.nonfinite, False
        files._norm.clear()
        return found

    big = torch.full((64,), 1e30)
    assert lands(big) is False  # the norm is inf, every element finite
    assert torch.isinf(torch.linalg.vector_norm(big))
    for bad in (float("inf"), float("-inf"), float("nan")):
        values = torch.ones(64)
        values[17] = bad
        assert lands(values) is True, bad
        assert lands(values, torch.bfloat16) is True, bad
    files.close()
