"""Executing a schedule on 2 and 4 gloo ranks (meshspeed/parallel/pipeline/runtime.py):
the losses and every parameter gradient equal a one-process run of the same model on the
same micro-batches, for GPipe and 1F1B; a shape change mid-batch is named."""

import pytest
import torch
from torch import nn

from meshspeed import comm
from meshspeed.parallel.pipeline.partition import partition
from meshspeed.parallel.pipeline.runtime import PipelineShapeError, run_stage
from meshspeed.parallel.pipeline.schedule import build
from meshspeed.testing import run_distributed

M = 4  # micro-batches


def _layers():
    torch.manual_seed(0)
    return [nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
            nn.Linear(16, 3)]


def _data():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(5, 6, generator=g) for _ in range(M)], [torch.randn(5, 3, generator=g) for _ in range(M)]


def _reference():
    model = nn.Sequential(*_layers())
    xs, ys = _data()
    losses = []
    for x, y in zip(xs, ys):
        loss = nn.functional.mse_loss(model(x), y)
        losses.append(float(loss.detach()))
        (loss / M).backward()
    return losses, [p.grad.clone() for p in model.parameters()]


def _stage_run(schedule_name):
    rank, world = comm.get_rank(), comm.get_world_size()
    layers = _layers()
    bounds = partition(layers, world, "parameters")
    mine = nn.Sequential(*layers[bounds[rank] : bounds[rank + 1]])
    xs, ys = _data()
    losses = run_stage(mine, build(schedule_name, M, world)[rank], stage=rank, stages=world, group=None,
                       inputs=xs if rank == 0 else None, targets=ys if rank == world - 1 else None,
                       loss_fn=nn.functional.mse_loss)
    first = sum(sum(1 for _ in layer.parameters()) for layer in layers[: bounds[rank]])
    return first, losses, [p.grad.clone() for p in mine.parameters()]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipelined_gradients_equal_one_process(world, schedule):
    ref_losses, ref_grads = _reference()
    results = run_distributed(_stage_run, world_size=world, args=(schedule,))
    assert results[-1][1] == pytest.approx(ref_losses, rel=1e-6)
    got = {}
    for first, _, grads in results:
        for k, g in enumerate(grads):
            got[first + k] = g
    assert sorted(got) == list(range(len(ref_grads)))
    for k, g in enumerate(ref_grads):
        torch.testing.assert_close(got[k], g, rtol=1e-5, atol=1e-7)


class _Shrinks(nn.Module):
    """Its output loses a row on the third micro-batch."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        y = self.fc(x)
        return y[:-1] if self.calls == 3 else y


def _shrinking(_):
    rank = comm.get_rank()
    xs, ys = _data()
    module = _Shrinks() if rank == 0 else nn.Linear(6, 3)
    try:
        run_stage(module, build("gpipe", M, 2)[rank], stage=rank, stages=2, group=None,
                  inputs=xs if rank == 0 else None, targets=ys if rank == 1 else None,
                  loss_fn=nn.functional.mse_loss)
    except PipelineShapeError as err:
        return str(err)
    return None


def test_a_shape_change_mid_batch_is_named_on_both_stages():
    sender, receiver = run_distributed(_shrinking, world_size=2, args=(0,), timeout=60)
    assert sender is not None and "micro-batch 2's output is (4, 6)" in sender and "was (5, 6)" in sender
    assert receiver is not None and "micro-batch 2's input from stage 0 is (4, 6)" in receiver
