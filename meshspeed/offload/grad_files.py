"""Reduced gradient shards in swap files, next to the fp32 masters (`offload_optimizer.device: "nvme"`).

Note [gradients in their NVMe slot]
(ZeRO-Infinity, Rajbhandari et al., SC 2021, Section 5: gradients, like every other model
state, stream to NVMe.) With the masters in files (Note [masters on NVMe] in masters.py),
the fp32 host gradient the host step reads was the largest state left in memory: 4 bytes
per owned parameter, held from the boundary backward to the step. `GradFiles` writes each
unit's reduced shard to `unit<i>.grad` (fp32, laid out like `unit<i>.master`) as its
reduction lands (`land`, from `OffloadPlacement.grad_shard_ready`), and frees it: the
write overlaps the rest of backward, and no gradient is held whole between the boundary
and the step. The optimizer reads each sub-group's gradient runs into one more swap
buffer, next to its masters and moments (state.py).

The engine's boundary (unscale, overflow check, clipping norm, clip) used to run on the
masters' `.grad` tensors all at once. With the gradients in files it runs on what `land`
recorded instead, and stays bit-identical to the in-memory path:
  - unscale: `land` multiplies each master's span by 1/`loss_scale` (the same fp32
    multiply the engine's `unscale_and_check` does), before anything else reads it;
  - overflow: `land` ORs the spans' inf/NaN check into `nonfinite`;
  - norm: `land` takes each master's `vector_norm` on the same flat fp32 span the
    in-memory path would, and `norms(masters)` stacks them in the engine's order, so
    `global_grad_norm` sums the same squares in the same order;
  - clip: the engine hands the coefficient to `clip_`; the optimizer multiplies each
    sub-group's gradient buffer by it after the read (state.py `SwapStore.acquire`).
The masters' `.grad` is a placeholder meanwhile (a stride-0 view: it says "this master
has a gradient this step" to the optimizer; its values are in the file).
"""

from __future__ import annotations

import os

import torch

from meshspeed.offload.aio import IoRequest, SwapEngine
from meshspeed.optim.loss_scaler import has_inf_or_nan

_F32 = 4


def grad_placeholder(numel: int) -> torch.Tensor:
    """A gradient with a shape and no memory (its values are in a file)."""
    return torch.zeros(1).expand(numel) if numel else torch.zeros(0)


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
        self.nonfinite = False
        self.landed: set[int] = set()  # unit indices whose gradient is in its file this step
        self.coef: torch.Tensor | None = None  # clipping coefficient for this step

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

    # -- the boundary backward -------------------------------------------------------------------
    def land(self, unit) -> None:
        """The unit's reduced shard -> its file; unscaled, checked and normed on the way."""
        u = self._index(unit)
        src = unit.grad_shard
        if src.device.type != "cpu":  # an accelerator's shard: the file is written from host memory
            grad = src.detach().to("cpu", torch.float32)
        else:
            grad = src.float()  # a new fp32 tensor for 16-bit training
            if grad.data_ptr() == src.data_ptr():
                grad = grad.clone()  # fp32 training: the unit's buffer is reused next step
        views = [grad[s.offset : s.offset + s.numel] for s, m in zip(unit.spans, unit.masters)
                 if m.requires_grad]
        if self.loss_scale != 1.0 and views:
            torch._foreach_mul_(views, 1.0 / self.loss_scale)
        for s, m in zip(unit.spans, unit.masters):
            if m.requires_grad:
                self._norm[id(m)] = torch.linalg.vector_norm(grad[s.offset : s.offset + s.numel])
        self.nonfinite = self.nonfinite or has_inf_or_nan(views)
        self._pending.append((self.engine.write(grad, self.path(u)), grad))
        self.landed.add(u)
        # Note [bounded writes in flight] in masters.py: a finished write frees its fp32
        # copy; past max_pending_bytes the oldest is waited for
        while self._pending and (self._pending[0][0].done() or
                                 sum(t.nbytes for _, t in self._pending) > self.max_pending_bytes):
            self._pending.pop(0)[0].wait()

    def wait(self) -> None:
        """Every landed gradient is in its file (before anything reads them back)."""
        for request, _ in self._pending:
            request.wait()
        self._pending.clear()

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
        self.nonfinite = False
        self.landed.clear()
        self.coef = None

    # -- reading back ---------------------------------------------------------------------------
    def read_runs(self, runs, buf: torch.Tensor) -> list[IoRequest]:
        return [self.engine.read(buf[b : b + n], self.path(u), f * _F32) for u, f, b, n in runs]

    def read(self, unit, offset: int, numel: int) -> torch.Tensor:
        """One range of a landed unit's gradient (safe_get_full_grad), as the step will see it."""
        self.wait()
        out = torch.empty(numel, dtype=torch.float32)
        if numel:
            self.engine.read(out, self.path(self._index(unit)), offset * _F32).wait()
        if self.coef is not None:
            out.mul_(self.coef)
        return out

    # -- accounting --------------------------------------------------------------------------------
    def host_tensors(self) -> list[torch.Tensor]:
        return [t for _, t in self._pending]

    def nvme_bytes(self) -> int:
        return sum(os.path.getsize(self.path(u)) for u in range(len(self.masters.units))
                   if os.path.exists(self.path(u)))

    def close(self) -> None:
        self.wait()
        self.engine.close()
