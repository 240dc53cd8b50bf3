"""Data loading for data-parallel training: each data-parallel rank reads its own shard."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
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
# read next: the sampler's epoch (its shuffle) and how far into that epoch the run got.
# The loader counts the batches its iterators hand to the caller, not what the sampler
# has produced (worker processes fetch ahead of use), and saves (epoch, batches, samples).
# Loading sets the epoch and makes the next pass start that far in, without loading the
# samples before; `set_epoch` with another epoch cancels the start (the script has moved
# elsewhere). A pass whose epoch was used up when saved yields nothing, so RepeatingLoader
# moves on to the next epoch, as the uninterrupted run did. RepeatingLoader starts
# counting epochs from the sampler's epoch, so a restored epoch survives a script that
# wraps the loader anew after resuming.
#
# Note [the data order across a resize]
# The position is kept in GLOBAL samples (every data-parallel rank's together), because
# an epoch's order is one list that does not depend on the data-parallel size: the
# permutation of `seed + epoch` (or 0..N-1 unshuffled), which rank r reads from r on in
# strides of dp_size, micro-batch after micro-batch. So the k-th micro-step of an epoch
# reads positions [k * micro * dp, (k + 1) * micro * dp) of that list at any size, and
# an optimizer step (micro * accumulation * dp = train_batch_size of them) reads the same
# train_batch_size samples whatever the split into ranks and accumulation steps. A
# checkpoint saved at position P and loaded at another dp size (or micro-batch size)
# continues at P: rank r reads P + r, P + r + dp, ... Nothing is skipped and nothing
# read twice, apart from what every resume does: the samples read since the checkpoint
# are read again. Two differences from an uninterrupted run at the new size are left:
# each size drops (or, drop_last=False, pads with) the last N mod dp samples of the order
# for equal shards, and the last N mod (micro * dp) samples with drop_last; so with N a
# multiple of train_batch_size the order is the same at every size.


class ResumableSampler(DistributedSampler):
    """A DistributedSampler whose next pass can start part-way through its epoch, at a
    position counted in global samples (Note [the data order across a resize])."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.pending_start = 0  # global samples of the epoch the next pass leaves out

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.pending_start = 0  # the start belongs to the epoch it was loaded with
        super().set_epoch(epoch)

    def _epoch_order(self) -> list[int]:
        """The epoch's order of every rank's samples, padded or cut to equal shards:
        DistributedSampler's list before it takes this rank's stride."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.dataset), generator=g).tolist()
        else:
            order = list(range(len(self.dataset)))
        return _equal_shards(order, self.total_size, self.num_replicas, self.drop_last)

    def __iter__(self) -> Iterator[int]:
        start, self.pending_start = self.pending_start, 0
        order = self._epoch_order()
        if start:
            rest = order[start:]
            order = _equal_shards(rest, len(rest) + (-len(rest)) % self.num_replicas,
                                  self.num_replicas, self.drop_last, pad_from=order)
        return iter(order[self.rank :: self.num_replicas])


def _equal_shards(order: list[int], total: int, replicas: int, drop_last: bool,
                  pad_from: list[int] | None = None) -> list[int]:
    """`order` cut (drop_last) or padded by repeating `pad_from` (default `order`) to a
    multiple of `replicas` samples; `total` is the padded length."""
    if drop_last:
        return order[: len(order) // replicas * replicas]
    pad, source = total - len(order), pad_from if pad_from is not None else order
    if pad <= 0 or not source:
        return order
    return order + (source * (pad // len(source) + 1))[:pad]


class _CountingIterator:
    """The DataLoader's iterator, counting what it hands out into its loader's position."""

    def __init__(self, inner: Iterator, loader: ResumableLoader):
        self._inner, self._loader = inner, loader

    def __iter__(self) -> _CountingIterator:
        return self

    def __next__(self) -> Any:
        batch = next(self._inner)
        self._loader.samples_read += self._loader.global_batch
        return batch

    def __len__(self) -> int:
        return len(self._inner)


class ResumableLoader(DataLoader):
    """A DataLoader that knows its position: the sampler's epoch and the samples of that
    epoch handed out, every rank's together (Note [resuming the data order],
    Note [the data order across a resize]); `state_dict` / `load_state_dict`."""

    samples_read = 0  # global samples of the current (or, after load_state_dict, the coming) pass

    @property
    def global_batch(self) -> int:
        """Samples one micro-batch of every data-parallel rank reads together."""
        return (self.batch_size or 1) * int(getattr(self.sampler, "num_replicas", 1))

    @property
    def batches_read(self) -> int:
        """This rank's batches of the pass handed out (or, resumed, skipped)."""
        return self.samples_read // self.global_batch

    def __iter__(self) -> Iterator:
        self.samples_read = getattr(self.sampler, "pending_start", 0)
        return _CountingIterator(super().__iter__(), self)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": int(getattr(self.sampler, "epoch", 0)), "batches": self.batches_read,
                "samples": self.samples_read}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue at `state` (from `state_dict`): the next pass is that epoch, from that
        sample, at this loader's data-parallel size and batch size. A position without
        "samples" (saved before positions were global) is read as batches of this size."""
        epoch, batches = int(state["epoch"]), int(state["batches"])
        samples = int(state.get("samples", batches * self.global_batch))
        if batches < 0 or epoch < 0 or samples < 0:
            raise ValueError(f"loader position {state} is not a position: epoch, batches and "
                             "samples are >= 0")
        self.sampler.set_epoch(epoch)
        self.sampler.pending_start = samples
        self.samples_read = samples


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
