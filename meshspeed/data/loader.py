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
    The loader knows how far it has got (`state_dict()`), and checkpoints carry that so a
    resumed run reads the same batches (Note [resuming the data order]).
    """
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
    sampler = ResumableSampler(
        dataset,
        num_replicas=dp_size,
        rank=dp_rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )
    return ResumableLoader(
        dataset,
        batch_size=micro_batch_size,
        sampler=sampler,
        drop_last=drop_last,
        collate_fn=collate_fn,
        num_workers=num_workers,
    )


# Note [resuming the data order]
# A job restarted from a checkpoint must read the batches the interrupted run would have
# read next: the sampler's epoch (its shuffle) and how many batches of that epoch were
# handed out. The loader counts the batches its iterators hand to the caller, not what
# the sampler has produced (worker processes fetch ahead of use), and saves (epoch,
# batches). Loading sets the epoch and makes the next pass skip that many batches'
# indices, without loading them; `set_epoch` with another epoch cancels the skip (the
# script has moved elsewhere). A pass whose epoch was used up when saved yields nothing,
# so RepeatingLoader moves on to the next epoch, as the uninterrupted run did.
# RepeatingLoader starts counting epochs from the sampler's epoch, so a restored epoch
# survives a script that wraps the loader anew after resuming.


class ResumableSampler(DistributedSampler):
    """A DistributedSampler whose next pass can start part-way through its epoch."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.pending_skip = 0  # indices the next pass leaves out (a resumed position)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.pending_skip = 0  # the skip belongs to the epoch it was loaded with
        super().set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        skip, self.pending_skip = self.pending_skip, 0
        return iter(indices[skip:])


class _CountingIterator:
    """The DataLoader's iterator, counting what it hands out into its loader's position."""

    def __init__(self, inner: Iterator, loader: ResumableLoader):
        self._inner, self._loader = inner, loader

    def __iter__(self) -> _CountingIterator:
        return self

    def __next__(self) -> Any:
        batch = next(self._inner)
        self._loader.batches_read += 1
        return batch

    def __len__(self) -> int:
        return len(self._inner)


class ResumableLoader(DataLoader):
    """A DataLoader that knows its position: the sampler's epoch and the batches of that
    epoch handed out (Note [resuming the data order]); `state_dict` / `load_state_dict`."""

    batches_read = 0  # in the current (or, after load_state_dict, the coming) pass

    def __iter__(self) -> Iterator:
        skip = getattr(self.sampler, "pending_skip", 0)
        self.batches_read = skip // self.batch_size if self.batch_size else 0
        return _CountingIterator(super().__iter__(), self)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": int(getattr(self.sampler, "epoch", 0)), "batches": self.batches_read}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue at `state` (from `state_dict`): the next pass is that epoch, from that batch."""
        epoch, batches = int(state["epoch"]), int(state["batches"])
        if batches < 0 or epoch < 0:
            raise ValueError(f"loader position {state} is not a position: epoch and batches are >= 0")
        self.sampler.set_epoch(epoch)
        self.sampler.pending_skip = batches * (self.batch_size or 1)
        self.batches_read = batches


class RepeatingLoader:
    """Iterate a loader forever, starting a new epoch (and reshuffle) at its end.

    Same role as `deepspeed.utils.RepeatingLoader`. Before each pass it calls
    `sampler.set_epoch(epoch)` when the sampler has one, so a `DistributedSampler`
    shuffles differently each epoch and identically on every rank.
    """

    def __init__(self, loader: Iterable):
        self.loader = loader
        # from the sampler's epoch: a resumed loader's (Note [resuming the data order]), else 0
        epoch = getattr(getattr(loader, "sampler", None), "epoch", 0)
        self.epoch = epoch if isinstance(epoch, int) else 0
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
