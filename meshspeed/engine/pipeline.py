"""The engine of a pipelined model: `engine.train_batch()` runs one whole batch.

    engine, *_ = meshspeed.initialize(model=PipelineModule(layers, num_stages=2, loss_fn=...),
                                      config=cfg, training_data=dataset)
    loss = engine.train_batch()          # gradient_accumulation_steps micro-batches, one step

What it composes, and nothing more: the stage's layers (the PipelineModule built only this
stage's part), the schedule's actions for this stage (`parallel/pipeline/schedule.py`,
config `pipeline.schedule` / `virtual_stages`), the runtime that executes them over the
mesh's pp group (`parallel/pipeline/runtime.py`), and the strategy of the stage's data-
parallel group (DDP or ZeRO 1-3: a stage's parameters are sharded over its own dp ranks,
nobody else's), then the ordinary optimizer step of `MeshspeedEngine`, with the gradient
norm and the overflow check summed over the stages too.

Note [micro-steps of a pipelined batch]
The strategies count micro-steps: `begin_micro_step(boundary)` before a backward, then
`finish_backward()`. Under GPipe and 1F1B each "B" action is one whole backward of the
stage's layers for one micro-batch, so each is one micro-step and the last one is the
boundary (data parallelism and ZeRO-1 reduce there, overlapped with that backward; ZeRO
2-3 reduce each one, as under gradient accumulation). Under interleaved schedules a "B"
covers one chunk of the stage, and under ZB-H1 a micro-batch's gradients arrive in two
passes ("I", then "W" later, after other micro-batches' passes), so no pass is a whole
micro-step: there the strategy holds its reductions (`hold_reductions()`: gradients
accumulate in `.grad`, nothing is reduced) and, once the stage's last pass is done, one
boundary reduces everything at once (not overlapped with backward; under ZeRO 2-3 the
stage keeps its whole gradients for the batch).

Note [ZB-H1's weight pass under ZeRO-3]
A "W" action accumulates weight gradients into parameters that ZeRO-3 has released
between passes (autograd checks a gradient against its parameter's shape), and no module
hook runs during it to gather them. So around each "W" the stage's parameters are
gathered as `GatheredParameters` would, and released after: one more all-gather of the
stage per micro-batch than 1F1B under ZeRO-3 (which gathers in forward and in backward).

Note [a batch fails on every stage]
A data iterator that runs dry mid-batch on the first or last stage must not leave the
other stages waiting for activations that will never come. Both stages read the batch's
micro-batches before any compute, then one 8-byte all-reduce over the world says whether
every rank has its batch; if one does not, every rank raises the same error.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import torch

from meshspeed import comm
from meshspeed.checkpoint import engine_api
from meshspeed.data.loader import RepeatingLoader
from meshspeed.engine.engine import MeshspeedEngine
from meshspeed.engine.parts import Composed
from meshspeed.parallel.gather import gathered
from meshspeed.parallel.pipeline.runtime import run_stage
from meshspeed.parallel.pipeline.schedule import ScheduleError, build
from meshspeed.parallel.pipeline.timeline import Span


class PipelineError(RuntimeError):
    """A pipelined engine used like a plain one, or a batch that cannot run."""


class PipelineEngine(MeshspeedEngine):
    """What `meshspeed.initialize` returns for a PipelineModule with more than one stage."""

    def __init__(self, parts: Composed):
        super().__init__(parts)
        topo = self.topology
        self.pp_group = topo.group("pp")
        self.num_stages = topo.size("pp")
        self.stage_id = topo.coord("pp")
        self.schedule = self.config.pipeline.schedule
        self.virtual_stages = self.module.virtual_stages
        self._split_passes = self.schedule in ("interleaved", "zb-h1")
        self._data_iterator: Iterator | None = None
        self.timeline: list | None = None  # set to [] to record the executed schedule
        self.record_timeline = False  # record each train_batch's spans (gather_timeline())
        self.agg_train_loss: torch.Tensor | None = None

    # -- DeepSpeed's pipeline API --------------------------------------------------------------
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def set_dataiterator(self, iterator: Iterator) -> None:
        """The iterator train_batch() reads when called without one."""
        self._data_iterator = iterator

    def _one_stage_only(self, what: str) -> None:
        if self.num_stages > 1:
            raise PipelineError(f"engine.{what} on a {self.num_stages}-stage pipeline: a pipelined engine "
                                "runs whole batches; call engine.train_batch() (or eval_batch(data_iter))")

    # With one stage the module is an ordinary model: the micro-step loop works too (more
    # than DeepSpeed's PipelineEngine allows; nothing in it needs a pipeline)
    def forward(self, *args, **kwargs):
        self._one_stage_only("forward (engine(batch))")
        return super().forward(*args, **kwargs)

    def backward(self, *args, **kwargs):
        self._one_stage_only("backward()")
        return super().backward(*args, **kwargs)

    def step(self, *args, **kwargs):
        self._one_stage_only("step()")
        return super().step(*args, **kwargs)

    def train_batch(self, data_iter: Iterator | None = None) -> torch.Tensor:
        """One optimizer step over gradient_accumulation_steps micro-batches; returns the mean
        loss (averaged over the micro-batches and the data-parallel replicas) on every rank."""
        if not torch.is_grad_enabled():
            raise PipelineError("train_batch() under torch.no_grad(): gradients are needed; use "
                                "eval_batch() to evaluate")
        if self.module.loss_fn is None:
            raise PipelineError("train_batch() with PipelineModule(loss_fn=None): the last stage computes "
                                "each micro-batch's loss with it; pass loss_fn=... (e.g. "
                                "torch.nn.CrossEntropyLoss()), or use eval_batch(compute_loss=False)")
        if self.config.checkpoint.async_save:
            engine_api.raise_pending_errors(self)
        self.module.train()
        m = self.config.gradient_accumulation_steps
        inputs, targets = self._read_batch(data_iter, m, "train_batch")
        self._observer.begin_batch(inputs)  # monitors, flops_profiler (engine/observe.py)
        if self.record_timeline:
            self.timeline = []  # this batch's spans only
        actions = self._actions(m)
        losses = self._run(actions, inputs, targets, train=True)
        self.agg_train_loss = self._mean_loss(losses)
        self._observer.on_loss(self.agg_train_loss)
        self._last_loss = self.agg_train_loss  # before the step: its log line prints this batch's
        self.micro_steps += m
        self.global_samples += self.config.train_batch_size
        self._step_applied = False
        self._apply_step()
        return self.agg_train_loss

    def eval_batch(self, data_iter: Iterator, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str | None = "avg", bcast_loss: bool = True,
                   num_micro_batches: int | None = None):
        """Forward gradient_accumulation_steps (or num_micro_batches) micro-batches without
        gradients; returns the mean loss on every rank, and with return_logits also the last
        stage's outputs (a list per micro-batch; None on other stages). Without a loss
        (compute_loss=False, or PipelineModule(loss_fn=None)) the value is the last stage's
        outputs instead (Note [eval_batch without a loss])."""
        if reduce_output not in ("avg", None):
            raise ValueError(f"eval_batch(reduce_output={reduce_output!r}): \"avg\" or None")
        was_training = self.module.training
        self.module.eval()
        m = num_micro_batches or self.config.gradient_accumulation_steps
        use_loss = compute_loss and self.module.loss_fn is not None
        try:
            inputs, targets = self._read_batch(data_iter, m, "eval_batch", need_targets=compute_loss)
            keep = (return_logits or not use_loss) and self.is_last_stage()
            outputs: list | None = [] if keep else None
            with torch.no_grad():
                losses = self._run(self._actions(m, forward_only=True), inputs,
                                   targets if use_loss else None, train=False, outputs=outputs)
        finally:
            self.module.train(was_training)
        if use_loss:
            value = self._mean_loss(losses) if reduce_output == "avg" else (
                torch.tensor(losses) if self.is_last_stage() else None)
        else:
            value = self._reduced_outputs(outputs, reduce_output, broadcast=compute_loss and bcast_loss)
        if return_logits:
            return value, outputs
        return value

    # Note [eval_batch without a loss]
    # As DeepSpeed's engine does, the last stage's value per micro-batch is the loss when
    # eval_batch computes one (compute_loss and a loss_fn) and the stage's output otherwise
    # (models whose last layer returns the loss). With reduce_output="avg" the outputs are
    # averaged over the micro-batches and the data-parallel replicas; with None they are
    # the list. Where a loss would be broadcast (compute_loss and bcast_loss, i.e. loss_fn
    # None) the average reaches every stage, whatever its shape (DeepSpeed's broadcast
    # takes one-element outputs only); otherwise the other stages get None.
    def _reduced_outputs(self, outputs: list | None, reduce_output: str | None, broadcast: bool):
        value = None
        if self.is_last_stage():
            value = outputs if reduce_output is None else _mean_over(outputs)
            dp = self.topology.size("dp")
            if reduce_output == "avg" and dp > 1:
                for t in _tensors(value):
                    comm.all_reduce(t, group=self.dp_group)
                    t /= dp
        if broadcast and reduce_output == "avg":
            value = _broadcast_from_last(value, self.num_stages - 1, self.pp_group, self.device)
        return value

    # -- one batch -------------------------------------------------------------------------------
    def _actions(self, m: int, forward_only: bool = False):
        try:
            plans = build(self.schedule, m, self.num_stages, self.virtual_stages)
        except ScheduleError as err:
            raise PipelineError(f"pipeline.schedule {self.schedule!r} with {m} micro-batches "
                                f"(gradient_accumulation_steps) on {self.num_stages} stages: {err}") from err
        actions = plans[self.stage_id]
        if forward_only:
            actions = [a for a in actions if a.kind == "F"]
        return actions

    def _run(self, actions, inputs, targets, *, train: bool, outputs: list | None = None) -> list[float]:
        chunks = self.module.chunks()
        kwargs = {"stage": self.stage_id, "stages": self.num_stages, "group": self.pp_group,
                  "inputs": inputs, "targets": targets, "loss_fn": self.module.loss_fn,
                  "compression": self.config.pipeline.activation_compression}
        if not train:
            return run_stage(chunks if len(chunks) > 1 else chunks[0], actions, train=False,
                             outputs=outputs, **kwargs)
        if self._split_passes:
            self.strategy.hold_reductions()
        losses = run_stage(chunks if len(chunks) > 1 else chunks[0], actions,
                           loss_scale=self.loss_scaler.scale, grad_pass=self._grad_pass,
                           timeline=self.timeline, **kwargs)
        if self._split_passes:  # Note [micro-steps of a pipelined batch]
            self._begin_micro_step(True)
            self.strategy.finish_backward()
        return losses

    @contextlib.contextmanager
    def _grad_pass(self, kind: str, micro: int, chunk: int, last: bool):
        """Around each action that accumulates parameter gradients (Note [micro-steps of a
        pipelined batch])."""
        if self._split_passes:
            whole = kind == "W" and self.strategy.shards_params  # Note [ZB-H1's weight pass under ZeRO-3]
            with gathered(list(self.module.parameters()), enabled=whole):
                yield
            self.strategy.finish_backward()  # releases gathered stage-3 parameters; no reduction
            self.strategy.hold_reductions()
            return
        self._begin_micro_step(last)
        yield
        self.strategy.finish_backward()

    def gather_timeline(self) -> list[list]:
        """The last recorded batch's spans of every stage (`record_timeline = True` before
        train_batch), on every rank: a collective over the world. Each stage's spans are
        those of its first rank (data, context and tensor coordinate 0)."""
        mine = None
        if all(self.topology.coord(a) == 0 for a in ("dp", "cp", "tp")):
            mine = (self.stage_id, [tuple(s) for s in (self.timeline or [])])
        rows: list[list] = [[] for _ in range(self.num_stages)]
        for item in comm.all_gather_object(mine):
            if item is not None:
                rows[item[0]] = [Span(*s) for s in item[1]]
        return rows

    def _read_batch(self, data_iter, m: int, what: str, need_targets: bool = True):
        """Both ends of the pipeline read the micro-batches, before any compute (Note [a batch
        fails on every stage])."""
        first, last = self.is_first_stage(), self.is_last_stage()
        inputs, targets, problem = None, None, ""
        if first or (last and need_targets):
            it = data_iter if data_iter is not None else self._default_iterator(what)
            try:
                batches = list(itertools.islice(it, m)) if it is not None else []
            except Exception as err:  # noqa: BLE001 - reported on every rank below
                batches, problem = [], f"the data iterator raised {type(err).__name__}: {err}"
            if it is None:
                problem = (f"{what}() without a data iterator, and initialize() was given no "
                           "training_data; pass engine.train_batch(data_iter=iter(loader)) or "
                           "initialize(training_data=...)")
            elif not problem and len(batches) < m:
                problem = (f"the data iterator ran dry after {len(batches)} of the {m} micro-batches of "
                           f"optimizer step {self.global_steps} (gradient_accumulation_steps {m}); give "
                           "train_batch an iterator that lasts (meshspeed.utils.RepeatingLoader) or "
                           "stop before it ends")
            elif not problem:
                bad = next((b for b in batches if not (isinstance(b, (tuple, list)) and len(b) == 2)), None)
                if bad is not None:
                    problem = (f"a pipeline micro-batch must be a pair (inputs, labels): the first stage "
                               f"takes inputs, the last the labels; got {type(bad).__name__}"
                               f"{'' if not isinstance(bad, (tuple, list)) else f' of {len(bad)} items'}")
            if not problem:
                inputs = [b[0] for b in batches] if first else None
                targets = [b[1] for b in batches] if last else None
        failed = torch.tensor([1 if problem else 0], dtype=torch.int64, device=self.device)
        comm.all_reduce(failed, op="max")
        if problem:
            raise PipelineError(f"{what}: rank {comm.get_rank()} (stage {self.stage_id}): {problem}")
        if int(failed):
            raise PipelineError(f"{what}: another rank could not read its micro-batches (its error "
                                f"names why); stage {self.stage_id} stops too")
        return inputs, targets

    def _default_iterator(self, what: str):
        if self._data_iterator is None and self.training_dataloader is not None:
            self._data_iterator = iter(RepeatingLoader(self.training_dataloader))
        return self._data_iterator

    def _mean_loss(self, losses: list[float]) -> torch.Tensor:
        """The last stage's mean over micro-batches, averaged over dp, sent to every stage."""
        loss = torch.tensor(sum(losses) / len(losses) if losses else 0.0, dtype=torch.float32,
                            device=self.device)
        dp = self.topology.size("dp")
        if self.is_last_stage() and dp > 1:
            comm.all_reduce(loss, group=self.dp_group)
            loss /= dp
        comm.broadcast(loss, src=self.num_stages - 1, group=self.pp_group)
        return loss


def _mean_over(outputs: list):
    """The element-wise mean of the micro-batches' outputs (tensors, or tuples of them)."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return sum(o.float() if not o.is_floating_point() else o for o in outputs) / len(outputs)
    if isinstance(first, (tuple, list)):
        return type(first)(_mean_over([o[i] for o in outputs]) for i in range(len(first)))
    raise PipelineError(f"eval_batch averages the last stage's outputs over micro-batches, but they are "
                        f"{type(first).__name__}, not tensors; pass reduce_output=None for the list")


def _tensors(value) -> list[torch.Tensor]:
    return [value] if isinstance(value, torch.Tensor) else [t for v in value for t in _tensors(v)]


def _broadcast_from_last(value, src: int, group, device: torch.device):
    """`value` (a tensor or nested tuples of them) of pipeline rank `src`, on every stage."""
    def spec(v):
        if isinstance(v, torch.Tensor):
            return (tuple(v.shape), v.dtype)
        return (type(v), [spec(x) for x in v])

    def build(sp):
        if isinstance(sp[0], tuple):
            return torch.empty(sp[0], dtype=sp[1], device=device)
        return sp[0](build(x) for x in sp[1])

    shape = comm.broadcast_object(spec(value) if comm.get_rank(group) == src else None, src=src, group=group)
    out = value if comm.get_rank(group) == src else build(shape)
    for t in _tensors(out):
        comm.broadcast(t, src=src, group=group)
    return out
