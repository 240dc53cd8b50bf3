"""Running one stage's schedule for one batch: every schedule of schedule.py, any chunks.

    losses = run_stage(chunks, build("zb-h1", m, p)[s], stage=s, stages=p, group=pp_group,
                       inputs=micro_inputs if s == 0 else None,
                       targets=micro_targets if s == p - 1 else None, loss_fn=loss_fn)

`chunks` is this stage's model (one module) or its v chunks (a list, for the interleaved
schedule): chunk c is virtual stage c * p + s (Note [virtual stages and their neighbours]
in p2p.py). The actions run in order:
  "F"  takes the chunk's input (the micro-batch on virtual stage 0, else a receive from
       the previous virtual stage), runs the chunk, and sends the output on; the last
       virtual stage computes the loss instead.
  "B"  takes the output gradient (a receive from the next virtual stage; on the last, the
       loss * loss_scale / micro-batches), runs the whole backward of the chunk, and
       sends the input gradient back.
  "I"  the same, but Linear weights only queue their gradient (weight_grad.py); their
  "W"  computes and accumulates those weight gradients, later. An I followed at once by
       its own W runs as one "B" (Note [an I right before its W is a B] in schedule.py).
Parameter gradients accumulate in `.grad` over the micro-batches, as in a one-process
run. Stage 0's inputs and the activations between stages are tensors or tuples of
tensors; each chunk is called with one argument, the tensor or the tuple, as DeepSpeed's
PipelineModule calls its layers.

Note [blocking receives cannot deadlock]
Sends are non-blocking isends, waited for at the end of the batch (also when this stage
fails, so what was sent arrives and the peer fails on its own terms); receives block.
An action then waits only for what its dependencies in `schedule.simulate` produce: a
forward for the previous virtual stage's forward of its micro-batch, a backward or input
half for the next virtual stage's backward or input half, a weight half for nothing (its
input half ran on this stage before it). Every message has its own tag (Note [one tag
per message] in p2p.py), so a receive cannot be satisfied by another message, and a
schedule that `simulate` runs without deadlock runs here without one too.

Note [what a span measures]
`timeline` gets one Span per executed action. It starts when the action's inputs have
arrived (its blocking receives are outside it) and ends when its outputs are handed to
isend, so the time a stage waits for a neighbour counts as idle, as in `simulate`, and
`timeline.bubble_fraction` of the spans is the measured counterpart of simulate's figure.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from meshspeed.parallel.pipeline.p2p import Link, PipelineShapeError, flatten, floating
from meshspeed.parallel.pipeline.schedule import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    WEIGHT_GRAD,
    Action,
    fuse_adjacent_halves,
)
from meshspeed.parallel.pipeline.timeline import Span
from meshspeed.parallel.pipeline.weight_grad import DeferredWeights

__all__ = ["PipelineShapeError", "run_stage"]

GradPass = Callable[[str, int, int, bool], contextlib.AbstractContextManager]


def run_stage(modules: nn.Module | Sequence[nn.Module], actions: Sequence[Action], *, stage: int,
              stages: int, group, inputs: Sequence | None = None, targets: Sequence | None = None,
              loss_fn: Callable | None = None, loss_scale: float = 1.0, train: bool = True,
              outputs: list | None = None, grad_pass: GradPass | None = None,
              timeline: list[Span] | None = None, compression: str = "none") -> list[float]:
    """Execute `actions` (one stage's schedule) for one batch; returns the last stage's
    per-micro-batch losses (unscaled, undivided, in micro-batch order), [] elsewhere.

    modules:    this stage's model, or its chunks (a list): chunk c is virtual stage
                c * stages + stage, and actions name it by c.
    inputs:     on stage 0, the micro-batches (tensors or tuples of tensors), by index.
    targets:    on the last stage, what loss_fn(output, target) takes, by micro-batch.
    loss_scale: the last stage backpropagates loss * loss_scale / micro-batches (fp16).
    train:      False runs only the "F" actions, under torch.no_grad(), keeping nothing
                for a backward; the last stage still computes losses when it has
                targets and loss_fn.
    outputs:    when given, the last stage appends each micro-batch's output (detached).
    grad_pass:  `grad_pass(kind, micro, chunk, last)` gives a context manager that each
                action that accumulates parameter gradients ("B", "I", "W") runs in;
                `last` is True for this stage's final one of the batch.
    timeline:   when given, gets one Span per executed action (Note [what a span measures]).
    compression: how activations and their gradients travel between stages, "none",
                "bf16" or "int8" (Note [compressed activations between stages] in
                compress.py); the same on every stage.
    """
    chunks = list(modules) if isinstance(modules, (list, tuple, nn.ModuleList)) else [modules]
    if not train:
        actions = [a for a in actions if a.kind == FORWARD]
    actions = fuse_adjacent_halves(actions)  # Note [an I right before its W is a B] in schedule.py
    _check(actions, chunks, stage, stages)
    device = next((p.device for c in chunks for p in c.parameters()), None)
    runner = _Runner(chunks, Link(stage, stages, len(chunks), group, device, compression), stage=stage, stages=stages,
                     actions=actions, train=train, loss_scale=loss_scale, loss_fn=loss_fn,
                     inputs=inputs, targets=targets, want_outputs=outputs is not None,
                     grad_pass=grad_pass, timeline=timeline)
    passes = [i for i, a in enumerate(actions) if a.kind != FORWARD]
    try:
        with torch.set_grad_enabled(train):
            for i, a in enumerate(actions):
                runner.run(a, last=bool(passes) and i == passes[-1])
    finally:
        runner.link.drain()  # Note [blocking receives cannot deadlock]
    runner.check_complete()
    if outputs is not None:
        outputs.extend(runner.outputs[m] for m in sorted(runner.outputs))
    return [runner.losses[m] for m in sorted(runner.losses)]


def _check(actions: Sequence[Action], chunks: list, stage: int, stages: int) -> None:
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is not one of the {stages} stages 0..{stages - 1}")
    seen: set[tuple[str, int, int]] = set()
    for a in actions:
        if a.kind not in (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD):
            raise ValueError(f"action {a}: kind {a.kind!r} is not one of F, B, I, W")
        if not 0 <= a.chunk < len(chunks):
            raise ValueError(f"action {a} is for chunk {a.chunk}, but stage {stage} was given "
                             f"{len(chunks)} module(s) (chunks 0..{len(chunks) - 1})")
        key = (a.kind, a.micro, a.chunk)
        if key in seen:
            raise ValueError(f"stage {stage}: action {a} appears twice in the schedule")
        seen.add(key)
    both = {(m, c) for k, m, c in seen if k == BACKWARD} & {(m, c) for k, m, c in seen if k == INPUT_GRAD}
    if both:
        raise ValueError(f"stage {stage}: micro-batch {min(both)[0]} of chunk {min(both)[1]} has both a "
                         "whole backward B and an input half I; a schedule gives it one of the two")


@dataclass
class _Saved:
    """What a micro-batch's forward on a chunk leaves for its backward."""

    inputs: list[torch.Tensor]  # the chunk's floating inputs as received (leaves), [] on stage 0
    roots: list[torch.Tensor]  # where backward starts: the scaled loss, or the floating outputs
    deferred: DeferredWeights | None  # its split backward's weight half, for "I"/"W"


class _Runner:
    """One run_stage call's state: what each action needs from the earlier ones."""

    def __init__(self, chunks, link: Link, *, stage, stages, actions, train, loss_scale, loss_fn,
                 inputs, targets, want_outputs, grad_pass, timeline):
        self.chunks, self.link, self.stage, self.train = chunks, link, stage, train
        self.loss_scale, self.loss_fn, self.inputs, self.targets = loss_scale, loss_fn, inputs, targets
        self.want_outputs, self.timeline = want_outputs, timeline
        self.grad_pass = grad_pass or (lambda kind, micro, chunk, last: contextlib.nullcontext())
        self.first = (stage, 0) if stage == 0 else None  # (stage, chunk) of virtual stage 0
        self.last = (stage, len(chunks) - 1) if stage == stages - 1 else None
        forwards = [a for a in actions if a.kind == FORWARD]
        self.micro_batches = len({a.micro for a in forwards})
        self.split = {(a.micro, a.chunk) for a in actions if a.kind == INPUT_GRAD}
        self.saved: dict[tuple[int, int], _Saved] = {}
        self.weights: dict[tuple[int, int], DeferredWeights] = {}  # after "I", before "W"
        self.losses: dict[int, float] = {}
        self.outputs: dict[int, object] = {}
        self._check_data(forwards)

    def _check_data(self, forwards: list[Action]) -> None:
        need = 1 + max((a.micro for a in forwards), default=-1)
        if self.first and need and (self.inputs is None or len(self.inputs) < need):
            raise ValueError(f"the first stage needs {need} micro-batch inputs, got "
                             f"{0 if self.inputs is None else len(self.inputs)}")
        has_loss = self.loss_fn is not None and self.targets is not None
        if self.last and self.train and not has_loss:
            raise ValueError("the last pipeline stage needs loss_fn and the micro-batches' targets "
                             "to train (train=False runs without them)")
        if self.last and has_loss and len(self.targets) < need:
            raise ValueError(f"the last stage needs {need} micro-batch targets, got {len(self.targets)}")

    def run(self, a: Action, last: bool) -> None:
        at = (self.stage, a.chunk)
        if a.kind == FORWARD:
            start = self._forward(a, at)
        elif a.kind == WEIGHT_GRAD:
            start = self._weight(a, last)
        else:
            start = self._backward(a, at, last)
        if self.timeline is not None:
            self.timeline.append(Span(a.kind, a.micro, a.chunk, start, time.perf_counter()))

    def _forward(self, a: Action, at: tuple[int, int]) -> float:
        leaves: list[torch.Tensor] = []
        if at == self.first:
            x = self.inputs[a.micro]
        else:
            x = self.link.recv_activation(a.micro, a.chunk)
            if self.train:
                leaves = [t.requires_grad_() for t in floating(flatten(x)[0])]
        start = time.perf_counter()
        deferred = DeferredWeights() if (a.micro, a.chunk) in self.split else None
        with deferred.capture() if deferred is not None else contextlib.nullcontext():
            # the received leaves stay untouched (their .grad goes upstream): a stage that
            # starts with an in-place layer (ReLU(inplace=True)) works on a copy
            y = self.chunks[a.chunk](_copied(x) if leaves else x)
        if at == self.last:
            if self.want_outputs:
                self.outputs[a.micro] = _detached(y)
            roots = []
            if self.loss_fn is not None and self.targets is not None:
                loss = self.loss_fn(y, self.targets[a.micro])
                self.losses[a.micro] = float(loss.detach())
                roots = [loss * self.loss_scale / self.micro_batches]
        else:
            self.link.send_activation(y, a.micro, a.chunk)
            roots = floating(flatten(y)[0])
        if self.train:
            self.saved[(a.micro, a.chunk)] = _Saved(leaves, roots, deferred)
        return start

    def _backward(self, a: Action, at: tuple[int, int], last: bool) -> float:
        s = self.saved.pop((a.micro, a.chunk), None)
        if s is None:
            raise RuntimeError(f"stage {self.stage}: action {a} runs before the forward of micro-batch "
                               f"{a.micro} on chunk {a.chunk}; the schedule must forward first")
        if at == self.last:  # the scaled loss
            pairs = [(r, None) for r in s.roots]
        else:  # Note [tuples: only floating tensors carry gradients] in p2p.py
            grads = self.link.recv_grads(s.roots, a.micro, a.chunk)
            pairs = [(r, g) for r, g in zip(s.roots, grads) if g is not None and r.requires_grad]
        start = time.perf_counter()
        with self.grad_pass(a.kind, a.micro, a.chunk, last):
            if pairs:
                torch.autograd.backward([r for r, _ in pairs], [g for _, g in pairs])
        if at != self.first:
            self.link.send_grads([x.grad for x in s.inputs], a.micro, a.chunk, likes=s.inputs)
        if a.kind == INPUT_GRAD:
            self.weights[(a.micro, a.chunk)] = s.deferred
        return start

    def _weight(self, a: Action, last: bool) -> float:
        deferred = self.weights.pop((a.micro, a.chunk), None)
        if deferred is None:
            raise RuntimeError(f"stage {self.stage}: action {a} runs before the input half I{a.micro} "
                               f"of chunk {a.chunk}; a weight half must follow its input half")
        start = time.perf_counter()
        with self.grad_pass(a.kind, a.micro, a.chunk, last):
            deferred.apply()
        return start

    def check_complete(self) -> None:
        if self.saved:
            left = sorted(self.saved)
            raise RuntimeError(f"stage {self.stage}: (micro-batch, chunk) {left} were forwarded and "
                               "never backwarded: the schedule is incomplete")
        if self.weights:
            left = sorted(self.weights)
            raise RuntimeError(f"stage {self.stage}: (micro-batch, chunk) {left} ran their input half "
                               "I and never their weight half W: the schedule is incomplete")


def _detached(y):
    return tuple(t.detach() for t in y) if isinstance(y, (tuple, list)) else y.detach()


def _copied(x):
    """`x` (a tensor or tuple) with every tensor that requires grad cloned."""
    if isinstance(x, torch.Tensor):
        return x.clone() if x.requires_grad else x
    if isinstance(x, tuple):
        return tuple(_copied(t) for t in x)
    return x
