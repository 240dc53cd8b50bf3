"""One unit of ZeRO-3 communication: the parameters one all-gather materialises together.

(Stages 1 and 2, and stage 3's persistent small parameters, use `FlatUnit` in flat.py.)
A unit owns, for this rank, the slices described by its `UnitLayout` (see
Note [per-parameter sharding] in layout.py) and performs the three collectives of ZeRO on
them as free-standing steps:

- `launch_reduce_scatter`: full gradients -> this rank's gradient shard (averaged);
- `all_gather_into_params`: this rank's updated shard -> every rank's full parameters;
- `gather` / `release`: materialise and drop the full parameters.

Lifecycles are explicit (`ParamState`), and every transition checks where it starts from:
gathering a whole unit, releasing a sharded one or one whose module is running, and a
second reduce-scatter in one backward raise `LifecycleError`.
"""

from __future__ import annotations

import enum

import torch
from torch import nn

from meshspeed import comm
from meshspeed.parallel.zero.groups import UnitGroups
from meshspeed.parallel.zero.init import is_partitioned, take_shard
from meshspeed.parallel.zero.layout import ParamLayout, UnitLayout
from meshspeed.parallel.zero.lifecycle import LifecycleError, Span


class ParamState(enum.Enum):
    WHOLE = "whole"  # full parameters resident (gathered)
    GATHERING = "gathering"  # an all-gather is in flight (prefetch); `gather()` completes it
    SHARDED = "sharded"  # only this rank's shard resident; params hold empty placeholders


def _rows(flat_numel: int, chunk: int) -> tuple[int, int]:
    """Split a flat tensor of flat_numel into full rows of `chunk` and a remainder."""
    full = flat_numel // chunk
    return full, flat_numel - full * chunk


def scatter_into_matrix(matrix: torch.Tensor, layout: ParamLayout, flat: torch.Tensor) -> None:
    """Write a parameter-shaped flat tensor into its column block of an (N, shard) matrix.

    Padding cells are left as they are (the caller zero-initialises the matrix)."""
    block = matrix[:, layout.offset : layout.offset + layout.chunk]
    full, rem = _rows(layout.numel, layout.chunk)
    if full:
        block[:full].copy_(flat[: full * layout.chunk].view(full, layout.chunk))
    if rem:
        block[full, :rem].copy_(flat[full * layout.chunk :])


def gather_from_matrix(matrix: torch.Tensor, layout: ParamLayout, flat: torch.Tensor) -> None:
    """Inverse of `scatter_into_matrix`: fill a flat parameter from its column block."""
    block = matrix[:, layout.offset : layout.offset + layout.chunk]
    full, rem = _rows(layout.numel, layout.chunk)
    if full:
        flat[: full * layout.chunk].view(full, layout.chunk).copy_(block[:full])
    if rem:
        flat[full * layout.chunk :].copy_(block[full, :rem])


class ZeroUnit:
    """Parameters of one stage-3 unit and this rank's slices of them.

    Only the compute-dtype shard is resident between uses. `masters[i]` is the tensor the
    optimizer updates for `params[i]`: this rank's valid slice (`spans[i]`), fp32, either a
    view of the shard itself (fp32 training, nothing duplicated) or of a separate fp32
    master buffer (bf16/fp16 training, or placed elsewhere by offload).
    """

    shard_params = True

    def __init__(self, name: str, params: list[tuple[str, nn.Parameter]], groups: UnitGroups, *,
                 comm_dtype: torch.dtype = torch.float32):
        self.name = name
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.groups = groups
        self.world = comm.get_world_size(groups.shard)
        self.rank = comm.get_rank(groups.shard)
        self.layout = UnitLayout.build([(n, tuple(p.shape)) for n, p in params], self.world)
        self.shard_numel = self.layout.shard_numel
        self.shapes = [lay.shape for lay in self.layout.params]
        self.spans = [Span(min(self.rank * lay.chunk, lay.numel), lay.valid(self.rank), lay.offset)
                      for lay in self.layout.params]
        self.comm_dtype = comm_dtype
        self.dtype = self.params[0].dtype if self.params else torch.float32
        self.device = self.params[0].device if self.params else torch.device("cpu")
        # Where the shard lives between uses when not in `self.shard` (host memory or a swap
        # file), set by the offload placement through `use_store`: fetch(unit) -> shard on
        # the device, done(unit) after the all-gather, write(unit, values). None: `self.shard`.
        self.shard_store = None
        self._own_storage()
        self.shard = self._local_shard()  # compute-dtype shard, (shard_numel,)
        # the full-size tensors whose storage the unit frees and refills
        self.full = [p.data for p in self.params]
        self._placeholder = torch.empty(0, dtype=self.dtype, device=self.device)
        self.masters = self._make_masters()
        self.grad_shard: torch.Tensor | None = None  # (shard_numel,), owned slices only
        self.state = ParamState.WHOLE
        self.in_use = 0  # forwards of the unit's module running now (hooks count them)
        self._pending = None  # (work, matrix) of an in-flight all-gather
        self._reducing = False
        self.release()

    def use_store(self, store) -> None:
        self.shard_store = store

    # -- construction -------------------------------------------------------------------
    def _local_shard(self) -> torch.Tensor:
        shard = torch.zeros(self.layout.shard_numel, dtype=self.dtype, device=self.device)
        for lay, p in zip(self.layout.params, self.params):
            if is_partitioned(p):
                shard[lay.offset : lay.offset + lay.chunk].copy_(take_shard(p))
                continue
            start, n = self.rank * lay.chunk, lay.valid(self.rank)
            shard[lay.offset : lay.offset + n].copy_(p.detach().reshape(-1)[start : start + n])
        return shard

    def _make_masters(self) -> list[nn.Parameter]:
        """fp32 tensors the optimizer steps on, one per trainable parameter."""
        if self.dtype == torch.float32:
            source, self.master_buffer = self.shard, None
        else:
            source = self.master_buffer = self.shard.float()
        return [nn.Parameter(source[s.offset : s.offset + s.numel], requires_grad=p.requires_grad)
                for s, p in zip(self.spans, self.params)]

    # -- lifecycle ----------------------------------------------------------------
    # Note [freeing storage, not swapping tensors]
    # A released parameter keeps its identity; its full-size tensor (kept in `self.full`)
    # has its storage resized to zero bytes, and the parameter itself points at an empty
    # placeholder, as in DeepSpeed (numel 0 outside a gather: touching it is an ordinary
    # size error, never a read of freed memory). `gather` resizes the same storage back,
    # fills it and points the parameter at it again. Autograd may have saved views of the
    # parameter in forward (e.g. `weight.t()` inside linear); they share that storage, so
    # they see the re-gathered values in backward and keep no stale copy alive in between.
    def _own_storage(self) -> None:
        for p in self.params:
            if is_partitioned(p):
                continue  # built by zero.Init: its slice is waiting in the registry
            storage = p.untyped_storage()
            if p.storage_offset() != 0 or storage.nbytes() != p.numel() * p.element_size():
                p.data = p.detach().clone()
            elif not p.is_contiguous():
                p.data = p.detach().contiguous()

    def gather(self) -> None:
        """Materialise full parameters from every rank's shard."""
        if self.state is ParamState.WHOLE:
            raise LifecycleError(f"unit {self.name}: gathered twice (it is already whole)")
        if self.state is ParamState.SHARDED:
            self.gather_async()
        if self.state is ParamState.GATHERING:
            self._finish_gather()

    def gather_async(self) -> None:
        """Launch the all-gather (prefetch); the copy into the parameters waits for gather()."""
        if self.state is not ParamState.SHARDED:
            return
        shard = self.shard if self.shard_store is None else self.shard_store.fetch(self)
        self._pending = self._all_gather(shard, async_op=True)
        self.state = ParamState.GATHERING

    def _finish_gather(self) -> None:
        work, matrix = self._pending
        work.wait()
        self._pending = None
        if self.shard_store is not None:
            self.shard_store.done(self)
        for lay, p, full in zip(self.layout.params, self.params, self.full):
            full.untyped_storage().resize_(lay.numel * full.element_size())
            # `full` is not the parameter, so autograd's version counter of the parameter
            # does not move: refilling is not an in-place edit of a tensor saved for backward
            gather_from_matrix(matrix, lay, full.view(-1))
            p.data = full
        self.state = ParamState.WHOLE

    def release(self) -> None:
        """Drop full parameters, keeping only this rank's shard."""
        if self.state is ParamState.SHARDED:
            raise LifecycleError(f"unit {self.name}: released twice (it is already sharded)")
        if self.in_use:
            raise LifecycleError(f"unit {self.name}: released while its module's forward is running")
        if self.state is ParamState.GATHERING:  # prefetched but not used: let it land first
            self._pending[0].wait()
            self._pending = None
            if self.shard_store is not None:
                self.shard_store.done(self)
        for p, full in zip(self.params, self.full):
            full.untyped_storage().resize_(0)
            p.data = self._placeholder
        self.state = ParamState.SHARDED

    def gathered_bytes(self) -> int:
        """Bytes of full parameters resident or arriving (an in-flight prefetch buffer)."""
        if self.state is ParamState.SHARDED:
            return 0
        if self.state is ParamState.GATHERING:
            return self._pending[1].untyped_storage().nbytes()
        return sum(p.untyped_storage().nbytes() for p in self.params)

    # -- collectives ----------------------------------------------------------------------
    def _matrix(self, dtype: torch.dtype) -> torch.Tensor:
        """The (N, shard_numel) buffer a collective of this unit sends or receives,
        allocated per use, so only the units actually gathered hold one."""
        return torch.empty(self.world, self.layout.shard_numel, dtype=dtype, device=self.device)

    def _all_gather(self, shard: torch.Tensor, async_op: bool = False):
        out = self._matrix(shard.dtype)
        work = comm.all_gather_into_tensor(out.view(-1), shard, group=self.groups.shard, async_op=async_op)
        return (work, out) if async_op else out

    def launch_reduce_scatter(self):
        """Start reducing the parameters' full gradients, and free them; returns a callable
        that waits and yields this rank's shard, averaged over the group.

        The reduction runs in `comm_dtype` (fp32 unless configured otherwise); the shard
        is kept in the parameters' dtype, so bf16 training holds 2 bytes per owned
        gradient element, as in the paper's accounting. Missing gradients (unused or
        frozen parameters) contribute zeros."""
        if self._reducing:
            raise LifecycleError(f"unit {self.name}: reduce-scatter launched twice in one backward")
        self._reducing = True
        matrix = self._matrix(self.comm_dtype)
        for lay, p in zip(self.layout.params, self.params):
            g, p.grad = p.grad, None  # copied into the send buffer: free the full gradient
            if g is None:
                matrix[:, lay.offset : lay.offset + lay.chunk].zero_()
                continue
            if lay.padding:  # rows from the first partial one on hold padding cells
                matrix[lay.numel // lay.chunk :, lay.offset : lay.offset + lay.chunk].zero_()
            scatter_into_matrix(matrix, lay, g.detach().reshape(-1))
        out = torch.empty(self.layout.shard_numel, dtype=self.comm_dtype, device=self.device)
        work = comm.reduce_scatter_tensor(out, matrix.view(-1), group=self.groups.shard, async_op=True)

        def finish() -> torch.Tensor:
            work.wait()
            del matrix_ref[:]
            if self.groups.replicate is not None:
                comm.all_reduce(out, group=self.groups.replicate)
            self._reducing = False
            return out.div_(self.groups.size).to(self.dtype)

        matrix_ref = [matrix]  # the send buffer lives until the reduction is done
        return finish

    def accumulate_grad_shard(self, shard: torch.Tensor) -> None:
        if self.grad_shard is None:
            self.grad_shard = shard
        else:
            self.grad_shard.add_(shard)

    def attach_master_grads(self) -> None:
        """Point each master's .grad at its slice of the reduced gradient shard (fp32)."""
        if self.grad_shard is None:
            return
        grads = self.grad_shard.float()  # a temporary only when training in bf16/fp16
        for s, m in zip(self.spans, self.masters):
            if m.requires_grad:
                m.grad = grads[s.offset : s.offset + s.numel]

    def drop_grads(self) -> None:
        self.grad_shard = None
        for m in self.masters:
            m.grad = None

    def refresh_from_params(self) -> None:
        """Whole parameters were changed from outside (GatheredParameters with a modifier):
        rebuild this rank's shard and fp32 master slices from them."""
        fresh = self._local_shard()
        self._write_shard(fresh)
        if self.master_buffer is not None:
            self.master_buffer.copy_(fresh)

    def _write_shard(self, values: torch.Tensor) -> None:
        if self.shard_store is None:
            self.shard.copy_(values)
        else:
            self.shard_store.write(self, values)

    def publish_masters(self) -> None:
        """After the optimizer step: updated fp32 masters -> the compute-dtype shard (which
        the next gather reads); a unit still whole would now be stale, so it is released."""
        if self.master_buffer is not None:
            self._write_shard(self.master_buffer)
        if self.state is not ParamState.SHARDED:
            self.release()

    # -- accounting -------------------------------------------------------------------------
    def param_tensors(self) -> list[torch.Tensor]:
        return [self.shard]

    def grad_tensors(self) -> list[torch.Tensor]:
        out = [] if self.grad_shard is None else [self.grad_shard]
        return out + [p.grad for p in self.params if p.grad is not None]
