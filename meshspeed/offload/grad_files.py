"""Reduced gradient shards in swap files, next to the fp32 masters (`offload_optimizer.device: "nvme"`).

Note [gradients in their NVMe slot]
(ZeRO-Infinity, Rajbhandari et al., SC 2021, Section 5: gradients, like every other model
state, stream to NVMe.) With the masters in files (Note [masters on NVMe] in masters.py),
the host gradient the host step reads was the largest state left in memory, held from
the boundary backward to the step. `GradFiles` writes each unit's reduced shard to
`unit<i>.grad` (laid out like `unit<i>.master`, in the file dtype of Note [16-bit
gradient files]) as its reduction lands (`land`, from `OffloadPlacement.grad_shard_ready`),
and frees it: the write overlaps the rest of backward, and no gradient is held whole
between the boundary and the step. The optimizer reads each sub-group's gradient runs into
one more swap buffer, next to its masters and moments (state.py), and `finish` turns them
into the fp32 values the step uses.

The engine's boundary (unscale, overflow check, clipping norm, clip) used to run on the
masters' `.grad` tensors all at once. With the gradients in files it runs on what `land`
recorded instead, and stays bit-identical to the in-memory path:
  - unscale: `land` multiplies each master's span, widened to fp32, by 1/`loss_scale` (the
    same fp32 multiply the engine's `unscale_and_check` does) before norming and checking
    it; `finish` repeats that multiply on what it reads back, with the scale of that landing;
  - overflow: `land` ORs the spans' inf/NaN check into `nonfinite`;
  - norm: `land` takes each master's `vector_norm` on the same flat fp32 span the
    in-memory path would, and `norms(masters)` stacks them in the engine's order, so
    `global_grad_norm` sums the same squares in the same order;
  - clip: the engine hands the coefficient to `clip_`; `finish` multiplies each
    sub-group's gradient buffer by it after the unscale (as the engine clips after it
    unscales), and so does `read` (safe_get_full_grad).
The masters' `.grad` is a placeholder meanwhile (a stride-0 view: it says "this master
has a gradient this step" to the optimizer; its values are in the file).

Note [16-bit gradient files]
A unit's file holds its reduced shard in the unit's own dtype: bf16 or fp16 when training
in 16 bits (2 bytes per owned parameter written at the boundary and read at the step, not
4), fp32 for fp32 units. Nothing is rounded on the way: the shard arrives in that dtype.
ZeRO keeps `grad_shard` in the parameters' dtype whatever the reduction ran in
(`FlatUnit._settle` adds the reduce-scatter's result, fp32 under `communication_data_type
fp32`, into a buffer of the parameters' dtype; qgZ's fp32 sums land there the same way; the
micro-steps accumulate there), and the in-memory path widens that same 16-bit shard with
`.float()` before it unscales. Under fp16 the file keeps the loss-scaled values: the 1/scale
multiply's result is generally not a 16-bit number (it can fall below fp16's range), so it
happens after the read, in fp32, exactly where the in-memory path does it. So the values
the step, the overflow check, the norms and safe_get_full_grad see are bit for bit those of
the fp32 files this replaced, and of the run that keeps gradients in memory.

Reading 2 bytes into a 4-byte buffer without a second buffer: the sub-group's 16-bit runs
are read into the top of its fp32 pool buffer (an aligned offset, so O_DIRECT still fits
where the runs do), and `_widen` converts them downwards in chunks, each chunk's fp32
output ending below the 16-bit elements not yet converted (Note [widening in place]).
Landing writes from a page-aligned copy of the shard, so the write is O_DIRECT too.
"""

from __future__ import annotations

import os

import torch

from meshspeed.offload.aio import IoRequest, SwapEngine
from meshspeed.offload.hostmem import ALIGN, host_empty, round_up
from meshspeed.optim.loss_scaler import has_inf_or_nan

_F32 = 4
_MIN_CHUNK = 1 << 16  # elements: `_widen` converts a shorter rest from a copy


def grad_placeholder(numel: int) -> torch.Tensor:
    """A gradient with a shape and no memory (its values are in a file)."""
    return torch.zeros(1).expand(numel) if numel else torch.zeros(0)


def file_dtype(unit) -> torch.dtype:
    """The dtype of `unit`'s gradient file: its own when 16-bit, else fp32 (Note [16-bit gradient files])."""
    return unit.dtype if unit.dtype in (torch.bfloat16, torch.float16) else torch.float32


# Note [widening in place]
# `narrow` (16-bit, n elements) lies at byte `h` of the fp32 buffer `wide`; element i of
# the result goes to bytes [4i, 4i + 4), element j of the source is at h + 2j. A chunk
# [a, a + c) may be converted once its output ends at or below the first source element
# not yet converted: 4(a + c) <= h + 2a, so c <= (h - 2a) / 4. The room halves with each
# chunk (about log2(n / _MIN_CHUNK) chunks); the last few elements are converted from a copy.
def _widen(wide: torch.Tensor, narrow: torch.Tensor, h: int, n: int) -> None:
    a = 0
    while a < n:
        c = min(n - a, (h - 2 * a) // 4)
        if c < min(_MIN_CHUNK, n - a):
            wide[a:n].copy_(narrow[a:n].clone())
            return
        wide[a : a + c].copy_(narrow[a : a + c])
        a += c


class GradFiles:
    """Gradient files of the units `masters` (a MasterFiles) keeps, same layout and runs."""

    tier = "nvme"

    def __init__(self, directory: str, engine: SwapEngine, masters, max_pending_bytes: int = 256 << 20):
        self.dir = directory
        self.engine = engine
        self.masters = masters
        self.loss_scale = 1.0  # the engine sets it before each boundary backward
        self._unit_index: dict[int, int] = {}
        self._pending: list[tuple[IoRequest, torch.Tensor]] = []
        self.max_pending_bytes = max_pending_bytes
        self._norm: dict[int, torch.Tensor] = {}  # id(master) -> its gradient's L2 norm
        self._scale: dict[int, float] = {}  # unit index -> the loss scale its file holds
        self.nonfinite = False
        self.landed: set[int] = set()  # unit indices whose gradient is in its file this step
        self.coef: torch.Tensor | None = None  # clipping coefficient for this step
        self._wide: torch.Tensor | None = None  # Note [landing without fresh pages]
        self._spares: list[torch.Tensor] = []  # aligned uint8 buffers whose writes are done

    def path(self, u: int) -> str:
        return os.path.join(self.dir, f"unit{u}.grad")

    def holds(self, unit) -> bool:
        return self._index(unit) is not None

    def has_landed(self, unit) -> bool:
        return self._index(unit) in self.landed

    def _index(self, unit) -> int | None:
        if id(unit) not in self._unit_index:
            for u, known in enumerate(self.masters.units):
                if known is unit:
                    self._unit_index[id(unit)] = u
                    break
            else:
                return None
        return self._unit_index[id(unit)]

    def _dtype(self, u: int) -> torch.dtype:
        return file_dtype(self.masters.units[u])

    # -- the boundary backward -------------------------------------------------------------------
    def land(self, unit) -> None:
        """The unit's reduced shard -> its file, as it is (loss-scaled under fp16); its
        unscaled fp32 values checked and normed on the way (Note [16-bit gradient files])."""
        u = self._index(unit)
        src = unit.grad_shard.detach()
        dtype = self._dtype(u)
        if src.dtype != dtype and dtype != torch.float32:
            raise RuntimeError(f"unit {u}'s reduced gradient arrived in {src.dtype}; its gradient "
                               f"file holds {dtype}, the unit's dtype, and would round it")
        for s, m in zip(unit.spans, unit.masters):
            if not m.requires_grad:
                continue
            # the in-memory path's values: the shard widened to fp32, then unscaled (one
            # master's span in fp32 at a time, in the reused `_wide`)
            view = self._widened(src[s.offset : s.offset + s.numel])
            if self.loss_scale != 1.0:
                torch._foreach_mul_([view], 1.0 / self.loss_scale)
            norm = torch.linalg.vector_norm(view)
            self._norm[id(m)] = norm
            # a finite norm has no inf or NaN under it (either would make it inf or NaN);
            # only a norm that is not finite needs the element-wise check
            if not self.nonfinite and not bool(torch.isfinite(norm)):
                self.nonfinite = has_inf_or_nan([view])
        self._scale[u] = self.loss_scale
        # a page-aligned copy (from an accelerator: the host copy), padded to whole blocks,
        # so that the write can go O_DIRECT; the unit's own buffer is freed or reused
        n = src.numel()
        grad = self._write_copy(round_up(n * dtype.itemsize), dtype)
        grad[:n].copy_(src)
        grad[n:].zero_()
        self._pending.append((self.engine.write(grad, self.path(u)), grad))
        self.landed.add(u)
        # Note [bounded writes in flight] in masters.py: a finished write frees its copy;
        # past max_pending_bytes the oldest is waited for
        while self._pending and (self._pending[0][0].done() or
                                 sum(t.nbytes for _, t in self._pending) > self.max_pending_bytes):
            request, copy = self._pending.pop(0)
            request.wait()
            self._keep_spare(copy)

    # Note [landing without fresh pages]
    # Every tensor `land` makes is written once and dropped: a span widened to fp32 (for the
    # norm and the overflow check) and the aligned copy the O_DIRECT write reads. Buffers of
    # this size come from fresh mmap'd pages, and the kernel's first touch of each page costs
    # more than the copy into it: on the CI machine, 200 MB copied into a new buffer took
    # 0.12-0.24 s, into a used one 0.013 s. At 2B that was about 12 GB of fresh pages a step
    # on the backward's own thread. So the widened span goes into `_wide`, one fp32 buffer the
    # size of the largest span, kept for the run; and a write's copy, once the write is done,
    # is kept as a spare for the next landing while the pending writes and the spares stay
    # within `max_pending_bytes`, the bound the copies in flight already had.
    def _widened(self, span: torch.Tensor) -> torch.Tensor:
        """`span`'s values in fp32 on the host, in `_wide` (valid until the next call)."""
        n = span.numel()
        if self._wide is None or self._wide.numel() < n:
            self._wide = None  # the smaller one goes first
            self._wide = torch.empty(n, dtype=torch.float32)
        return self._wide[:n].copy_(span)

    def _write_copy(self, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """A page-aligned host buffer of `nbytes` (a multiple of the block size) as `dtype`:
        a spare of that size (the blocks of a model have one size), else a new one."""
        for i, raw in enumerate(self._spares):
            if raw.nbytes == nbytes:
                return self._spares.pop(i).view(dtype)
        return host_empty(nbytes, torch.uint8, align=ALIGN).view(dtype)

    def _keep_spare(self, copy: torch.Tensor) -> None:
        """A finished write's copy: kept while the pending copies and the spares are within
        `max_pending_bytes` (so they stay within it plus one copy, as the pending copies alone
        could be), else freed."""
        held = sum(t.nbytes for _, t in self._pending) + sum(t.nbytes for t in self._spares)
        if held <= self.max_pending_bytes:
            self._spares.append(copy.view(torch.uint8))

    def wait(self) -> None:
        """Every landed gradient is in its file (before anything reads them back)."""
        while self._pending:
            request, copy = self._pending.pop(0)
            request.wait()
            self._keep_spare(copy)

    # -- the engine's boundary ---------------------------------------------------------------------
    def holds_grad(self, master) -> bool:
        """True when `master`'s gradient this step is in a file (its .grad a placeholder)."""
        return id(master) in self._norm

    def norms(self, masters) -> torch.Tensor:
        """Per-master gradient norms, in the order of `masters` (those with a gradient);
        the gradients of masters kept in memory are normed where they are."""
        if not masters:
            return torch.zeros(0)
        return torch.stack([self._norm[id(m)] if id(m) in self._norm
                            else torch.linalg.vector_norm(m.grad.float()) for m in masters])

    def clip_(self, coef: torch.Tensor) -> None:
        self.coef = coef.detach().to("cpu", torch.float32)

    def reset(self) -> None:
        """After the step: nothing of this step's gradients is pending."""
        self.wait()
        self._norm.clear()
        self._scale.clear()
        self.nonfinite = False
        self.landed.clear()
        self.coef = None

    # -- reading back ---------------------------------------------------------------------------
    def _staging(self, buf: torch.Tensor, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        """The 16-bit area at the top of the fp32 buffer `buf` where `numel` elements are read
        (Note [widening in place]), and its byte offset (page-aligned)."""
        h = (buf.nbytes - numel * dtype.itemsize) // ALIGN * ALIGN
        return buf.view(torch.uint8)[h : h + numel * dtype.itemsize].view(dtype), h

    def _split(self, runs) -> tuple[list, list, torch.dtype | None]:
        wide = [r for r in runs if self._dtype(r[0]) == torch.float32]
        narrow = [r for r in runs if self._dtype(r[0]) != torch.float32]
        dtypes = {self._dtype(r[0]) for r in narrow}
        if len(dtypes) > 1:
            raise RuntimeError(f"a sub-group's gradient files mix {sorted(map(str, dtypes))}; "
                               "cast the model to one 16-bit dtype before initialize")
        return wide, narrow, next(iter(dtypes), None)

    def read_runs(self, runs, buf: torch.Tensor) -> list[IoRequest]:
        """Start reading a sub-group's gradient runs for the fp32 pool buffer `buf` (16-bit
        ones into its top); `finish` makes `buf` their fp32 values once these are done."""
        wide, narrow, dtype = self._split(runs)
        if not narrow:
            return [self.engine.read(buf[b : b + n], self.path(u), f * _F32) for u, f, b, n in wide]
        numel = max(b + n for _, _, b, n in narrow)
        stage, _ = self._staging(buf, numel, dtype)
        # (fp32 runs next to 16-bit ones are read by `finish`, after the widening)
        return [self.engine.read(stage[b : b + n], self.path(u), f * dtype.itemsize)
                for u, f, b, n in narrow]

    def finish(self, runs, buf: torch.Tensor) -> None:
        """After `read_runs`: widen, unscale and clip, as the in-memory path does (Note
        [16-bit gradient files]); `buf` then holds the step's fp32 gradients."""
        wide, narrow, dtype = self._split(runs)
        if narrow:
            numel = max(b + n for _, _, b, n in narrow)
            stage, h = self._staging(buf, numel, dtype)
            _widen(buf, stage, h, numel)
            for u, f, b, n in wide:
                self.engine.read(buf[b : b + n], self.path(u), f * _F32).wait()
        for u, _, b, n in runs:
            scale = self._scale.get(u, 1.0)
            if scale != 1.0:
                torch._foreach_mul_([buf[b : b + n]], 1.0 / scale)
        if self.coef is not None and runs:
            buf[: max(b + n for _, _, b, n in runs)].mul_(self.coef)  # the engine's clipping

    def read(self, unit, offset: int, numel: int) -> torch.Tensor:
        """One range of a landed unit's gradient (safe_get_full_grad), as the step will see it."""
        self.wait()
        u = self._index(unit)
        raw = torch.empty(numel, dtype=self._dtype(u))
        if numel:
            self.engine.read(raw, self.path(u), offset * raw.element_size()).wait()
        out = raw.to(torch.float32, copy=True)
        if self._scale.get(u, 1.0) != 1.0:
            torch._foreach_mul_([out], 1.0 / self._scale[u])
        if self.coef is not None:
            out.mul_(self.coef)
        return out

    # -- accounting --------------------------------------------------------------------------------
    def host_tensors(self) -> list[torch.Tensor]:
        """The copies of writes in flight (gradients: memory_breakdown's "grads")."""
        return [t for _, t in self._pending]

    def staging_tensors(self) -> list[torch.Tensor]:
        """The reused buffers of Note [landing without fresh pages]: no gradient is held in
        them between landings (memory_breakdown's "comm_buffers")."""
        return self._spares + ([] if self._wide is None else [self._wide])

    def nvme_bytes(self) -> int:
        return sum(os.path.getsize(self.path(u)) for u in range(len(self.masters.units))
                   if os.path.exists(self.path(u)))

    def close(self) -> None:
        self.wait()
        self._spares, self._wide = [], None
        self.engine.close()
