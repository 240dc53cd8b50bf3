"""The 1-bit error-compensated all-reduce: packing, error feedback, scales (one process),
and the two-stage all-reduce on 2 and 4 gloo ranks (result, agreement, bytes)."""

import math

import pytest
import torch

from meshspeed import comm
from meshspeed.comm.compressed import (
    CompressedAllReduce,
    compress_,
    compress_segments_,
    compressed_allreduce_bytes,
    pack_signs,
    padded_numel,
    unpack_signs,
)
from meshspeed.testing import run_distributed


def test_pack_round_trip_is_eight_signs_per_byte():
    x = torch.randn(64)
    x[3] = 0.0  # sign(0) is +1
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == 8
    expected = torch.where(x >= 0, 1.0, -1.0)
    assert torch.equal(unpack_signs(packed), expected)
    assert pack_signs(torch.tensor([1.0, -1, -1, -1, -1, -1, -1, -2])).item() == 128
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_signs(torch.ones(7))


def test_scale_is_the_rms_and_the_error_is_what_was_missed():
    x = torch.randn(40)
    error = torch.zeros(40)
    packed, scale = compress_(x.clone(), error)
    assert scale.item() == pytest.approx(x.norm().item() / math.sqrt(40), rel=1e-6)
    decoded = unpack_signs(packed) * scale
    torch.testing.assert_close(decoded + error, x)


def test_one_scale_per_tensor():
    """Segments of columns (tensors side by side, Note [layout of the compressed buffer])
    each get the rms of their own elements, so a small tensor keeps its magnitude."""
    x = torch.cat([torch.randn(2, 8) * 100, torch.randn(2, 16) * 0.01], dim=1)
    segment_of = torch.tensor([0] * 8 + [1] * 16)
    error = torch.zeros_like(x)
    packed, scales = compress_segments_(x.clone(), error, segment_of, torch.tensor([16.0, 32.0]))
    assert scales[0] == pytest.approx(x[:, :8].pow(2).mean().sqrt().item(), rel=1e-5)
    assert scales[1] == pytest.approx(x[:, 8:].pow(2).mean().sqrt().item(), rel=1e-5)
    decoded = unpack_signs(packed).view(2, 24) * scales[segment_of]
    torch.testing.assert_close(decoded + error, x)


def test_error_feedback_loses_nothing_over_many_calls():
    """sum of compressed outputs + final error == sum of inputs (Alg. 1's invariant)."""
    g = torch.Generator().manual_seed(0)
    error = torch.zeros(256)
    sent, given = torch.zeros(256, dtype=torch.float64), torch.zeros(256, dtype=torch.float64)
    for _ in range(50):
        x = torch.randn(256, generator=g)
        given += x.double()
        packed, scale = compress_(x.clone(), error)
        sent += (unpack_signs(packed) * scale).double()
    torch.testing.assert_close(sent + error.double(), given, rtol=0, atol=1e-4)


def test_bytes_formula():
    assert padded_numel(100, 2) == 112 and padded_numel(112, 2) == 112
    # 2 ranks, 1600 elements: signs 200 bytes, each rank sends half of them twice, plus 2 x 4 scale bytes
    assert compressed_allreduce_bytes(1600, 2) == 100 + 100 + 8
    assert compressed_allreduce_bytes(1600, 1) == 0
    # two tensors: each padded alone (100 -> 112, 1500 -> 1504), two scales each
    assert compressed_allreduce_bytes([100, 1500], 2) == 2 * (1616 // 8 // 2) + 2 * 4 * 2


def _allreduce_rounds(numel: int, rounds: int):
    torch.manual_seed(comm.get_rank())
    ar = CompressedAllReduce(numel)
    outs, means = [], []
    with comm.CommCounter() as counter:
        for _ in range(rounds):
            x = torch.randn(numel)
            exact = x.clone()
            comm.all_reduce(exact, op="avg")
            counter_before = counter.summary()
            (out,) = ar([x.clone()])
            outs.append(out)
            means.append(exact)
    summary = counter.summary()
    per_call = {op: summary[op]["bytes"] - counter_before[op]["bytes"] for op in ("all_to_all", "all_gather")}
    return outs, means, per_call, ar.worker_error, ar.server_error


@pytest.mark.parametrize("world", [2, 4])
def test_two_stage_allreduce_agrees_and_tracks_the_mean(world):
    numel, rounds = 4000, 20  # big enough that the scales are small next to the signs
    results = run_distributed(_allreduce_rounds, world, args=(numel, rounds))
    outs0, means0, bytes0, _, _ = results[0]
    for outs, _, per_call, _, _ in results[1:]:  # every rank holds the same result
        for a, b in zip(outs, outs0):
            assert torch.equal(a, b)
        assert per_call == bytes0
    assert sum(bytes0.values()) == compressed_allreduce_bytes(numel, world)
    fp32 = comm.ring_bytes("all_reduce", 4 * numel, world)
    assert sum(bytes0.values()) < fp32 / 30
    # error feedback loses nothing: sum of outputs + the mean of the worker errors + the
    # server errors (each rank's chunk) == sum of the exact means
    worker = torch.stack([r[3].reshape(-1) for r in results]).mean(0)[:numel]
    server = torch.cat([r[4].reshape(-1) for r in results])[:numel]
    total = torch.stack(outs0).sum(0) + worker + server
    torch.testing.assert_close(total, torch.stack(means0).sum(0), rtol=0, atol=1e-4)
