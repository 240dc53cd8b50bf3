"""fp32 master weights in swap files (`offload_optimizer.device: "nvme"`).

Note [masters on NVMe]
(ZeRO-Infinity, Rajbhandari et al., SC 2021: every model state on NVMe.) With NVMe
optimizer offload the fp32 masters are the largest state left in host memory (4 bytes
per owned parameter). `MasterFiles` keeps them in one file per ZeRO unit,
`unit<i>.master`, the unit's owned range in fp32 (`unit.shard_numel` elements), and
each master parameter the optimizer holds becomes a placeholder: an `nn.Parameter` of
the master's shape with no memory of its own (a stride-0 view of one element, so an
unexpected read sees zeros and an in-place write raises, never touching freed memory).
It keeps its identity (the optimizer's param groups, state and checkpoints are keyed by
it) and carries the host gradient as `.grad`.

Per optimizer sub-group (meshspeed/offload/state.py), the swap store then holds, before,
during and after its update:

    before   master + moments on disk; the grads in host memory (placement.py)
    prefetch read masters (per unit run, coalesced) and moments into k+1 pool buffers
    update   the rule steps on views of those buffers
    publish  the 16-bit values of the updated masters -> the units' shards (a range
             write into the stage-3 shard file, or the in-memory shard of a whole unit)
    release  write masters and moments back; buffers return to the pool when written

so the read of k+1 overlaps the update of k and the write of k-1 (`buffer_count` >=
2(k+1) to have both in flight). `Zero.publish_masters` then has nothing left to write
(the unit has no `master_buffer`): it all-gathers whole units and releases the rest.

Outside the step, a master is read or written through `read(master)` / `write(master,
values)` (checkpoints through `OwnedSlice.swap`, `safe_*_fp32_param` through
`ParamAccess`): one parameter's range at a time, and `write` publishes the 16-bit
values too, so a later `publish_masters` is consistent without reading every file.

Note [bounded writes in flight]
A write to a swap file holds the host tensor it reads from until it completes: the 16-bit
copy of each published range here, the fp32 copy of each landed gradient shard in
grad_files.py. Waiting only at the end of the step would hold one such copy per range of
the whole model (2 bytes a parameter for the publish, 4 for the gradients: 4 and 8 GiB at
2B parameters, measured as the optimizer phase's peak before this bound). Each keeps a
queue: finished writes are dropped as new ones start, and past `max_pending_bytes`
(256 MiB by default; the writer's queue depth bounds the requests) the oldest is waited
for. The disk stays busy with that much queued, and the copies held are bounded by it
plus the one being made, whatever the model's size.

With `delayed_update` the masters stay in host memory (the running step would write
shards that the next forward reads).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from meshspeed.offload.aio import IoRequest, SwapEngine

_F32 = 4


def placeholder(numel: int, shape) -> nn.Parameter:
    """A master with a shape and no memory (Note [masters on NVMe])."""
    return nn.Parameter(torch.zeros(1).expand(numel).view(shape) if numel else torch.zeros(shape))


class MasterFiles:
    """The masters of `units`, one fp32 file per unit under `directory`."""

    tier = "nvme"

    def __init__(self, directory: str, engine: SwapEngine, max_pending_bytes: int = 256 << 20):
        self.dir = directory
        self.engine = engine
        self.units: list = []
        self._where: dict[int, tuple[int, int, int]] = {}  # id(master) -> unit, param index, offset
        self._pending: list[tuple[IoRequest, torch.Tensor]] = []  # 16-bit writes in flight
        self.max_pending_bytes = max_pending_bytes
        # id(master) -> its values in a resident sub-group's buffer, which replaces the file's
        # range from then on (Note [the residency budget] in meshspeed/offload/residency.py)
        self._resident: dict[int, torch.Tensor] = {}

    def path(self, u: int) -> str:
        return os.path.join(self.dir, f"unit{u}.master")

    def add(self, unit, values: torch.Tensor) -> list[nn.Parameter]:
        """Write the unit's fp32 owned range; returns its masters as placeholders."""
        u = len(self.units)
        self.units.append(unit)
        self.engine.write(values.detach().float().contiguous().view(-1), self.path(u)).wait()
        masters = []
        for i, (s, m) in enumerate(zip(unit.spans, unit.masters)):
            fresh = placeholder(s.numel, m.shape)
            fresh.requires_grad_(m.requires_grad)
            self._where[id(fresh)] = (u, i, s.offset)
            masters.append(fresh)
        return masters

    def holds(self, master: torch.Tensor) -> bool:
        return id(master) in self._where

    def unit_index(self, master: torch.Tensor) -> int:
        """The index of the unit whose file holds `master`."""
        return self._where[id(master)][0]

    def published_copy(self, master: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """`values` cast to the dtype `publish` writes (the unit's): a copy that outlives the
        buffer `values` views, rounded as `publish` would round it."""
        return values.detach().to(self.units[self.unit_index(master)].dtype, copy=True)

    def keep_in_memory(self, masters: list[torch.Tensor], views: list[torch.Tensor]) -> None:
        """From now on `views` (read from the files already) are these masters' values."""
        for m, v in zip(masters, views):
            self._resident[id(m)] = v.view(-1)

    # -- runs of one sub-group ------------------------------------------------------------------
    def runs(self, masters: list[torch.Tensor], offsets: list[int]) -> list[tuple[int, int, int, int]]:
        """(unit, file element offset, buffer element offset, numel) for `masters`, which sit at
        `offsets` of a sub-group's buffer; neighbours contiguous in both are merged."""
        out: list[list[int]] = []
        for m, off in zip(masters, offsets):
            u, _, file_off = self._where[id(m)]
            n = m.numel()
            if n == 0:
                continue
            last = out[-1] if out else None
            if last and last[0] == u and last[1] + last[3] == file_off and last[2] + last[3] == off:
                last[3] += n
            else:
                out.append([u, file_off, off, n])
        return [tuple(r) for r in out]

    def read_runs(self, runs, buf: torch.Tensor) -> list[IoRequest]:
        return [self.engine.read(buf[b : b + n], self.path(u), f * _F32) for u, f, b, n in runs]

    def write_runs(self, runs, buf: torch.Tensor) -> list[IoRequest]:
        return [self.engine.write(buf[b : b + n], self.path(u), f * _F32) for u, f, b, n in runs]

    def publish(self, master: torch.Tensor, values: torch.Tensor) -> None:
        """The 16-bit (compute dtype) values of `master`'s range -> its unit's shard."""
        u, _, off = self._where[id(master)]
        pending = self.units[u].write_shard_range(off, values.reshape(-1))
        if pending is not None:
            self._pending.append(pending)
        self._bound_pending()

    def _bound_pending(self) -> None:
        """Note [bounded writes in flight]: finished writes free their 16-bit copies; past
        `max_pending_bytes` in flight, wait for the oldest."""
        while self._pending and (self._pending[0][0].done() or
                                 sum(b.nbytes for _, b in self._pending) > self.max_pending_bytes):
            request, _ = self._pending.pop(0)
            request.wait()

    def hand_over_pending(self) -> list[tuple[IoRequest, torch.Tensor]]:
        """The shard writes in flight, which the caller now waits for (Note [the step's I/O
        outside the step] in state.py); this queue starts empty again."""
        pending, self._pending = self._pending, []
        return pending

    def drain(self) -> None:
        """Wait for the shard writes `publish` started (before the next gather reads them)."""
        for request, _ in self._pending:
            request.wait()
        self._pending.clear()

    # -- one master at a time (checkpoints, safe_*_fp32_param) -----------------------------------
    def read(self, master: torch.Tensor) -> torch.Tensor:
        u, _, off = self._where[id(master)]
        if id(master) in self._resident:
            return self._resident[id(master)].clone().view(master.shape)
        out = torch.empty(master.numel(), dtype=torch.float32)
        if out.numel():
            self.engine.read(out, self.path(u), off * _F32).wait()
        return out.view(master.shape)

    def write(self, master: torch.Tensor, values: torch.Tensor) -> None:
        u, _, off = self._where[id(master)]
        flat = values.detach().to("cpu", torch.float32).contiguous().view(-1)
        if id(master) in self._resident:
            self._resident[id(master)].copy_(flat)
        elif flat.numel():
            self.engine.write(flat, self.path(u), off * _F32).wait()
        if flat.numel():
            self.publish(master, flat)
            self.drain()

    def write_unit(self, u: int, values: torch.Tensor) -> None:
        """The whole owned range of unit `u` changed from outside (a user's modifier)."""
        flat = values.detach().to("cpu", torch.float32).contiguous().view(-1)
        self.engine.write(flat, self.path(u)).wait()
        for key, (mu, _, off) in self._where.items():
            if mu == u and key in self._resident:
                kept = self._resident[key]
                kept.copy_(flat[off : off + kept.numel()])

    # -- accounting -------------------------------------------------------------------------------
    def host_tensors(self) -> list[torch.Tensor]:
        return [b for _, b in self._pending]

    def nvme_bytes(self) -> int:
        return sum(os.path.getsize(self.path(u)) for u in range(len(self.units))
                   if os.path.exists(self.path(u)))

    def close(self) -> None:
        self.drain()
        self.engine.close()


class SwappedMaster:
    """`OwnedSlice.swap` / `ParamAccess` for a master on disk: a copy read on demand."""

    def __init__(self, files: MasterFiles, master: torch.Tensor):
        self.files, self.master = files, master

    def read(self) -> torch.Tensor:
        return self.files.read(self.master).reshape(-1)

    def write(self, values: torch.Tensor) -> None:
        self.files.write(self.master, values)
