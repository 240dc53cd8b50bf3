"""Stage-3 parameter shards off the device: in host memory or in swap files.

A ZeRO-3 unit needs its shard at three moments only: to all-gather the full parameters
(`gather`), and to write updated values after the optimizer step or a user edit
(`publish_masters`, `refresh_from_params`). A shard store serves exactly those:

    fetch(unit) -> tensor on the compute device holding the unit's shard (for the gather)
    done(unit)            the all-gather that read it has completed
    write(unit, values)   the unit's shard becomes `values` (any float dtype, cast)

A stage-3 `FlatUnit` calls them through the store the offload placement gives it (`use_store`).

`HostShardStore`: the shard lives in (pinned) host memory; `fetch` copies it to the device
(on a CPU-only machine it is the shard itself).
`NvmeShardStore`: the shard lives in a file; `fetch` reads it into one of `buffer_count`
staging buffers and, from the second pass on, starts reading the unit that followed this
one last time, so the next unit's read overlaps this unit's gather and compute
(Note [prefetch follows the last observed order] in meshspeed/parallel/zero/prefetch.py
is the same idea one level up).
"""

from __future__ import annotations

import os

import torch

from meshspeed.config.errors import ConfigError
from meshspeed.offload.aio import IoRequest, SwapEngine
from meshspeed.offload.hostmem import ALIGN, host_empty, round_up
from meshspeed.offload.state import BufferPool


class HostShardStore:
    """Shards in host memory (moved there from the device at construction)."""

    tier = "host"

    def __init__(self, units=(), *, pin: bool):
        self.pin = pin
        for unit in units:
            self.add(unit)

    def add(self, unit) -> None:
        """Take one unit's shard (units are added as they are built)."""
        if unit.shard.device.type != "cpu":
            host = host_empty(unit.shard.numel(), unit.shard.dtype, pin=self.pin)
            host.copy_(unit.shard)
            unit.shard = host

    def fetch(self, unit) -> torch.Tensor:
        return unit.shard.to(unit.device, non_blocking=True)

    def done(self, unit) -> None:
        pass

    def write(self, unit, values: torch.Tensor) -> None:
        unit.shard.copy_(values)

    def write_range(self, unit, offset: int, values: torch.Tensor):
        unit.shard[offset : offset + values.numel()].copy_(values)

    def host_tensors(self, units) -> list[torch.Tensor]:
        return [u.shard for u in units]

    def nvme_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass


class NvmeShardStore:
    """Shards in files `unit<i>.shard` under `directory`, staged through a buffer pool.

    A staging buffer is held from `fetch` until the unit's all-gather has completed
    (`done`). When every pooled buffer is held by gathers in flight (more prefetched units
    than `buffer_count`), a temporary buffer is used rather than waiting on a gather that
    cannot finish first."""

    tier = "nvme"

    def __init__(self, units, directory: str, engine: SwapEngine, *, buffer_count: int,
                 buffer_numel: int, pin: bool):
        if buffer_count < 1:
            raise ConfigError([("zero_optimization.offload_param.buffer_count: needs at least 1 "
                               "(2 or more to overlap reading the next shard)")])
        self.units: list = []
        self.index: dict[int, int] = {}
        self.dir = directory
        self.engine = engine
        self.pin = pin
        self.buffer_count = buffer_count
        self.buffer_numel = buffer_numel
        self.numel: list[int] = []
        self.dtype: list[torch.dtype] = []
        self._pool: BufferPool | None = None  # sized by the largest shard at first use
        self._pooled: set[int] = set()
        self._pending: dict[int, tuple[IoRequest, torch.Tensor]] = {}  # reads in flight
        self._held: dict[int, torch.Tensor] = {}  # buffers a gather in flight reads from
        self._next_of: dict[int, int] = {}  # unit -> the unit fetched after it last time
        self._last: int | None = None
        for unit in units:
            self.add(unit)

    def add(self, unit) -> None:
        """Move one unit's shard to its file (units are added as they are built, so
        initialize holds one unit's shard at a time, not all of them: Note [units placed
        as they are built] in meshspeed/offload/placement.py)."""
        if self._pool is not None:
            raise RuntimeError("NvmeShardStore.add after the first fetch or write (the pool is sized)")
        n = unit.shard.numel()
        if n > self.buffer_numel:
            raise ConfigError([(f"zero_optimization.offload_param.buffer_size: {self.buffer_numel} elements "
                               f"is smaller than the largest stage-3 shard ({n}); raise it")])
        i = len(self.units)
        self.units.append(unit)
        self.index[id(unit)] = i
        self.numel.append(n)
        self.dtype.append(unit.shard.dtype)
        staging = host_empty(round_up(self._nbytes(i)) // 4, pin=False, align=ALIGN)  # one unit, freed
        self._typed(staging, i).copy_(unit.shard.detach().reshape(-1))
        self.engine.write(self._region(staging, i), self.path(i)).wait()
        unit.shard = unit.shard.new_empty(0)  # the file is the shard from now on

    @property
    def pool(self) -> BufferPool:
        if self._pool is None:
            nbytes = round_up(max((self._nbytes(i) for i in range(len(self.units))), default=0))
            self._pool = BufferPool(self.buffer_count, nbytes, self.pin)
            self._pooled = {id(b) for b in self._pool.free}
        return self._pool

    def path(self, i: int) -> str:
        return os.path.join(self.dir, f"unit{i}.shard")

    # -- the store protocol ---------------------------------------------------------------------
    def fetch(self, unit) -> torch.Tensor:
        """The unit's shard on its device; valid until `done(unit)`."""
        i = self.index[id(unit)]
        if i not in self._pending:
            self._start_read(i, block=True)
        request, buf = self._pending.pop(i)
        request.wait()
        self._held[i] = buf
        if self._last is not None:
            self._next_of[self._last] = i
        self._last = i
        nxt = self._next_of.get(i)
        if nxt is not None and nxt not in self._pending and nxt not in self._held:
            self._start_read(nxt, block=False)  # overlaps this unit's gather and compute
        return self._typed(buf, i).to(unit.device, non_blocking=True)

    def done(self, unit) -> None:
        """The unit's all-gather has completed: its staging buffer is free again."""
        buf = self._held.pop(self.index[id(unit)], None)
        if buf is not None:
            self._give_back(buf)

    def write(self, unit, values: torch.Tensor) -> None:
        i = self.index[id(unit)]
        self._drop_pending(i)  # a read started before this write would be stale
        self._write_now(i, values)

    def write_range(self, unit, offset: int, values: torch.Tensor):
        """Elements [offset, offset + n) of the unit's shard file; returns the write in
        flight and the (cast) buffer it reads from, which must live until it completes."""
        i = self.index[id(unit)]
        self._drop_pending(i)
        src = values.detach().to(self.dtype[i], copy=True).contiguous().view(-1)
        es = src.element_size()
        return self.engine.write(src, self.path(i), offset * es), src

    # -- internals ------------------------------------------------------------------------------
    def _take(self, block: bool) -> torch.Tensor | None:
        got = self.pool.take(1, block)
        if got is not None:
            return got[0]
        if not block:
            return None
        return host_empty(self.pool.nbytes // 4, pin=self.pin, align=ALIGN)  # temporary

    def _give_back(self, buf: torch.Tensor) -> None:
        if id(buf) in self._pooled:
            self.pool.give_back([buf])

    def _nbytes(self, i: int) -> int:
        return self.numel[i] * torch.empty((), dtype=self.dtype[i]).element_size()

    def _typed(self, buf: torch.Tensor, i: int) -> torch.Tensor:
        return buf.view(torch.uint8)[: self._nbytes(i)].view(self.dtype[i])

    def _region(self, buf: torch.Tensor, i: int) -> torch.Tensor:
        return buf.view(torch.uint8)[: round_up(self._nbytes(i))]

    def _start_read(self, i: int, block: bool) -> None:
        buf = self._take(block)
        if buf is not None:
            self._pending[i] = (self.engine.read(self._region(buf, i), self.path(i)), buf)

    def _write_now(self, i: int, values: torch.Tensor) -> None:
        buf = self._take(block=True)
        self._typed(buf, i).copy_(values.detach().reshape(-1))
        self.engine.write(self._region(buf, i), self.path(i)).wait()
        self._give_back(buf)

    def _drop_pending(self, i: int) -> None:
        pending = self._pending.pop(i, None)
        if pending is not None:
            pending[0].wait()
            self._give_back(pending[1])

    def host_tensors(self, units) -> list[torch.Tensor]:
        return self.pool.tensors() if self._pool is not None else []

    def nvme_bytes(self) -> int:
        return sum(os.path.getsize(self.path(i)) for i in range(len(self.units))
                   if os.path.exists(self.path(i)))

    def close(self) -> None:
        for i in list(self._pending):
            self._drop_pending(i)
        for buf in self._held.values():
            self._give_back(buf)
        self._held.clear()
        if self._pool is not None:
            self._pool.drain()
        self.engine.close()
