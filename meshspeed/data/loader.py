"""Data loading for data-parallel training: each data-parallel rank reads its own shard."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def distributed_dataloader(
    dataset: Dataset,
    micro_batch_size: int,
    *,
    dp_rank: int,
    dp_size: int,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = True,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    num_workers: int = 0,
) -> DataLoader:
    """A DataLoader over this data-parallel rank's shard of `dataset`.

    Ranks are given explicitly (they are data-parallel coordinates, not global ranks: with
    tensor or pipeline parallelism several global ranks share one dp_rank and must read the
    same samples). With `drop_last=True` the shards are disjoint and every rank yields the
    same number of full micro-batches; with `drop_last=False` the sampler pads the last
    shard by repeating samples and the final micro-batch may be short.
    Call `loader.sampler.set_epoch(epoch)` (or use `RepeatingLoader`) to reshuffle.
    """
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
    sampler = DistributedSampler(
        dataset,
        num_replicas=dp_size,
        rank=dp_rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )
    return DataLoader(
        dataset,
        batch_size=micro_batch_size,
        sampler=sampler,
        drop_last=drop_last,
        collate_fn=collate_fn,
        num_workers=num_workers,
    )


class RepeatingLoader:
    """Iterate a loader forever, starting a new epoch (and reshuffle) at its end.

    Same role as `deepspeed.utils.RepeatingLoader`. Before each pass it calls
    `sampler.set_epoch(epoch)` when the sampler has one, so a `DistributedSampler`
    shuffles differently each epoch and identically on every rank.
    """

    def __init__(self, loader: Iterable):
        self.loader = loader
        self.epoch = 0
        self._iter = self._start_epoch()

    def _start_epoch(self) -> Iterator:
        sampler = getattr(self.loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.epoch)
        return iter(self.loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._iter)
        except StopIteration:
            pass
        self.epoch += 1
        self._iter = self._start_epoch()
        try:
            return next(self._iter)
        except StopIteration:
            raise RuntimeError(
                "RepeatingLoader: the wrapped loader yielded no batches in a whole epoch "
                "(dataset smaller than dp_size * micro_batch_size with drop_last=True?)"
            ) from None
