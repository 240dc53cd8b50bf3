"""`OffloadPlacement`: the placement policy (meshspeed/parallel/zero/placement.py) that
keeps the optimizer's side of each ZeRO unit in host memory.

What moves, per ZeRO unit (flat.py and unit.py in meshspeed/parallel/zero):

- fp32 master slices -> one host buffer per unit (`unit.master_buffer`), which the
  unit's `masters` view; `publish_masters` then copies host -> device parameters.
- the gradient shard the optimizer consumes -> a host fp32 buffer per unit, copied
  (non-blocking, into pinned memory where possible) at `prepare_step`, unit by unit.
- stage 3 with `offload_param`: the unit's parameter shard moves into a shard store
  (param.py: host memory or a swap file) that a stage-3 FlatUnit reads for each gather.

Note [offload on a CPU-only machine]
When the compute device is the CPU itself, "moving to host" is a relabelling: an fp32
master that is the parameter's own slice, an fp32 gradient shard and a stage-3 shard are
already in host memory, and copying them would only double their bytes. They are then
left in place and accounted in the host tier. Copies happen whenever they are real:
low-precision training (the fp32 masters and fp32 gradients are separate tensors
anyway, and are built directly in host buffers), an accelerator device, and delayed
updates (the step must not write into tensors the next forward reads).

Note [delayed parameter update]
(ZeRO-Offload, Ren et al., USENIX ATC 2021, Section 5.) With `delayed_update`, the host
step of step N runs in a background thread while forward and backward of step N+1 run.
The engine's sequence at step N becomes:
    prepare_step: wait for step N-1's update; publish its masters into the parameters
                  (forward N+1 will use them); copy gradient N to host
    optimizer.step(): start update N (masters M_N -> M_N+1) in the background
    finish_step: drop the gradients; publish nothing (update N is still running)
So gradient N is computed on parameters M_N-1 (one step stale; M_-1 = M_0) and applied to
M_N. The first step's forward and the second's use the initial parameters. Everything
that reads masters or optimizer state waits for the running update first; `flush()`
also publishes it (call it before evaluating or saving the module's weights alone).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from meshspeed import comm
from meshspeed.offload.grad_files import grad_placeholder
from meshspeed.offload.hostmem import host_empty
from meshspeed.offload.masters import SwappedMaster
from meshspeed.offload.optimizer import BackgroundStep
from meshspeed.offload.swapdir import SwapDir, rank_path
from meshspeed.parallel.zero.flat import publish_all
from meshspeed.parallel.zero.placement import DevicePlacement
from meshspeed.process.accelerator import get_accelerator
from meshspeed.process.malloc import release_free_heap

log = logging.getLogger("meshspeed")


class OffloadPlacement(DevicePlacement):
    """Handed to `Zero` as its placement; `bind` runs once the units exist."""

    def __init__(self, *, device: torch.device, offload_optimizer: bool, offload_param: str,
                 pin: bool, delayed: bool, make_shard_store=None, make_master_files=None,
                 make_grad_files=None):
        self.device = device
        self.pin = pin
        self.offload_optimizer = offload_optimizer
        self.offload_param = offload_param != "none"
        self._param_tier = offload_param
        self.runner = BackgroundStep() if delayed else None
        self.make_shard_store = make_shard_store
        # make_master_files(placement) -> MasterFiles: masters in swap files (masters.py);
        # None: in host memory. Delayed updates keep them in memory (Note [masters on NVMe]).
        self.make_master_files = None if delayed else make_master_files
        self.master_files = None
        # make_grad_files(placement, master_files) -> GradFiles: the reduced gradients of
        # units whose masters are in files go to files too (grad_files.py)
        self.make_grad_files = None if delayed else make_grad_files
        self.grad_files = None
        self._published = True  # masters and parameters agree
        self._host: list[torch.Tensor] = []  # storages that are host tier by placement
        self._host_grads: dict[int, torch.Tensor] = {}
        self.grads_on_host: set[int] = set()  # units whose gradient already moved this step
        self.shard_store = None
        self.swap_dirs: dict[str, object] = {}  # nvme_path -> this rank's SwapDir there
        # the optimizer's grads_landed(landed unit indices), when it updates during the
        # backward (Note [the update during the backward] in optimizer.py)
        self.on_grads_landed = None
        # the optimizer's updates that step() left running into the next forward: finished
        # before gradients land again and before anything reads masters (Note [the update
        # that runs into the next forward] in optimizer.py)
        self.finish_updates = None

    def unit_built(self, zero, unit) -> None:
        """One unit is built: its masters go to their buffer or file and its stage-3 shard
        to the shard store now, before the next unit is built (Note [units placed as they
        are built])."""
        if self.make_master_files is not None and self.master_files is None:
            self.master_files = self.make_master_files(self)
            if self.make_grad_files is not None:
                self.grad_files = self.make_grad_files(self, self.master_files)
        op = self._param_tier
        shards_move = op == "nvme" or (op == "cpu" and self.device.type != "cpu")
        # a shard that leaves this memory (to a file, or from a device to the host) cannot
        # stay the fp32 master it was in fp32 training: masters get their own host buffer
        separate = self.runner is not None or self.device.type != "cpu" or shards_move
        if self.offload_optimizer or (shards_move and unit.shard_params):
            self._place_masters(zero, unit, copy=separate)
        if unit.shard_params and self.offload_param and self.make_shard_store is not None:
            if self.shard_store is None:
                self.shard_store = self.make_shard_store(self, [])
            self.shard_store.add(unit)
            unit.use_store(self.shard_store)

    def bind(self, zero) -> None:
        """Every unit is built and placed (`unit_built`); nothing is left to move. What
        building them freed (zero.Init's shards, each unit's masters and shard before they
        went to their files) goes back to the OS now rather than after the first step
        (Note [returning the freed heap after each offloaded step])."""
        if self.master_files is not None:
            release_free_heap()

    # -- placement ----------------------------------------------------------------------------
    # Note [units placed as they are built]
    # `Zero` hands each unit to `unit_built` as soon as it is built, before building the
    # next: a unit's fp32 `master_buffer` and stage-3 shard move to their file (or host
    # buffer) and are freed there, so initialize holds one unit's fp32 master and shard
    # at a time rather than every unit's (4 + 2 bytes a parameter for the whole model, the
    # init peak when all units were built first and placed in `bind`). The shard store
    # sizes its staging pool at its first use, once all are added (Note [shards larger
    # than a staging buffer] in param.py).

    def _place_masters(self, zero, unit, copy: bool) -> None:
        """Point the unit's masters at one host buffer (Note [offload on a CPU-only machine])."""
        if unit.master_buffer is None and not copy:
            return  # fp32 on the CPU: the master is the parameter's own slice (counted there)
        if self.master_files is not None:
            self._swap_masters(zero, unit)
            return
        buf = host_empty(unit.shard_numel, torch.float32, pin=self.pin).zero_()
        for i, (s, p, m) in enumerate(zip(unit.spans, unit.params, unit.masters)):
            view = buf[s.offset : s.offset + s.numel]
            view.copy_(m.detach())
            # A new Parameter, not `m.data = view`: a master made from a slice of its
            # parameter shares the parameter's autograd version counter, and a host step
            # running during the next backward (delayed update) would then look like an
            # in-place edit of a tensor saved for backward.
            fresh = nn.Parameter(view, requires_grad=m.requires_grad)
            unit.masters[i] = fresh
            zero.master_of[id(p)] = fresh  # the optimizer is built from this map
        unit.master_buffer = buf
        self._host.append(buf)

    def _swap_masters(self, zero, unit) -> None:
        """The unit's masters -> their file; placeholders take their place (masters.py)."""
        files = self.master_files
        values = unit.master_buffer if unit.master_buffer is not None else unit.shard
        fresh = files.add(unit, values)
        for i, (p, m) in enumerate(zip(unit.params, fresh)):
            unit.masters[i] = m
            zero.master_of[id(p)] = m
        unit.master_buffer = None  # freed: the file holds the masters from now on
        u = len(files.units) - 1
        unit.master_sink = lambda values, u=u: files.write_unit(u, values)

    def swapped_master(self, master):
        """A SwappedMaster for a master that lives in a file, else None."""
        if self.master_files is None or not self.master_files.holds(master):
            return None
        return SwappedMaster(self.master_files, master)

    def _copies_grads(self, unit) -> bool:
        # a delayed update reads its gradients while the next backward reduces new ones
        # into the unit's (persistent) gradient shard: it must step on a copy
        swapped = self.master_files is not None and any(self.master_files.holds(m) for m in unit.masters)
        if unit.master_buffer is None and not swapped:
            return False
        return (unit.grad_shard.dtype != torch.float32 or unit.grad_shard.device.type != "cpu"
                or self.device.type != "cpu" or self.runner is not None)

    def grad_shard_ready(self, unit) -> None:
        """Copy one unit's reduced gradient into its host fp32 buffer (non-blocking into
        pinned memory on an accelerator), as each unit's reduction lands at the
        accumulation boundary, so the copies overlap the rest of backward. A delayed
        update still reads last step's host gradients meanwhile: it copies at the step."""
        if self._grads_to_file(unit):
            self._land(unit)  # Note [gradients in their NVMe slot] in grad_files.py
            unit.grad_written()
            if self.on_grads_landed is not None:  # Note [the update during the backward]
                self.on_grads_landed(self.grad_files.landed)
            return
        if self.runner is None and self._move_grad_shard(unit):
            # the host copy is what the step reads: the 16-bit shard is not kept across
            # steps (2 bytes a parameter; Note [one gradient copy between steps])
            unit.grad_moved(self._host_grads[id(unit)])

    # Note [one gradient copy between steps]
    # Without a delayed update, each unit's reduced gradient is copied into its fp32 host
    # buffer as its reduction lands at the boundary backward (`grad_shard_ready`), and
    # `FlatUnit.grad_moved` then makes that copy the unit's `grad_shard` and frees the
    # 16-bit one: between the boundary and the next backward only the fp32 host copy is
    # held (4 bytes a parameter, not 4 + 2). The values are the same (the copy of the
    # 16-bit shard, accumulated over micro-steps in 16 bits as before); readers of
    # `grad_shard` (safe_get_full_grad) see them in fp32. The next step's first reduction
    # allocates the 16-bit buffer again: one shard-sized block per unit per step, which
    # on the CPU is an mmap (Note [a fixed mmap threshold for CPU training]).

    def _land(self, unit) -> None:
        if self.finish_updates is not None:
            self.finish_updates()  # (they read the files this overwrites)
        self.grad_files.land(unit)

    def _grads_to_file(self, unit) -> bool:
        return (self.grad_files is not None and unit.grad_shard is not None
                and self.grad_files.holds(unit))

    def deferred_grads(self):
        """The GradFiles when gradients are written to files, else None (the engine's boundary
        then works on what they recorded: Note [gradients in their NVMe slot])."""
        return self.grad_files

    def _move_grad_shard(self, unit) -> bool:
        if unit.grad_shard is None or not self._copies_grads(unit):
            return False
        host = self._host_grads.get(id(unit))
        if host is None:
            host = self._host_grads[id(unit)] = host_empty(unit.shard_numel, pin=self.pin)
            self._host.append(host)
        host.copy_(unit.grad_shard, non_blocking=True)
        self.grads_on_host.add(id(unit))
        return True

    def attach_grads(self, units) -> None:
        """Gradient shards -> host fp32 buffers, unit by unit; masters' .grad view them."""
        copied = bool(self.grads_on_host)
        files = self.grad_files
        for unit in units:
            if self._grads_to_file(unit):  # (a unit whose reduction no hook reported)
                self._land(unit)
                unit.grad_written()
            if files is not None and files.has_landed(unit):
                for s, m in zip(unit.spans, unit.masters):
                    if m.requires_grad:
                        m.grad = grad_placeholder(s.numel)
                continue
            if unit.grad_shard is None:
                continue
            moved = id(unit) in self.grads_on_host  # (then grad_shard is the host copy)
            if not moved and not self._copies_grads(unit):
                unit.attach_master_grads()
                continue
            if not moved:
                copied |= self._move_grad_shard(unit)
            host = self._host_grads[id(unit)]
            for s, m in zip(unit.spans, unit.masters):
                if m.requires_grad:
                    m.grad = host[s.offset : s.offset + s.numel]
        if copied and self.device.type != "cpu":
            get_accelerator(self.device.type).synchronize()  # non-blocking D2H copies landed
        self.grads_on_host.clear()
        if files is not None:
            files.wait()  # the optimizer reads them back next

    # -- the step -------------------------------------------------------------------------------
    def before_step(self, zero) -> None:
        self._settle(zero)
        if self.master_files is not None:  # Note [returning the freed heap after each offloaded step]
            release_free_heap()  # what backward freed, before the optimizer's transients

    def finish_step(self, zero) -> None:
        if self.runner is None:
            super().finish_step(zero)  # publish the masters, drop the gradients
            if self.grad_files is not None:
                self.grad_files.reset()
            if self.master_files is not None:  # Note [returning the freed heap after each offloaded step]
                release_free_heap()
            return
        self._published = False  # the update (if the engine started one) is still running
        for unit in zero.units:
            unit.drop_grads()

    def _settle(self, zero) -> None:
        """Delayed updates: wait for the running update and publish its result."""
        if self.runner is None:
            return
        self.runner.wait()
        if not self._published:
            publish_all(zero.units)
            self._published = True

    def wait(self) -> None:
        if self.runner is not None:
            self.runner.wait()
        if self.finish_updates is not None:
            self.finish_updates()

    def published(self) -> None:
        self._published = True

    def flush(self, zero) -> None:
        """Finish a delayed update and publish it (a collective: call on every rank)."""
        self._settle(zero)

    # -- accounting -----------------------------------------------------------------------------
    def extra_grads(self) -> list[torch.Tensor]:
        pending = [] if self.grad_files is None else self.grad_files.host_tensors()
        return list(self._host_grads.values()) + pending

    def grad_staging(self) -> list[torch.Tensor]:
        return [] if self.grad_files is None else self.grad_files.staging_tensors()

    def param_staging(self) -> list[torch.Tensor]:
        """The shard store's staging pool and 16-bit writes in flight (counted as "params")."""
        out = [] if self.shard_store is None else self.shard_store.host_tensors([])
        if self.master_files is not None:
            out += self.master_files.host_tensors()
        return out

    def host_tensors(self, zero) -> list[torch.Tensor]:
        """Tensors that are host tier by placement (see meshspeed/offload/tiers.py)."""
        out = list(self._host) + (self.master_files.host_tensors() if self.master_files is not None else [])
        if self.grad_files is not None:
            out += self.grad_files.host_tensors() + self.grad_files.staging_tensors()
        if self.shard_store is None:
            return out
        return out + self.shard_store.host_tensors([u for u in zero.units if u.shard_params])

    def swap_dir(self, nvme_path: str):
        """This rank's swap directory under `nvme_path` (one per path, shared by owners)."""
        nvme_path = rank_path(nvme_path)  # a list: this rank's disk (Note [one disk per rank])
        if nvme_path not in self.swap_dirs:
            rank = comm.get_rank() if comm.is_initialized() else 0
            self.swap_dirs[nvme_path] = SwapDir(nvme_path, rank)
        return self.swap_dirs[nvme_path]

    def nvme_bytes(self) -> dict[str, int]:
        out = {} if self.shard_store is None else {"params": self.shard_store.nvme_bytes()}
        if self.master_files is not None:
            out["master_params"] = self.master_files.nvme_bytes()
        if self.grad_files is not None:
            out["grads"] = self.grad_files.nvme_bytes()
        return out

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()
        if self.shard_store is not None:
            self.shard_store.close()
        if self.master_files is not None:
            self.master_files.close()
        if self.grad_files is not None:
            self.grad_files.close()
        for swapdir in self.swap_dirs.values():
            swapdir.close()
