"""Where offloaded optimizer state lives between steps: host memory or swap files.

Both stores serve the optimizer one *sub-group* at a time (at most `sub_group_size`
elements, whole parameters): `prefetch(sg)` starts making its state available,
`acquire(handle)` returns it as per-key lists of tensors shaped like the parameters,
`release(handle)` hands it back (for swap files: starts writing it out). The optimizer
pipelines these so that the swap-in of sub-group k+1 overlaps the update of k, and
brackets a step with `begin_step()` / `finish_step(sub_groups)` (Note [the step's I/O
outside the step]).

Each sub-group's state is one flat buffer per state key (`exp_avg`, `exp_avg_sq`), and a
parameter's state is a view at its offset: one contiguous file and one I/O request per
key and sub-group, and no per-parameter allocations. Scalar state (Adam's step count)
stays in host memory in both stores.
"""

from __future__ import annotations

import functools
import os
import threading
from collections import deque
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass

import torch
from torch import nn

from meshspeed.config.errors import ConfigError
from meshspeed.offload.aio import IoRequest, SwapEngine, write_generation
from meshspeed.offload.hostmem import ALIGN, host_empty, round_up
from meshspeed.parallel.slices import Deferred
from meshspeed.process.progress import progress

_F32 = 4  # bytes per state element: optimizer state is fp32
_MASTER = "\0master"  # a resident sub-group's master buffer (never a state key)


@dataclass
class SubGroup:
    index: int
    params: list[nn.Parameter]
    offsets: list[int]  # element offset of each parameter's state in the flat buffers
    numel: int

    @property
    def nbytes(self) -> int:  # bytes of one state key's file / buffer, O_DIRECT-aligned
        return round_up(self.numel * _F32)


def split_sub_groups(params: list[nn.Parameter], sub_group_size: int) -> list[SubGroup]:
    """Consecutive parameters, at most `sub_group_size` elements per group unless a single
    parameter is larger (parameters are never split: they are already 1/N slices)."""
    groups: list[SubGroup] = []
    current: list[nn.Parameter] = []
    numel = 0
    for p in params:
        if current and numel + p.numel() > max(1, sub_group_size):
            groups.append(_make(len(groups), current))
            current, numel = [], 0
        current.append(p)
        numel += p.numel()
    if current:
        groups.append(_make(len(groups), current))
    return groups


def _make(index: int, params: list[nn.Parameter]) -> SubGroup:
    offsets, off = [], 0
    for p in params:
        offsets.append(off)
        off += p.numel()
    return SubGroup(index, list(params), offsets, off)


def _views(flat: torch.Tensor, sg: SubGroup) -> list[torch.Tensor]:
    return [flat[o : o + p.numel()].view(p.shape) for p, o in zip(sg.params, sg.offsets)]


def _new_step() -> torch.Tensor:
    return torch.zeros((), dtype=torch.float32)  # what torch's Adam keeps as `step`


# -- host memory ------------------------------------------------------------------------------
class HostStore:
    """Optimizer state in (pinned) host memory; `state` is a plain dict as in torch."""

    tier = "host"

    def __init__(self, rule, pin: bool):
        self.rule = rule
        self.pin = pin
        self.state: dict[nn.Parameter, dict] = {}
        self._flat: dict[int, dict[str, torch.Tensor]] = {}  # sub-group -> key -> buffer

    def prefetch(self, sg: SubGroup, block: bool = True):
        return sg

    def acquire(self, sg: SubGroup, stepped: list[bool]) -> dict[str, list]:
        if self.rule.zero_init and sg.index not in self._flat:
            self._flat[sg.index] = {k: host_empty(sg.numel, pin=self.pin).zero_()
                                    for k in self.rule.state_keys}
        lists: dict[str, list] = {k: [] for k in self.rule.state_keys}
        for i, (p, take) in enumerate(zip(sg.params, stepped)):
            if not take:
                continue
            entry = self.state.get(p)
            if entry is None:
                entry = self.state[p] = self._fresh_entry(sg, i)
            for k in self.rule.state_keys:
                lists[k].append(entry.get(k))
        return lists

    def _fresh_entry(self, sg: SubGroup, i: int) -> dict:
        entry: dict = {"step": _new_step()} if self.rule.counts_steps else {}
        if self.rule.zero_init:
            o, n = sg.offsets[i], sg.params[i].numel()
            for k, flat in self._flat[sg.index].items():
                entry[k] = flat[o : o + n].view(sg.params[i].shape)
        return entry

    def params(self, handle: SubGroup, stepped: list[bool]) -> list[torch.Tensor]:
        """The tensors the update writes: the masters themselves."""
        return [p for p, take in zip(handle.params, stepped) if take]

    def step_grads(self, handle: SubGroup, stepped: list[bool], given: list[torch.Tensor]) -> list[torch.Tensor]:
        return given  # the masters' .grad

    def step_tensors(self, sg: SubGroup, stepped: list[bool]) -> list[torch.Tensor]:
        if not self.rule.counts_steps:
            return []
        return [self.state[p]["step"] for p, take in zip(sg.params, stepped) if take]

    def release(self, sg: SubGroup, stepped: list[bool], lists: dict[str, list]) -> None:
        if self.rule.zero_init:
            return
        params = [p for p, take in zip(sg.params, stepped) if take]
        for k, values in lists.items():  # state created by the step itself (SGD momentum)
            for p, v in zip(params, values):
                self.state[p][k] = v

    def begin_step(self) -> None:
        pass

    def finish_step(self, sub_groups: list[SubGroup]) -> None:
        pass

    def settle(self) -> None:
        pass

    def drain(self) -> None:
        pass

    def resident_tensors(self) -> list[torch.Tensor]:
        return [v for entry in self.state.values() for v in entry.values()
                if isinstance(v, torch.Tensor)]

    def nvme_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass


# -- swap files --------------------------------------------------------------------------------
class BufferPool:
    """A fixed number of aligned (pinned) host buffers shared by swap-ins and swap-outs.

    A buffer being written out stays taken until its write completes; `take` reclaims
    finished writes first and, when `block`, waits for the oldest one."""

    def __init__(self, count: int, nbytes: int, pin: bool):
        self.nbytes = nbytes
        self.free = [host_empty(nbytes // _F32, pin=pin, align=ALIGN) for _ in range(count)]
        self._all = list(self.free)  # free, being written, or taken (read into, read ahead)
        self.count = count
        self._busy: deque[tuple[list[IoRequest], list[torch.Tensor]]] = deque()

    def take(self, n: int, block: bool) -> list[torch.Tensor] | None:
        if n > self.count:
            raise RuntimeError(f"a sub-group needs {n} swap buffers, the pool has {self.count}")
        while self._busy and all(r.done() for r in self._busy[0][0]):
            self._reclaim()
        while len(self.free) < n:
            if not block or not self._busy:
                return None
            self._reclaim()
        out, self.free = self.free[:n], self.free[n:]
        return out

    def give_back_after(self, requests: list[IoRequest], buffers: list[torch.Tensor]) -> None:
        self._busy.append((requests, buffers))

    def give_back(self, buffers: list[torch.Tensor]) -> None:
        self.free.extend(buffers)

    def drain(self) -> None:
        while self._busy:
            self._reclaim()

    def _reclaim(self) -> None:
        requests, buffers = self._busy.popleft()
        for r in requests:
            r.wait()
        self.free.extend(buffers)

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer of the pool, whoever holds it now."""
        return list(self._all)


@dataclass
class _Handle:
    sg: SubGroup
    buffers: dict[str, torch.Tensor]
    reads: list[IoRequest]
    master: torch.Tensor | None = None  # the sub-group's fp32 masters, when they are swapped
    grad: torch.Tensor | None = None  # their gradients, when those are in files
    generations: dict[str, int] | None = None  # read ahead: each file's write count at the read


class SwapStore:
    """Optimizer state in files under a swap directory, `buffer_count` buffers in memory.

    Files: `sg<index>.<key>.swp`, one per sub-group and state key, `SubGroup.nbytes` long.
    A sub-group none of whose parameters has stepped is not read: its buffers are zeroed
    (Adam's initial state). `state` is a mapping that reads a parameter's state from its
    files on access and writes it on assignment (checkpoints use it one parameter at a
    time, and `state.deferred(p)` to read one tensor at a time; iterating over all values
    reads everything).

    Note [the step's I/O outside the step]
    The disk would idle through forward and backward, then do all of the step's optimizer
    I/O at once. So the store moves some of it out of the step, within the same pool:
      - write-behind: `finish_step` returns with the last sub-groups' masters and moments
        and the masters' last published 16-bit ranges still being written. The next
        forward's shard reads, the next step's reads and checkpoints are ordered after
        them by the swap engine (Note [a read never overtakes an earlier write] in aio.py),
        so nothing reads a range before its write has completed.
      - read-ahead: a thread then waits for those writes (which frees the pool and the
        16-bit copies) and reads the masters and moments of the first sub-groups of the
        next step into the pool's free buffers, as many as fit. That read runs during the
        next forward and backward; the step then only reads their gradients, which land
        during backward. `begin_step` joins the thread and drops any buffer whose file was
        written after it was read (`write_generation`: a checkpoint load or a user's
        change of a master in between), which is then read again in the step.
    Both use the `buffer_count` buffers the pool already holds (they are idle between
    steps) and the masters' 256 MiB bound on 16-bit copies in flight: no memory is added.
    The update itself is unchanged, so results are bit-identical."""

    tier = "nvme"

    def __init__(self, rule, sub_groups: list[SubGroup], directory: str, engine: SwapEngine, *,
                 buffer_count: int, pin: bool, preallocate: bool, masters=None, grads=None,
                 resident_numel: int | None = 0):
        if not rule.zero_init:
            raise ConfigError([("offload_optimizer.device \"nvme\" supports Adam and AdamW "
                               "(state created as zeros); use device \"cpu\" for SGD")])
        # masters: a MasterFiles (masters.py) when the fp32 masters are swapped with the state
        if masters is not None and not any(masters.holds(p) for sg in sub_groups for p in sg.params):
            masters = None  # (fp32 masters that are the parameters themselves stay put)
        self.masters = masters
        # grads: a GradFiles (grad_files.py) when the gradients of swapped masters are in files
        self.grads = grads if masters is not None else None
        k = len(rule.state_keys) + (masters is not None) + (self.grads is not None)
        if buffer_count < k:
            what = "one per optimizer state" + (" and one for the fp32 masters" if masters else "") \
                + (" and one for their gradients" if self.grads is not None else "")
            raise ConfigError([(f"offload_optimizer.buffer_count: {buffer_count} is fewer than the "
                               f"{k} swap buffers one sub-group needs ({what}); "
                               f"use at least {k}, and {2 * k} to overlap swapping with the update")])
        self.rule = rule
        self.dir = directory
        self.engine = engine
        self.sub_groups = sub_groups
        self.group_of = {p: sg for sg in sub_groups for p in sg.params}
        self.index_in = {p: i for sg in sub_groups for i, p in enumerate(sg.params)}
        self.steps: dict[nn.Parameter, torch.Tensor] = {}
        self.written: set[int] = set()  # sub-groups whose files hold state
        self.state = SwappedState(self)
        # per sub-group, the runs of its masters in their files (Note [masters on NVMe])
        self.runs = {sg.index: masters.runs([p for p in sg.params if masters.holds(p)],
                                            [o for p, o in zip(sg.params, sg.offsets) if masters.holds(p)])
                     for sg in sub_groups} if masters is not None else {}
        self.owner = None  # keeps the directory (a SwapDir) alive as long as the store
        self.resident = self._make_resident(resident_numel or 0, pin)
        # with every sub-group resident only gradients pass through the pool: two buffers
        count = buffer_count if len(self.resident) < len(sub_groups) else min(buffer_count, 2 * (self.grads is not None))
        self.pool = BufferPool(count, max((sg.nbytes for sg in sub_groups), default=0), pin)
        # Note [the step's I/O outside the step]
        self._early: dict[int, _Handle] = {}  # sub-group index -> read ahead for the next step
        self._tail: list[tuple[IoRequest, torch.Tensor]] = []  # 16-bit publishes still in flight
        self._ahead: threading.Thread | None = None
        self._ahead_error: BaseException | None = None
        self.defer_publish = None  # (master, 16-bit copy) -> None, while the backward runs
        self.preallocated = False
        if preallocate:
            self.preallocate()

    def preallocate(self) -> None:
        """Create the moment files at their size now: a disk that cannot hold them fails
        here, not mid-step (Note [room for the files the first step writes] in space.py)."""
        with progress(len(self.sub_groups) * len(self.rule.state_keys), "NVMe swap files", unit="file") as bar:
            for sg in self.sub_groups:
                for key in self.rule.state_keys if sg.index not in self.resident else ():
                    _preallocate(self.path(sg, key), sg.nbytes)
                    bar.update()
        self.preallocated = True

    def path(self, sg: SubGroup, key: str) -> str:
        return os.path.join(self.dir, f"sg{sg.index}.{key}.swp")

    # Note [the residency budget] in meshspeed/offload/residency.py: the first sub-groups
    # that fit `resident_numel` keep their moments and fp32 masters in host buffers of
    # their own; a step reads only their gradients, and writes nothing of them
    def _make_resident(self, numel: int, pin: bool) -> dict[int, dict[str, torch.Tensor]]:
        out: dict[int, dict[str, torch.Tensor]] = {}
        used = 0
        for sg in self.sub_groups:
            if used + sg.numel > numel:
                break
            used += sg.numel
            bufs = {k: host_empty(sg.nbytes // _F32, pin=pin, align=ALIGN).zero_() for k in self.rule.state_keys}
            if self.masters is not None:
                master = host_empty(sg.nbytes // _F32, pin=pin, align=ALIGN)
                for r in self.masters.read_runs(self.runs[sg.index], master):
                    r.wait()  # once, here; from now on the buffer is the master
                self.masters.keep_in_memory([p for p in sg.params if self.masters.holds(p)],
                                            [v for p, v in zip(sg.params, _views(master, sg))
                                             if self.masters.holds(p)])
                bufs[_MASTER] = master
            out[sg.index] = bufs
        return out

    def resident_summary(self) -> tuple[int, int]:
        """(sub-groups resident, their bytes)."""
        return len(self.resident), sum(b.nbytes for bufs in self.resident.values() for b in bufs.values())

    # -- pipeline ---------------------------------------------------------------------------
    def prefetch(self, sg: SubGroup, block: bool = True) -> _Handle | None:
        if sg.index in self.resident:  # masters and moments in memory: only the gradients
            return self._prefetch_resident(sg, block)
        early = self._early.pop(sg.index, None)
        if early is not None:  # masters and moments were read ahead: only the gradients now
            self._read_grads(early)
            return early
        return self._start(sg, block, grads=True)

    def _start(self, sg: SubGroup, block: bool, grads: bool) -> _Handle | None:
        k = len(self.rule.state_keys)
        n = k + (self.masters is not None) + (self.grads is not None)
        buffers = self.pool.take(n, block)
        while buffers is None and block and self._early:
            # what was read ahead for later holds the pool: the sub-group due now goes first
            self._drop(self._early.pop(next(reversed(self._early))))
            buffers = self.pool.take(n, block)
        if buffers is None:
            return None
        named = dict(zip(self.rule.state_keys, buffers))
        master = buffers[k] if self.masters is not None else None
        grad = buffers[k + 1] if self.grads is not None else None
        paths = [self.path(sg, key) for key in named]
        if master is not None:
            paths += [self.masters.path(u) for u, *_ in self.runs[sg.index]]
        generations = {p: write_generation(p) for p in paths}  # before the reads are submitted
        reads = [] if master is None else self.masters.read_runs(self.runs[sg.index], master)
        for key, buf in named.items():
            region = buf[: sg.nbytes // _F32]
            if sg.index in self.written:
                reads.append(self.engine.read(region, self.path(sg, key)))
            else:
                region.zero_()
        handle = _Handle(sg, named, reads, master, grad, generations)
        if grads:
            self._read_grads(handle)
        return handle

    def _read_grads(self, handle: _Handle) -> None:
        if handle.grad is not None:  # Note [gradients in their NVMe slot] in grad_files.py
            handle.reads += self.grads.read_runs(self.runs[handle.sg.index], handle.grad)

    # -- Note [the step's I/O outside the step] ---------------------------------------------
    def begin_step(self) -> None:
        """Join the read-ahead; drop what was read from a file written since."""
        self._join()
        for index, handle in list(self._early.items()):
            if any(write_generation(p) != g for p, g in handle.generations.items()):
                self._drop(self._early.pop(index))

    def finish_step(self, sub_groups: list[SubGroup]) -> None:
        """Return with the write-back in flight; read `sub_groups`' masters and moments for
        the next step as the writes free the pool."""
        self._join()
        if self.masters is not None:  # the publishes in flight become this store's to finish
            self._tail += self.masters.hand_over_pending()
        self._ahead = threading.Thread(target=self._read_ahead, args=(list(sub_groups),),
                                       name="meshspeed-offload-read-ahead", daemon=True)
        self._ahead.start()

    def _read_ahead(self, sub_groups: list[SubGroup]) -> None:
        try:
            for request, _ in self._tail:
                request.wait()
            self._tail.clear()
            self.pool.drain()
            for sg in sub_groups:
                if sg.index in self.resident:
                    # its gradients need a pool buffer the read-ahead must not hold: read
                    # ahead only the sub-groups the step reaches before the first resident one
                    # (resident ones come first in the step, so with residency this reads none)
                    break
                if sg.index in self._early:
                    continue
                handle = self._start(sg, block=False, grads=False)
                if handle is None:
                    break
                self._early[sg.index] = handle
        except BaseException as err:  # noqa: BLE001 - re-raised by the next _join
            self._ahead_error = err

    def settle(self) -> None:
        """The last step's write-back has completed and the next step's reads are submitted
        (so `io_totals` has counted them: a step's bytes are then those between two settles)."""
        self._join()

    def _join(self) -> None:
        if self._ahead is not None:
            self._ahead.join()
            self._ahead = None
        err, self._ahead_error = self._ahead_error, None
        if err is not None:
            raise err

    def _drop(self, handle: _Handle) -> None:
        for r in handle.reads:
            r.wait()
        bufs = list(handle.buffers.values()) + [b for b in (handle.master, handle.grad) if b is not None]
        self.pool.give_back(bufs)

    def _discard_early(self) -> None:
        self._join()
        while self._early:
            self._drop(self._early.popitem()[1])

    def _prefetch_resident(self, sg: SubGroup, block: bool) -> _Handle | None:
        bufs = self.resident[sg.index]
        grad, reads = None, []
        if self.grads is not None:
            got = self.pool.take(1, block)
            if got is None:
                return None
            grad = got[0]
            reads = self.grads.read_runs(self.runs[sg.index], grad)
        named = {k: bufs[k] for k in self.rule.state_keys}
        return _Handle(sg, named, reads, bufs.get(_MASTER), grad)

    def acquire(self, handle: _Handle, stepped: list[bool]) -> dict[str, list]:
        for r in handle.reads:
            r.wait()
        if handle.grad is not None:  # widened, unscaled, clipped (Note [16-bit gradient files])
            self.grads.finish(self.runs[handle.sg.index], handle.grad)
        sg = handle.sg
        lists = {}
        for key, buf in handle.buffers.items():
            views = _views(buf, sg)
            lists[key] = [v for v, take in zip(views, stepped) if take]
        for p, take in zip(sg.params, stepped):
            if take and p not in self.steps:
                self.steps[p] = _new_step()
        return lists

    def params(self, handle: _Handle, stepped: list[bool]) -> list[torch.Tensor]:
        """The tensors the update writes: views of the swapped-in masters where the masters
        live in files, the master parameters themselves otherwise."""
        sg = handle.sg
        if handle.master is None:
            return [p for p, take in zip(sg.params, stepped) if take]
        views = _views(handle.master, sg)
        return [v if self.masters.holds(p) else p
                for p, v, take in zip(sg.params, views, stepped) if take]

    def step_tensors(self, sg: SubGroup, stepped: list[bool]) -> list[torch.Tensor]:
        return [self.steps[p] for p, take in zip(sg.params, stepped) if take]

    def step_grads(self, handle: _Handle, stepped: list[bool], given: list[torch.Tensor]) -> list[torch.Tensor]:
        """The gradients the update reads: views of the swapped-in gradient buffer where the
        gradients are in files, `given` (the masters' .grad) otherwise."""
        if handle.grad is None:
            return given
        views = _views(handle.grad, handle.sg)
        taken = [(p, v) for p, v, take in zip(handle.sg.params, views, stepped) if take]
        return [v if self.masters.holds(p) else g for (p, v), g in zip(taken, given)]

    def release(self, handle: _Handle, stepped=None, lists=None) -> None:
        sg = handle.sg
        if sg.index in self.resident:
            self._release_resident(handle, stepped)
            return
        writes = [self.engine.write(buf[: sg.nbytes // _F32], self.path(sg, key))
                  for key, buf in handle.buffers.items()]
        buffers = list(handle.buffers.values())
        if handle.master is not None:
            self._publish(handle, stepped)  # the 16-bit shard follows the updated master
            writes += self.masters.write_runs(self.runs[sg.index], handle.master)
            buffers.append(handle.master)
        if handle.grad is not None:
            self.pool.give_back([handle.grad])  # read only: free for the next prefetch now
        self.written.add(sg.index)
        self.pool.give_back_after(writes, buffers)

    def _release_resident(self, handle: _Handle, stepped) -> None:
        sg = handle.sg
        if handle.master is not None:
            self._publish(handle, stepped)
        if handle.grad is not None:
            self.pool.give_back([handle.grad])
        self.written.add(sg.index)

    def _publish(self, handle: _Handle, stepped) -> None:
        """The updated masters' 16-bit values -> their units' shards; during the backward
        (`defer_publish` set) handed to the thread that runs the backward instead, as
        copies (Note [the update during the backward] in optimizer.py)."""
        sg = handle.sg
        for p, v, take in zip(sg.params, _views(handle.master, sg), stepped or [True] * len(sg.params)):
            if take and self.masters.holds(p):
                if self.defer_publish is not None:
                    self.defer_publish(p, self.masters.published_copy(p, v))
                else:
                    self.masters.publish(p, v)

    def drain(self) -> None:
        """Every read and write of this store has completed (read-ahead dropped)."""
        self._discard_early()
        self.pool.drain()
        if self.masters is not None:
            self.masters.drain()

    # -- single-parameter access (checkpoints) ------------------------------------------------
    def read_param(self, p: nn.Parameter) -> dict:
        out: dict = {"step": self.steps[p]}
        for key in self.rule.state_keys:
            out[key] = self.read_key(p, key)
        return out

    def read_key(self, p: nn.Parameter, key: str) -> torch.Tensor:
        """One state tensor of `p` (a copy, shaped like `p`)."""
        self._join()
        sg, i = self.group_of[p], self.index_in[p]
        if sg.index in self.resident:
            o = sg.offsets[i]
            return self.resident[sg.index][key][o : o + p.numel()].clone().view(p.shape)
        t = torch.empty(p.numel(), dtype=torch.float32)
        if sg.index in self.written:
            self.engine.read(t, self.path(sg, key), sg.offsets[i] * _F32).wait()
        else:
            t.zero_()
        return t.view(p.shape)

    def write_param(self, p: nn.Parameter, entry: dict) -> None:
        self._discard_early()  # (its files are about to change, and may be truncated)
        sg, i = self.group_of[p], self.index_in[p]
        if sg.index in self.resident:
            o = sg.offsets[i]
            for key in self.rule.state_keys:
                self.resident[sg.index][key][o : o + p.numel()].copy_(entry[key].detach().reshape(-1))
        elif sg.index not in self.written:  # the rest of the sub-group starts as zeros
            for key in self.rule.state_keys:
                _preallocate(self.path(sg, key), sg.nbytes, zero=True)
            self.written.add(sg.index)
        for key in self.rule.state_keys if sg.index not in self.resident else ():
            t = entry[key].detach().to("cpu", torch.float32).contiguous().view(-1)
            self.engine.write(t, self.path(sg, key), sg.offsets[i] * _F32).wait()
        step = entry.get("step", 0)
        self.steps[p] = torch.as_tensor(step, dtype=torch.float32).clone().reshape(())

    # -- accounting ---------------------------------------------------------------------------
    def resident_tensors(self) -> list[torch.Tensor]:
        self._join()  # (the pool's tensors include the buffers the read-ahead holds)
        return list(self.steps.values()) + self.pool.tensors() + [b for _, b in self._tail] + \
            [b for bufs in self.resident.values() for b in bufs.values()]

    def nvme_bytes(self) -> int:
        total = 0
        for entry in os.scandir(self.dir):
            if entry.is_file():
                total += entry.stat().st_size
        return total

    def close(self) -> None:
        self.drain()
        self.engine.close()


def _preallocate(path: str, nbytes: int, zero: bool = False) -> None:
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        if zero:
            os.ftruncate(fd, 0)
        if hasattr(os, "posix_fallocate"):
            try:
                os.posix_fallocate(fd, 0, nbytes)  # reserves the blocks: ENOSPC now
                return
            except OSError as err:
                if err.errno not in (95, 22):  # EOPNOTSUPP/EINVAL: not supported here
                    raise
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)


class SwappedState(MutableMapping):
    """`optimizer.state` for swapped state: parameter -> {"step", "exp_avg", ...}.

    Reading an entry reads that parameter's slices from its files (a copy: changing it
    changes nothing on disk); assigning an entry writes them."""

    def __init__(self, store: SwapStore):
        self._store = store

    def __getitem__(self, p):
        if p not in self._store.steps:
            raise KeyError(p)
        return self._store.read_param(p)

    def deferred(self, p) -> dict:
        """The entry without reading it: "step" as a tensor, each state tensor as a
        Deferred that reads it when asked (checkpoints: one tensor in memory at a time)."""
        if p not in self._store.steps:
            raise KeyError(p)
        out: dict = {"step": self._store.steps[p]}
        for key in self._store.rule.state_keys:
            out[key] = Deferred(torch.float32, tuple(p.shape),
                                functools.partial(self._store.read_key, p, key))
        return out

    def __setitem__(self, p, entry) -> None:
        if p not in self._store.group_of:
            raise KeyError("not a parameter of this optimizer")
        self._store.write_param(p, entry)

    def __delitem__(self, p) -> None:
        del self._store.steps[p]

    def __iter__(self) -> Iterator:
        return iter(list(self._store.steps))

    def __len__(self) -> int:
        return len(self._store.steps)

    def __contains__(self, p) -> bool:
        return p in self._store.steps
