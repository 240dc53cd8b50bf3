import pytest
import torch
from torch.utils.data import Dataset

from meshspeed.data import RepeatingLoader, distributed_dataloader


class Indices(Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


def rank_samples(n, mbs, dp_size, **kw):
    loaders = [
        distributed_dataloader(Indices(n), mbs, dp_rank=r, dp_size=dp_size, **kw)
        for r in range(dp_size)
    ]
    return [torch.cat(list(loader)).tolist() for loader in loaders]


@pytest.mark.parametrize("dp_size", [2, 3])
def test_shards_are_disjoint_and_cover(dp_size):
    shards = rank_samples(24, 2, dp_size)
    flat = [i for shard in shards for i in shard]
    assert sorted(flat) == list(range(24))
    assert len({len(s) for s in shards}) == 1


@pytest.mark.parametrize("dp_size", [2, 3])
def test_uneven_dataset_stays_disjoint_with_equal_steps(dp_size):
    shards = rank_samples(25, 2, dp_size)
    flat = [i for shard in shards for i in shard]
    assert len(flat) == len(set(flat))
    assert len({len(s) for s in shards}) == 1


def test_same_seed_same_order_and_seed_matters():
    a = rank_samples(32, 4, 2, seed=3)
    assert a == rank_samples(32, 4, 2, seed=3)
    assert a != rank_samples(32, 4, 2, seed=4)
    assert rank_samples(8, 2, 2, shuffle=False) == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_bad_rank():
    with pytest.raises(ValueError):
        distributed_dataloader(Indices(4), 1, dp_rank=2, dp_size=2)


def test_repeating_loader_reshuffles_each_epoch():
    loader = distributed_dataloader(Indices(16), 4, dp_rank=0, dp_size=2, seed=0)
    it = RepeatingLoader(loader)
    assert iter(it) is it
    epoch0 = torch.cat([next(it) for _ in range(2)]).tolist()
    epoch1 = torch.cat([next(it) for _ in range(2)]).tolist()
    assert it.epoch == 1
    assert epoch0 != epoch1  # reshuffled (globally, then re-sharded)
    loader.sampler.set_epoch(1)
    assert torch.cat(list(loader)).tolist() == epoch1


def test_repeating_loader_empty_epoch_raises():
    it = RepeatingLoader(distributed_dataloader(Indices(3), 4, dp_rank=0, dp_size=1))
    with pytest.raises(RuntimeError, match="no batches"):
        next(it)
