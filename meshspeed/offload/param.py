"""Stage-3 parameter shards off the device: in host memory or in swap files.

A ZeRO-3 unit needs its shard at three moments only: to all-gather the full parameters
(`gather`), and to write updated values after the optimizer step or a user edit
(`publish_masters`, `refresh_from_params`). A shard store serves exactly those:

    fetch(unit, into) -> tensor on the compute device holding the unit's shard (for the
                         gather); `into` is the unit's own range of its gathered buffer,
                         which a store may fill and return (then the all-gather is in place)
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

Note [resident shards and shards kept from forward to backward]
Two host-memory budgets cut the store's reads (meshspeed/offload/residency.py sets them
at initialize, from `offload_param.max_in_cpu` or from MemAvailable):
- `make_resident(max_elements)`: the first units, in build order, whose shards fit in
  `max_elements` move back from their files into host memory for good. Such a shard is
  never read or written through the engine again (its file is removed).
- `keep(nbytes)`: a shard read from its file is copied into a least-recently-fetched cache
  of at most `nbytes`. The units fetched last in forward are the first fetched in backward,
  so those are served from the cache instead of read a second time; a write updates the
  cached copy as well as the file (write-through), so a copy is never stale, and the units
  backward fetched last (the first units) are still cached when the next forward starts.
  A cached unit costs no read in backward and, when it survives the step, none in the
  next forward either. Eviction frees the copy only (the file is always current).
Both only change where bytes live: the values fetched are the same bits.
"""

from __future__ import annotations

import os
from collections import OrderedDict

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

    def fetch(self, unit, into: torch.Tensor | None = None) -> torch.Tensor:
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
    cannot finish first.

    Note [shards larger than a staging buffer]
    A shard of more than `buffer_numel` elements (the root unit, embedding + head, is the
    usual one) is never staged whole: `fetch` reads it in buffer-sized pieces through the
    pool straight into `into`, the unit's own range of its gathered buffer (which the
    all-gather needs anyway), and the all-gather runs in place; `write` writes it in
    pieces the same way. Such a unit is read when it is gathered, not prefetched by the
    store, and the pool is sized by `buffer_numel`, not by the largest shard."""

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
        self._resident: dict[int, torch.Tensor] = {}  # Note [resident shards and ...]
        self._kept: OrderedDict[int, torch.Tensor] = OrderedDict()  # least recent first
        self.keep_bytes = 0
        for unit in units:
            self.add(unit)

    def add(self, unit) -> None:
        """Move one unit's shard to its file (units are added as they are built, so
        initialize holds one unit's shard at a time, not all of them: Note [units placed
        as they are built] in meshspeed/offload/placement.py)."""
        if self._pool is not None:
            raise RuntimeError("NvmeShardStore.add after the first fetch or write (the pool is sized)")
        n = unit.shard.numel()
        i = len(self.units)
        self.units.append(unit)
        self.index[id(unit)] = i
        self.numel.append(n)
        self.dtype.append(unit.shard.dtype)
        if self._big(i):
            self._write_pieces(i, unit.shard, self._piece_buffer())
        else:
            staging = host_empty(round_up(self._nbytes(i)) // 4, pin=False, align=ALIGN)  # one unit, freed
            self._typed(staging, i).copy_(unit.shard.detach().reshape(-1))
            self.engine.write(self._region(staging, i), self.path(i)).wait()
        unit.shard = unit.shard.new_empty(0)  # the file is the shard from now on

    @property
    def pool(self) -> BufferPool:
        if self._pool is None:
            on_disk = [i for i in range(len(self.units)) if i not in self._resident]
            nbytes = round_up(max((self._nbytes(i) for i in on_disk if not self._big(i)), default=0))
            if any(self._big(i) for i in on_disk):
                nbytes = max(nbytes, self._piece_nbytes())
            self._pool = BufferPool(self.buffer_count, nbytes, self.pin)
            self._pooled = {id(b) for b in self._pool.free}
        return self._pool

    def path(self, i: int) -> str:
        return os.path.join(self.dir, f"unit{i}.shard")

    # -- Note [resident shards and shards kept from forward to backward] -------------------------
    def make_resident(self, max_elements: int) -> list[int]:
        """Move the first units' shards that fit in `max_elements` into host memory (each
        read once, here, and its file removed); returns their indices."""
        used = sum(self.numel[i] for i in self._resident)
        for i in range(len(self.units)):
            if i in self._resident or used + self.numel[i] > max_elements:
                continue
            shard = host_empty(self.numel[i], self.dtype[i], pin=self.pin)
            self.engine.read(shard.view(torch.uint8), self.path(i)).wait()  # ~ the file's bytes
            self._drop_pending(i)
            self._kept.pop(i, None)
            self._resident[i] = shard
            used += self.numel[i]
            os.remove(self.path(i))
        return sorted(self._resident)

    def keep(self, nbytes: int) -> None:
        """Keep up to `nbytes` of shards read from files until they are fetched again."""
        self.keep_bytes = max(0, int(nbytes))
        self._evict(0)

    def resident_elements(self) -> int:
        return sum(self.numel[i] for i in self._resident)

    def resident_nbytes(self) -> int:
        return sum(t.nbytes for t in self._resident.values())

    def _cached(self, i: int) -> torch.Tensor | None:
        """The unit's shard where it is in memory (resident or kept), else None."""
        if i in self._resident:
            return self._resident[i]
        got = self._kept.get(i)
        if got is not None:
            self._kept.move_to_end(i)
        return got

    def _remember(self, i: int, values: torch.Tensor) -> None:
        """Copy a shard just read into the keep cache (evicting the least recent)."""
        if self._nbytes(i) > self.keep_bytes:
            return
        self._evict(self._nbytes(i))
        self._kept[i] = values.detach().to("cpu", copy=True).reshape(-1)

    def _evict(self, room: int) -> None:
        while self._kept and sum(t.nbytes for t in self._kept.values()) + room > self.keep_bytes:
            self._kept.popitem(last=False)

    def _in_memory_write(self, i: int, offset: int, values: torch.Tensor) -> bool:
        """Write elements into the in-memory copy; True when that copy is the shard itself."""
        target = self._resident.get(i, self._kept.get(i))
        if target is not None:
            target[offset : offset + values.numel()].copy_(values.reshape(-1))
        return i in self._resident

    # -- the store protocol ---------------------------------------------------------------------
    def fetch(self, unit, into: torch.Tensor | None = None) -> torch.Tensor:
        """The unit's shard on its device; valid until `done(unit)`. A shard larger than a
        buffer is read into `into` (Note [shards larger than a staging buffer])."""
        i = self.index[id(unit)]
        cached = self._cached(i)
        if cached is not None:
            self._follow(i)
            if into is not None and self._big(i):
                return into.copy_(cached)
            return cached.to(unit.device, non_blocking=True)
        if self._big(i):
            if into is None or into.numel() != self.numel[i]:
                raise ValueError(f"shard {i} of {self.numel[i]} elements is read in pieces: "
                                 "fetch needs `into`, the unit's range of its gathered buffer")
            self._read_pieces(i, into)
            self._remember(i, into)
            self._follow(i)
            return into
        if i not in self._pending:
            self._start_read(i, block=True)
        request, buf = self._pending.pop(i)
        request.wait()
        self._held[i] = buf
        self._remember(i, self._typed(buf, i))
        self._follow(i)
        return self._typed(buf, i).to(unit.device, non_blocking=True)

    def _follow(self, i: int) -> None:
        """Record the order of fetches; start reading the unit that followed `i` last time."""
        if self._last is not None:
            self._next_of[self._last] = i
        self._last = i
        nxt = self._next_of.get(i)
        if (nxt is not None and not self._big(nxt) and nxt not in self._pending
                and nxt not in self._held and nxt not in self._resident and nxt not in self._kept):
            self._start_read(nxt, block=False)  # overlaps this unit's gather and compute

    def done(self, unit) -> None:
        """The unit's all-gather has completed: its staging buffer is free again."""
        buf = self._held.pop(self.index[id(unit)], None)
        if buf is not None:
            self._give_back(buf)

    def write(self, unit, values: torch.Tensor) -> None:
        i = self.index[id(unit)]
        self._drop_pending(i)  # a read started before this write would be stale
        if self._in_memory_write(i, 0, values.detach().to(self.dtype[i])):
            return
        if self._big(i):
            buf = self._take(block=True)
            self._write_pieces(i, values, buf)
            self._give_back(buf)
            return
        self._write_now(i, values)

    def write_range(self, unit, offset: int, values: torch.Tensor):
        """Elements [offset, offset + n) of the unit's shard file; returns the write in
        flight and the (cast) buffer it reads from, which must live until it completes."""
        i = self.index[id(unit)]
        self._drop_pending(i)
        src = values.detach().to(self.dtype[i], copy=True).contiguous().view(-1)
        if self._in_memory_write(i, offset, src):
            return None
        es = src.element_size()
        return self.engine.write(src, self.path(i), offset * es), src

    # -- shards larger than a buffer (Note [shards larger than a staging buffer]) ---------------
    def _big(self, i: int) -> bool:
        return self.numel[i] > self.buffer_numel

    def _piece_nbytes(self) -> int:
        return round_up(self.buffer_numel * max(torch.empty((), dtype=d).element_size() for d in self.dtype))

    def _piece_buffer(self) -> torch.Tensor:
        return host_empty(self._piece_nbytes() // 4, pin=False, align=ALIGN)  # (before the pool)

    def _pieces(self, i: int, nbytes: int):
        """(first element, elements, bytes of the O_DIRECT-sized region) of each piece."""
        es = torch.empty((), dtype=self.dtype[i]).element_size()
        step = (nbytes // ALIGN * ALIGN) // es  # aligned file offsets for every piece
        for a in range(0, self.numel[i], step):
            n = min(step, self.numel[i] - a)
            yield a, n, round_up(n * es)

    def _read_pieces(self, i: int, into: torch.Tensor) -> None:
        buf = self._take(block=True)
        es = into.element_size()
        flat = into.view(-1)
        for a, n, region in self._pieces(i, buf.numel() * 4):
            self.engine.read(buf.view(torch.uint8)[:region], self.path(i), a * es).wait()
            flat[a : a + n].copy_(buf.view(torch.uint8)[: n * es].view(self.dtype[i]))
        self._give_back(buf)

    def _write_pieces(self, i: int, values: torch.Tensor, buf: torch.Tensor) -> None:
        src = values.detach().reshape(-1)
        es = torch.empty((), dtype=self.dtype[i]).element_size()
        for a, n, region in self._pieces(i, buf.numel() * 4):
            buf.view(torch.uint8)[: n * es].view(self.dtype[i]).copy_(src[a : a + n])
            self.engine.write(buf.view(torch.uint8)[:region], self.path(i), a * es).wait()

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
        pool = self.pool.tensors() if self._pool is not None else []
        return pool + list(self._resident.values()) + list(self._kept.values())

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
