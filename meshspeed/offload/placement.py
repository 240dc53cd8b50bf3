"""`OffloadedZero`: ZeRO with the optimizer's side of each unit kept in host memory.

What moves, per ZeRO unit (see meshspeed/parallel/zero/unit.py for the unit itself):

- fp32 master slices -> one host buffer per unit (`unit.master_buffer`), which the
  unit's `masters` view; `publish_masters` then copies host -> device parameters.
- the gradient shard the optimizer consumes -> a host fp32 buffer per unit, copied
  (non-blocking, into pinned memory where possible) at `prepare_step`, unit by unit.
- stage 3 with `offload_param`: the unit's parameter shard moves into a shard store
  (param.py: host memory or a swap file) that ZeroUnit reads for each gather, through
  its `shard_store` hook; without that hook, on a CPU-only machine, the shard stays
  where it is and is accounted as host tier.

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
import weakref

import torch
from torch import nn

from meshspeed.offload.hostmem import host_empty
from meshspeed.offload.optimizer import BackgroundStep

log = logging.getLogger("meshspeed")


class OffloadedZero:
    """Wraps a `Zero` strategy; the engine and checkpoints use it in its place.

    The strategy protocol methods that offload changes are defined here; everything else
    (`units`, `owned_slices` bookkeeping, `gather_for_user`, ...) is the wrapped
    strategy's, reached through attribute delegation."""

    def __init__(self, inner, *, device: torch.device, offload_optimizer: bool,
                 offload_param: str, pin: bool, delayed: bool, make_shard_store=None):
        self.inner = inner
        self.device = device
        self.pin = pin
        self.offload_optimizer = offload_optimizer
        self.offload_param = offload_param != "none"
        self.runner = BackgroundStep() if delayed else None
        self._published = True  # masters and parameters agree
        on_host = device.type == "cpu"
        self._host: list[torch.Tensor] = []  # storages that are host tier by placement
        self._host_grads: dict[int, torch.Tensor] = {}
        self._grads_on_host: set[int] = set()  # units whose gradient already moved this step
        if self.runner is None:  # a delayed update still reads the host gradients meanwhile
            # per unit, during backward; a weak reference, so that the wrapped strategy
            # does not keep this wrapper (and its swap files) alive in a cycle
            method = weakref.WeakMethod(self._move_grad_shard)
            inner.grad_shard_ready = lambda unit: (m := method()) is not None and m(unit)
        sharded = [u for u in inner.units if u.shard_params]
        # a shard that leaves this memory (to a file, or from a device to the host) cannot
        # stay the fp32 master it was in fp32 training: masters get their own host buffer
        shards_move = offload_param == "nvme" or (offload_param == "cpu" and not on_host)
        separate = delayed or not on_host or shards_move
        for unit in inner.units:
            if offload_optimizer or (shards_move and unit.shard_params):
                self._place_masters(unit, copy=separate)
        self.shard_store = None
        self.swap_dirs: dict[str, object] = {}  # nvme_path -> this rank's SwapDir there
        if self.offload_param and make_shard_store is not None:
            self.shard_store = make_shard_store(self, sharded)
            for unit in sharded:
                unit.shard_store = self.shard_store
        elif self.offload_param:  # no hook in ZeroUnit: CPU only (setup.py), shards already host
            self._host.extend(u.shard for u in sharded)

    def __getattr__(self, name):  # only called for names not defined here
        return getattr(self.__dict__["inner"], name)

    # -- placement ----------------------------------------------------------------------------
    def _place_masters(self, unit, copy: bool) -> None:
        """Point the unit's masters at one host buffer (Note [offload on a CPU-only machine])."""
        if unit.master_buffer is None and not copy:
            return  # fp32 on the CPU: the master is the parameter's own slice (counted there)
        buf = host_empty(unit.layout.shard_numel, torch.float32, pin=self.pin).zero_()
        for i, (lay, p, m) in enumerate(zip(unit.layout.params, unit.params, unit.masters)):
            view = buf[lay.offset : lay.offset + m.numel()]
            view.copy_(m.detach())
            # A new Parameter, not `m.data = view`: a master made from a slice of its
            # parameter shares the parameter's autograd version counter, and a host step
            # running during the next backward (delayed update) would then look like an
            # in-place edit of a tensor saved for backward.
            fresh = nn.Parameter(view, requires_grad=m.requires_grad)
            unit.masters[i] = fresh
            self.inner.master_of[id(p)] = fresh  # the optimizer is built from this map
        unit.master_buffer = buf
        self._host.append(buf)

    def _copies_grads(self, unit) -> bool:
        return unit.master_buffer is not None and (
            unit.grad_shard.dtype != torch.float32 or unit.grad_shard.device != unit.master_buffer.device
            or self.device.type != "cpu")

    def _move_grad_shard(self, unit) -> bool:
        """Copy one unit's reduced gradient into its host fp32 buffer (non-blocking into
        pinned memory on an accelerator). Called by the strategy as each unit's
        reduction lands at the accumulation boundary, so the copies overlap the rest of
        backward; returns whether a copy was made."""
        if unit.grad_shard is None or not self._copies_grads(unit):
            return False
        host = self._host_grads.get(id(unit))
        if host is None:
            host = self._host_grads[id(unit)] = host_empty(unit.layout.shard_numel, pin=self.pin)
            self._host.append(host)
        host.copy_(unit.grad_shard, non_blocking=True)
        self._grads_on_host.add(id(unit))
        return True

    def _attach_host_grads(self) -> None:
        """Gradient shards -> host fp32 buffers, unit by unit; masters' .grad view them."""
        copied = bool(self._grads_on_host)
        for unit in self.inner.units:
            if unit.grad_shard is None:
                continue
            if not self._copies_grads(unit):
                unit.attach_master_grads()
                continue
            if id(unit) not in self._grads_on_host:
                copied |= self._move_grad_shard(unit)
            host = self._host_grads[id(unit)]
            for lay, m in zip(unit.layout.params, unit.masters):
                if m.requires_grad:
                    m.grad = host[lay.offset : lay.offset + m.numel()]
        if copied and self.device.type != "cpu":
            from meshspeed.runtime.accelerator import get_accelerator

            get_accelerator(self.device.type).synchronize()  # non-blocking D2H copies landed
        self._grads_on_host.clear()

    # -- strategy protocol ----------------------------------------------------------------------
    def prepare_step(self) -> list[nn.Parameter]:
        self._settle()
        self._attach_host_grads()
        return self.inner.masters()

    def finish_step(self) -> None:
        if self.runner is None:
            self.inner.finish_step()
            return
        self._published = False  # the update (if the engine started one) is still running
        for unit in self.inner.units:
            unit.drop_grads()

    def _settle(self) -> None:
        """Delayed updates: wait for the running update and publish its result."""
        if self.runner is None:
            return
        self.runner.wait()
        if not self._published:
            for unit in self.inner.units:
                unit.publish_masters()
            self._published = True

    def wait(self) -> None:
        if self.runner is not None:
            self.runner.wait()

    def flush(self) -> None:
        """Finish a delayed update and publish it (a collective: call on every rank)."""
        self._settle()

    def owned_slices(self):
        self.wait()  # masters are final once the running update is done
        return self.inner.owned_slices()

    def sync_params_from_masters(self) -> None:
        self.wait()
        self.inner.sync_params_from_masters()
        self._published = True

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        out = self.inner.memory_tensors()
        out["grads"] = out.get("grads", []) + list(self._host_grads.values())
        return out

    def host_tensors(self) -> list[torch.Tensor]:
        """Tensors that are host tier by placement (see meshspeed/offload/tiers.py)."""
        shards = [] if self.shard_store is None else self.shard_store.host_tensors(
            [u for u in self.inner.units if u.shard_params])
        return list(self._host) + shards

    def swap_dir(self, nvme_path: str):
        """This rank's swap directory under `nvme_path` (one per path, shared by owners)."""
        if nvme_path not in self.swap_dirs:
            from meshspeed import comm
            from meshspeed.offload.swapdir import SwapDir

            rank = comm.get_rank() if comm.is_initialized() else 0
            self.swap_dirs[nvme_path] = SwapDir(nvme_path, rank)
        return self.swap_dirs[nvme_path]

    def nvme_bytes(self) -> dict[str, int]:
        return {} if self.shard_store is None else {"params": self.shard_store.nvme_bytes()}

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()
        close = getattr(self.shard_store, "close", None)
        if close is not None:
            close()
        for swapdir in self.swap_dirs.values():
            swapdir.close()
