"""Timelines (meshspeed/parallel/pipeline/timeline.py): the bubble of hand-made spans, the
JSON round trip, simulate's spans giving simulate's own bubble, and a run whose stages
sleep through their forwards and backwards measuring about the bubble simulate plans for
it (loosely: the run is not timed, only compared)."""

import itertools
import time

import pytest
import torch
from torch import nn

from meshspeed import comm
from meshspeed.parallel.pipeline.runtime import run_stage
from meshspeed.parallel.pipeline.schedule import build, simulate
from meshspeed.parallel.pipeline.timeline import (
    Span,
    bubble_fraction,
    from_json,
    from_simulation,
    to_json,
)
from meshspeed.testing import run_distributed

SPANS = [  # stage 0 busy 1 + 2, stage 1 busy 1 + 2, over 10 .. 15: 6 of 10 stage-seconds
    [Span("F", 0, 0, 10.0, 11.0), Span("B", 0, 0, 13.0, 15.0)],
    [Span("F", 0, 0, 11.0, 12.0), Span("B", 0, 0, 12.0, 14.0)],
]


def test_bubble_fraction_of_hand_made_spans():
    assert bubble_fraction(SPANS) == 0.4
    assert bubble_fraction([[Span("F", 0, 0, 0.0, 2.0), Span("F", 1, 0, 2.0, 4.0)]]) == 0.0
    assert bubble_fraction([[Span("F", 0, 0, 0.0, 1.0)], [Span("F", 0, 0, 1.0, 2.0)]]) == 0.5


def test_json_times_are_relative_to_the_earliest_start_and_round_trip():
    data = to_json(SPANS)
    assert data[0][0] == {"kind": "F", "micro": 0, "chunk": 0, "start": 0.0, "end": 1.0}
    assert data[1][1] == {"kind": "B", "micro": 0, "chunk": 0, "start": 2.0, "end": 4.0}
    back = from_json(data)
    assert back[1][1] == Span("B", 0, 0, 2.0, 4.0)
    assert bubble_fraction(back) == bubble_fraction(SPANS)


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)])
def test_simulated_spans_give_simulate_s_bubble(name, v):
    sim = simulate(build(name, 8, 4, v), t_weight=1.0 if name == "zb-h1" else None, virtual_stages=v)
    spans = from_simulation(sim.spans)
    assert bubble_fraction(spans) == pytest.approx(sim.bubble_fraction, abs=1e-12)
    assert {(s.kind, s.micro, s.chunk) for s in spans[0]} == {(a.kind, a.micro, a.chunk)
                                                              for a in build(name, 8, 4, v)[0]}


def test_bad_timelines_are_named():
    with pytest.raises(ValueError, match="at least one span"):
        bubble_fraction([[], []])
    with pytest.raises(ValueError, match="objects with kind, micro, chunk, start and end"):
        from_json([[{"kind": "F", "micro": 0}]])


# -- a measured run --------------------------------------------------------------------------------
T = 0.02  # seconds a forward sleeps; a backward sleeps 2 T (simulate's t_F = 1, t_B = 2)


class _SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(2 * T)
        return g


class _Sleepy(nn.Module):
    def __init__(self, width_in, width_out):
        super().__init__()
        self.fc = nn.Linear(width_in, width_out)

    def forward(self, x):
        time.sleep(T)
        return _SleepInBackward.apply(self.fc(x))


def _sleepy_run(schedule, m):
    rank, p = comm.get_rank(), comm.get_world_size()
    torch.manual_seed(0)
    module = _Sleepy(4, 4 if rank < p - 1 else 2)
    xs = [torch.randn(3, 4) for _ in range(m)]
    ys = [torch.randn(3, 2) for _ in range(m)]
    spans = []
    run_stage(module, build(schedule, m, p)[rank], stage=rank, stages=p, group=None,
              inputs=xs if rank == 0 else None, targets=ys if rank == p - 1 else None,
              loss_fn=nn.functional.mse_loss, timeline=spans)
    return spans


def test_a_sleeping_pipeline_records_a_usable_timeline():
    """Structure only (timed figures belong to benchmarks/pipeline.py): every action once per
    stage, in schedule order, spans that do not overlap, and a bubble strictly between 0
    and 1 (a two-stage 1F1B pipeline always idles some)."""
    m, p = 4, 2
    spans = run_distributed(_sleepy_run, world_size=p, args=("1f1b", m))
    assert [len(row) for row in spans] == [2 * m, 2 * m]
    for stage, row in enumerate(spans):
        assert [(s.kind, s.micro) for s in row] == [(a.kind, a.micro) for a in build("1f1b", m, p)[stage]]
        assert all(a.end <= b.start for a, b in itertools.pairwise(row))
    assert 0 < bubble_fraction(spans) < 1
