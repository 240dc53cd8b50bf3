"""The planner's predictions against measured CPU runs of the reference GPT on 2 gloo
ranks (fp32, AdamW): model-state bytes within 5%, the peak within 15%, and the order of
five layouts' step times.

Configurations are the planner's own: each run's engine is built from
`Choice.to_config()`, so the written config is exercised too. Measurement helpers and
Note [measured peak] are in tests/planner/measure.py.
"""

from __future__ import annotations

import pytest

from meshspeed.planner import plan
from meshspeed.planner.cost import Candidate
from meshspeed.testing import run_distributed
from tests.planner.measure import states_and_peak, step_times

MODEL = {"vocab_size": 256, "max_seq_len": 64, "n_layer": 2, "n_head": 4, "d_model": 64}
SEQ = 64


def _plan(batch, **kw):
    # headroom 0: the measured peak is allocator-level, with no fragmentation to allow for
    return plan(MODEL, 2, "1GB", global_batch=batch, seq_len=SEQ, gpus_per_node=2,
                precision="fp32", headroom=0.0, **kw)


@pytest.fixture(scope="module")
def memory_runs():
    layouts = [Candidate(dp=2, stage=s, micro_batch=2, grad_accum=2) for s in (0, 1, 2, 3)]
    layouts += [Candidate(dp=2, stage=0, checkpointing=True, micro_batch=4, grad_accum=1),
                Candidate(dp=2, stage=3, checkpointing=True, micro_batch=1, grad_accum=4)]
    p = _plan(8)
    out = []
    for c in layouts:
        choice = p.price(c)
        measured = run_distributed(states_and_peak, 2, args=(MODEL, choice.to_config(), SEQ,
                                                              c.checkpointing), timeout=200)
        out.append((choice, measured))
    return out


def test_model_states_within_5_percent(memory_runs):
    for choice, measured in memory_runs:
        want = sum(choice.memory[k] for k in ("params", "grads", "optimizer"))
        for rank in measured:
            mem = rank["mem"]
            got = mem["params"] + mem["master_params"] + mem["grads"] + mem["optimizer_state"]
            assert abs(want - got) <= 0.05 * got, (choice.candidate.label(), want, got)


def test_peak_within_15_percent(memory_runs):
    """Predicted: model states + activations + buffers (cost.py, Note [buffers at the
    peak]); measured: Note [measured peak]. The gap is mostly the temporaries the formula
    does not count (on a device the headroom fraction covers them)."""
    for choice, measured in memory_runs:
        want = choice.memory["total"]
        got = max(rank["peak"] for rank in measured)
        assert abs(want - got) <= 0.15 * got, (choice.candidate.label(), want, got)


# Calibration runs (Note [calibration] below) and the five layouts whose order is checked.
CALIBRATION = [Candidate(dp=2, micro_batch=8, grad_accum=1), Candidate(dp=2, micro_batch=1, grad_accum=8)]
ORDERED = [
    Candidate(dp=2, micro_batch=8, grad_accum=1),
    Candidate(dp=2, stage=2, micro_batch=2, grad_accum=4),
    Candidate(dp=2, stage=3, micro_batch=1, grad_accum=8),
    Candidate(dp=1, tp=2, micro_batch=1, grad_accum=16, sequence_parallel=False),
    Candidate(dp=1, cp=2, stage=3, checkpointing=True, micro_batch=1, grad_accum=16),
]
TIME_MODEL = {"vocab_size": 256, "max_seq_len": 64, "n_layer": 2, "n_head": 4, "d_model": 128}


@pytest.mark.timeout(180)  # the slowest test here: about 15-40 s on a shared 2-core machine
def test_predicted_order_of_five_layouts_is_measured_order():
    """Note [calibration]: this machine is described to the planner by figures measured
    here, not by defaults. Links: a gloo all-reduce's bandwidth (4 MiB message) and its
    latency alpha between pieces of compute (measure.calibrate). Compute: the engine's
    FLOP/s and its overhead per layer per micro-batch, solved from two runs that differ
    only in the micro-batch split (8 x 1 and 1 x 8 at ZeRO 0, both exposing the same
    all-reduce). The first of them is also the first of the five ordered layouts; the
    others are priced with no further fitting. The five were chosen so that neighbours
    differ in measurement by 1.4x or more, and timed interleaved, best of 6 rounds."""
    probe = plan(TIME_MODEL, 2, "1GB", global_batch=16, seq_len=SEQ, gpus_per_node=2,
                 precision="fp32")
    layouts = CALIBRATION + ORDERED
    runs = [(probe.price(c).to_config(), SEQ, c.checkpointing) for c in layouts]
    ranks = run_distributed(step_times, 2, args=(TIME_MODEL, runs, 6), timeout=170)
    measured = [max(t) for t in zip(*(r["times"] for r in ranks))]
    cal = ranks[0]["calibration"]
    kw = {"global_batch": 16, "seq_len": SEQ, "gpus_per_node": 2, "precision": "fp32",
          "mfu": 1.0, "overlap": 0.0,  # gloo on busy cores: nothing overlaps
          "link": {"intra": cal["bandwidth"], "inter": cal["bandwidth"]},
          "latency": {"intra": cal["alpha"], "inter": cal["alpha"]}}
    unit = plan(TIME_MODEL, 2, "1GB", peak_flops=1.0, **kw)  # compute = FLOPs, in "seconds"
    one = unit.price(CALIBRATION[0]).time  # the 1 x 8 run differs only in compute overhead
    comm = one["total"] - one["compute"]
    layers = TIME_MODEL["n_layer"]
    overhead = max(0.0, (measured[1] - measured[0]) / (layers * 7))
    flops = one["compute"] / max(measured[0] - comm - layers * overhead, 1e-6)
    fitted = plan(TIME_MODEL, 2, "1GB", peak_flops=flops, layer_overhead=overhead, **kw)
    predicted = [fitted.price(c).step_time for c in ORDERED]
    got = measured[len(CALIBRATION):]
    report = "\n".join(f"{c.label():45s} predicted {p * 1e3:7.1f} ms  measured {m * 1e3:7.1f} ms"
                       for c, p, m in zip(ORDERED, predicted, got))
    print(report)
    assert sorted(range(5), key=predicted.__getitem__) == sorted(range(5), key=got.__getitem__), report
    assert predicted == sorted(predicted), report  # ORDERED is listed fastest first
