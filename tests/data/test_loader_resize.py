"""The data order across a resize (Note [the data order across a resize]): a loader's
position is in global samples, so a run resumed at another data-parallel size or
micro-batch size reads the epoch's order on from the same sample, and each optimizer
step reads the same train_batch_size samples as at any other size."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler

from meshspeed.data import RepeatingLoader, distributed_dataloader


class Indices(Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


def _loaders(n: int, micro: int, dp: int, **kw) -> list:
    return [distributed_dataloader(Indices(n), micro, dp_rank=r, dp_size=dp, seed=7, **kw)
            for r in range(dp)]


def _global_stream(streams: list, micro_steps: int) -> list[int]:
    """What every rank reads together, micro-step by micro-step, rank 0 first: as a
    data-parallel step sees it (each micro-step's samples sorted, the order within one
    micro-step being only which rank holds which sample)."""
    out = []
    for _ in range(micro_steps):
        out += sorted(i for s in streams for i in next(s).tolist())
    return out


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("dp", [1, 3, 4])
def test_a_fresh_pass_is_distributed_samplers_order(shuffle, drop_last, dp):
    for rank in range(dp):
        ours = distributed_dataloader(Indices(22), 1, dp_rank=rank, dp_size=dp, seed=7,
                                      shuffle=shuffle, drop_last=drop_last).sampler
        theirs = DistributedSampler(Indices(22), num_replicas=dp, rank=rank, shuffle=shuffle,
                                    seed=7, drop_last=drop_last)
        for epoch in (0, 3):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs)


# (dp, micro) before -> after: shrink, grow, a new micro-batch size, a dp size that does
# not divide the position
@pytest.mark.parametrize(("before", "after"), [((4, 1), (2, 1)), ((2, 1), (4, 1)),
                                               ((2, 2), (4, 1)), ((4, 1), (3, 1))])
@pytest.mark.parametrize("micro_steps", [0, 2, 5])
def test_a_resized_run_continues_at_the_same_global_sample(before, after, micro_steps):
    n = 48
    (dp_a, mb_a), (dp_b, mb_b) = before, after
    loaders = _loaders(n, mb_a, dp_a)
    seen = _global_stream([iter(loader) for loader in loaders], micro_steps)
    state = loaders[0].state_dict()
    assert state["samples"] == micro_steps * mb_a * dp_a == len(seen)

    resumed = _loaders(n, mb_b, dp_b)
    for loader in resumed:
        loader.load_state_dict(state)
    passes = [list(loader) for loader in resumed]  # the rest of the epoch, rank by rank
    assert len({len(p) for p in passes}) == 1, "every rank reads as many micro-batches"
    size = mb_b * dp_b
    order = resumed[0].sampler._epoch_order()  # the epoch's one order (seed 7, epoch 0)
    for k in range(len(passes[0])):  # each micro-step reads the next mb_b * dp_b samples
        got = sorted(i for p in passes for i in p[k].tolist())
        at = len(seen) + k * size
        assert got == sorted(order[at : at + size]), k
    read = len(seen) + len(passes[0]) * size
    assert n - read < size, "the resumed pass stopped early"  # only a tail of < one micro-step


def test_an_optimizer_step_reads_the_same_samples_at_every_size():
    """train_batch_size 8: (dp 4, accumulation 2), (dp 2, accumulation 4), (dp 1, 8)."""
    steps = {}
    for dp in (1, 2, 4):
        streams = [iter(RepeatingLoader(loader)) for loader in _loaders(40, 1, dp)]
        per_step = 8 // dp
        steps[dp] = [sorted(_global_stream(streams, per_step)) for _ in range(7)]  # past an epoch
    assert steps[1] == steps[2] == steps[4]


def test_a_position_saved_before_positions_were_global_is_read_at_this_size():
    loaders = _loaders(40, 2, 2)
    it = iter(loaders[1])
    expected = list(itertools.islice(it, 10))[3:]
    old = _loaders(40, 2, 2)[1]
    old.load_state_dict({"epoch": 0, "batches": 3})
    assert [b.tolist() for b in old] == [b.tolist() for b in expected]


@pytest.mark.parametrize(("before", "after"), [(4, 2), (2, 4)])
def test_an_epoch_used_up_before_the_resize_goes_on_with_the_next(before, after):
    n = 16
    loaders = _loaders(n, 1, before)
    _global_stream([iter(loader) for loader in loaders], n // before)  # the whole epoch
    state = loaders[0].state_dict()
    assert state == {"epoch": 0, "batches": n // before, "samples": n}

    resumed = _loaders(n, 1, after)
    for loader in resumed:
        loader.load_state_dict(state)
    fresh = _loaders(n, 1, after)
    for loader in fresh:
        loader.sampler.set_epoch(1)
    got = _global_stream([iter(RepeatingLoader(loader)) for loader in resumed], n // after)
    assert got == _global_stream([iter(loader) for loader in fresh], n // after)  # epoch 1
