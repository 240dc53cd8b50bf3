"""The loader's position survives a restart (Note [resuming the data order]): a loader
restored from `state_dict()` hands out exactly the batches the first one would have next,
within an epoch, across epoch ends, under RepeatingLoader, and with worker processes."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import Dataset

from meshspeed.data import RepeatingLoader, distributed_dataloader


class Indices(Dataset):
    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


def _loader(**kw):
    return distributed_dataloader(Indices(), 2, dp_rank=1, dp_size=2, seed=3, **kw)  # 5 batches per epoch


def _take(it, n: int) -> list[list[int]]:
    return [b.tolist() for b in itertools.islice(it, n)]


@pytest.mark.parametrize("consumed", [0, 3, 5, 7, 10, 12])  # inside, at the end of, and past epochs
def test_a_restored_loader_continues_the_stream(consumed):
    stream = iter(RepeatingLoader(_loader()))
    seen = _take(stream, consumed)
    state = stream.loader.state_dict()
    expected = _take(stream, 8)

    resumed = _loader()
    resumed.load_state_dict(state)
    assert _take(iter(RepeatingLoader(resumed)), 8) == expected
    assert len(seen) == consumed and state["epoch"] == max(0, consumed - 1) // 5


def test_the_position_counts_batches_handed_out_not_fetched_ahead():
    loader = _loader(num_workers=1)  # the worker fetches ahead of what the loop has taken
    it = iter(loader)
    _take(it, 2)
    assert loader.state_dict() == {"epoch": 0, "batches": 2, "samples": 8}  # 2 ranks x 2 x 2
    expected = _take(it, 3)
    resumed = _loader()
    resumed.load_state_dict({"epoch": 0, "batches": 2})
    assert _take(iter(resumed), 5) == expected  # the rest of the epoch, then it ends


def test_setting_another_epoch_cancels_the_skip():
    resumed = _loader()
    resumed.load_state_dict({"epoch": 2, "batches": 3})
    resumed.sampler.set_epoch(4)  # the script moved on: a whole epoch 4
    fresh = _loader()
    fresh.sampler.set_epoch(4)
    assert _take(iter(resumed), 9) == _take(iter(fresh), 9)


def test_a_position_that_is_no_position_is_refused():
    with pytest.raises(ValueError, match="epoch, batches and samples are >= 0"):
        _loader().load_state_dict({"epoch": 0, "batches": -1})
