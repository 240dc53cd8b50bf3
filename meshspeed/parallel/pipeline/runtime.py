"""Running one stage's schedule: activations forward, gradients back, between neighbours.

    losses = run_stage(stage_module, one_f_one_b(m, p, s), stage=s, stages=p, group=pp_group,
                       inputs=micro_inputs if s == 0 else None,
                       targets=micro_targets if s == p - 1 else None, loss_fn=loss_fn)

Each "F" takes its input (the micro-batch on the first stage, else a receive from the
previous stage), runs the stage, and sends the output on (the last stage computes the
loss instead, divided by the number of micro-batches as gradient accumulation does).
Each "B" takes the output gradient (a receive from the next stage, or the loss itself),
runs backward through the stage, and sends the input gradient back. Sends are
non-blocking and waited for at the end of the batch, so a stage never blocks on a
neighbour that is itself sending; receives block, in the order the schedules guarantee
(every schedule forwards and backwards micro-batches in increasing order on every stage).
Parameter gradients accumulate in `.grad` over the micro-batches, as in a one-process run.

Note [shapes once, checked every micro-batch]
Every activation is preceded by a small header (its shape and dtype: 80 bytes), so the
receiver allocates its buffer from the first one and both sides compare each later one
with the first. A stage whose output changes shape or dtype mid-batch raises
`PipelineShapeError` naming both shapes, and so does its receiver, which reads the new
header instead of waiting for bytes that would not fit (a hang, or a misread buffer).
Gradients have the shape of the activation they belong to.

Interleaved schedules (several chunks per stage) and the split backward of ZB-H1 are not
executed here yet: schedule.py plans them, this runs "F" and "B" of one chunk per stage.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import nn

from meshspeed import comm
from meshspeed.parallel.pipeline.schedule import BACKWARD, FORWARD, Action

_HEADER = 10  # int64 slots: dtype code, ndim, up to 8 dims
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32]


class PipelineShapeError(RuntimeError):
    """A stage's output changed shape or dtype within one batch."""


def _header(t: torch.Tensor) -> torch.Tensor:
    if t.dim() > _HEADER - 2 or t.dtype not in _DTYPES:
        raise PipelineShapeError(f"a pipeline activation must be a tensor of at most {_HEADER - 2} "
                                 f"dims in one of {_DTYPES}, got {tuple(t.shape)} {t.dtype}")
    h = torch.zeros(_HEADER, dtype=torch.int64)
    h[0], h[1] = _DTYPES.index(t.dtype), t.dim()
    h[2 : 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return h


def _from_header(h: torch.Tensor) -> tuple[torch.Size, torch.dtype]:
    ndim = int(h[1])
    return torch.Size(int(d) for d in h[2 : 2 + ndim]), _DTYPES[int(h[0])]


class _Link:
    """Point-to-point traffic of one stage with its neighbours in `group`."""

    def __init__(self, stage: int, group):
        self.stage, self.group = stage, group
        self.sent: tuple[torch.Size, torch.dtype] | None = None  # header sent downstream
        self.received: tuple[torch.Size, torch.dtype] | None = None  # header from upstream
        self.pending: list[tuple[object, torch.Tensor]] = []  # sends in flight, their buffers

    def send_activation(self, t: torch.Tensor, micro: int) -> None:
        t = t.detach().contiguous()
        self._send(_header(t), self.stage + 1)  # (the receiver checks it too)
        if self.sent is None:
            self.sent = (t.shape, t.dtype)
        elif (t.shape, t.dtype) != self.sent:
            raise PipelineShapeError(_changed(f"stage {self.stage}: micro-batch {micro}'s output", t.shape,
                                              t.dtype, self.sent))
        self._send(t, self.stage + 1)

    def recv_activation(self, micro: int) -> torch.Tensor:
        h = torch.empty(_HEADER, dtype=torch.int64)
        comm.recv(h, src=self.stage - 1, group=self.group)
        shape, dtype = _from_header(h)
        if self.received is None:
            self.received = (shape, dtype)
        elif (shape, dtype) != self.received:
            raise PipelineShapeError(_changed(f"stage {self.stage}: micro-batch {micro}'s input from stage "
                                              f"{self.stage - 1}", shape, dtype, self.received))
        t = torch.empty(shape, dtype=dtype)
        comm.recv(t, src=self.stage - 1, group=self.group)
        return t

    def send_grad(self, g: torch.Tensor) -> None:
        self._send(g.detach().contiguous(), self.stage - 1)

    def recv_grad(self, like: torch.Tensor) -> torch.Tensor:
        g = torch.empty_like(like)
        comm.recv(g, src=self.stage + 1, group=self.group)
        return g

    def _send(self, t: torch.Tensor, dst: int) -> None:
        self.pending.append((comm.isend(t, dst=dst, group=self.group), t))

    def drain(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


def _changed(what: str, shape, dtype, first) -> str:
    return (f"{what} is {tuple(shape)} {dtype}, the first micro-batch's was {tuple(first[0])} {first[1]}; "
            "every micro-batch of a batch must give the next stage the same shape (pad, or use "
            "equal micro-batches)")


def run_stage(module: nn.Module, actions: Sequence[Action], *, stage: int, stages: int, group,
              inputs: Sequence[torch.Tensor] | None = None, targets: Sequence[torch.Tensor] | None = None,
              loss_fn: Callable | None = None, loss_scale: float = 1.0, grad_pass=None,
              timeline: list | None = None, train: bool = True, outputs: list | None = None) -> list[float]:
    """Execute `actions` (one stage's schedule) for one batch; returns the last stage's
    per-micro-batch losses (undivided), an empty list elsewhere."""
    first, last = stage == 0, stage == stages - 1
    micro = sum(a.kind == FORWARD for a in actions)
    if first and (inputs is None or len(inputs) < micro):
        raise ValueError(f"the first stage needs {micro} micro-batch inputs, got "
                         f"{0 if inputs is None else len(inputs)}")
    if last and train and (loss_fn is None or targets is None):
        raise ValueError("the last pipeline stage needs loss_fn and the micro-batches' targets")
    link = _Link(stage, group)
    saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
    losses: list[float] = []
    try:
        grad_actions = [i for i, a in enumerate(actions) if a.kind != FORWARD]
        for i, a in enumerate(actions):
            ctx = contextlib.nullcontext() if a.kind == FORWARD or grad_pass is None else \
                grad_pass(a.kind, a.micro, a.chunk, i == grad_actions[-1])
            with ctx:
                _run_action(a, module, link, saved, losses, first=first, last=last, micro=micro,
                            inputs=inputs, targets=targets, loss_fn=loss_fn, scale=loss_scale,
                            train=train, outputs=outputs)
    finally:
        link.drain()  # what was sent arrives even when this stage fails (its peer then fails too)
    if saved:
        raise RuntimeError(f"stage {stage}: micro-batches {sorted(saved)} were forwarded and never "
                           "backwarded: the schedule is incomplete")
    return losses


def _run_action(a: Action, module, link: _Link, saved: dict, losses: list, *, first: bool, last: bool,
                micro: int, inputs, targets, loss_fn, scale: float, train: bool, outputs) -> None:
    if a.kind == FORWARD:
        x = inputs[a.micro] if first else link.recv_activation(a.micro).requires_grad_(train)
        y = module(x.clone() if train and not first else x)  # leaf x: ReLU(inplace=True) first
        if last:
            if outputs is not None:
                outputs.append(y.detach())
            if targets is None:
                return
            loss = loss_fn(y, targets[a.micro])
            losses.append(float(loss.detach()))
            y = loss * scale / micro
        else:
            link.send_activation(y, a.micro)
        if train:
            saved[a.micro] = (None if first else x, y)
    elif a.kind == BACKWARD:
        x, y = saved.pop(a.micro)
        if last:
            y.backward()
        else:
            y.backward(link.recv_grad(y))
        if not first:
            link.send_grad(x.grad)
    else:
        raise NotImplementedError(f"action {a}: the split backward (ZB-H1) is planned by "
                                  "schedule.py but not executed yet; use gpipe or 1f1b")
