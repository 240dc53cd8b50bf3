"""`OffloadOptimizer`: the optimizer step on the host, one sub-group at a time.

To the engine it is a torch optimizer (`param_groups`, `step()`, `zero_grad()`, `state`,
`state_dict()` / `load_state_dict()`) over the strategy's fp32 master tensors, which the
placement (placement.py) has put in host memory with their gradients. The state lives in
a store (state.py): host memory for `offload_optimizer.device: "cpu"`, swap files for
`"nvme"`. A step walks the sub-groups (`zero_optimization.sub_group_size` elements each)
in order; for swap files, the read of sub-group k+1 is in flight while k is updated and
the write of k proceeds while k+1 is updated, within `buffer_count` buffers. The last
writes finish after `step()` returns, and the first sub-groups of the next step are read
during its forward and backward (Note [the step's I/O outside the step] in state.py).

With a `BackgroundStep` runner (`delayed_update`), `step()` only snapshots what the step
needs (gradient tensors, hyperparameters) and returns; `wait()` joins it. Anything that
reads optimizer state or masters (`state`, `state_dict()`) waits first.

Note [the update during the backward]
With the masters and the gradients in files, the optimizer phase of a step is mostly the
disk's (each sub-group's masters and moments read and written), and it used to start only
when the backward had ended: the disk idled through forward and backward (17% busy at 2B)
and the CPU idled through the optimizer phase. A sub-group's update needs only its own
gradients, the hyperparameters and, with clipping or a loss scale, the global norm and
the overflow check. Where the step needs neither (no `gradient_clipping`, no fp16, no
`check_finite`, no pipeline or tensor-parallel step part that edits gradients first: see
`update_in_backward_allowed` in setup.py), the update of a sub-group starts as soon as the
last of its gradients is in its file, on a background thread, while the backward goes on:
`grads_landed`, called by the placement at each unit's landing at the boundary backward.
The backward lands the units last to first, so those sub-groups go first. The result is
bit-identical to the update at `step()`:
  - the gradients are the files' values, which nothing changes between landing and
    `step()` without clipping or unscaling; the sub-groups a step updates are those
    whose masters have a gradient (`requires_grad` in a landed unit) either way;
  - the hyperparameters are read when the first sub-group starts; `step()` checks that
    they have not changed since (a scheduler steps after `step()`, so they have not unless
    the script set them between `backward` and `step`) and raises if they have;
  - the 16-bit publishes of the updated masters go through the shard store, which the
    backward's gathers use: the background thread hands them over as 16-bit copies
    (rounded as the publish rounds) and the backward's thread writes them, at the next
    landing and at `step()`. A landed unit's backward is over, so no gather reads its
    shard before the next forward; the next forward's reads wait for the writes.
`step()` waits for the background updates, updates the sub-groups left (those of units
that landed last, and any without a file) and ends the step as before. Anything that
reads optimizer state or masters waits for the background updates first (`wait`).

Note [the update that runs into the next forward]
With the update during the backward, what the backward leaves undone is the update of the
units whose gradients land last, the first units of the model; step() used to wait for it
while the disk had nothing else to do, and the next forward then read only the shards, a
fraction of what the disk could move meanwhile (at 2B: 39% busy in the forward). With
`update_into_forward` (on by default since it was measured faster: see the end), step() queues the sub-groups not updated yet in the
order the next forward gathers their units (the first unit's first), and returns. Before
a unit's shard is read for a gather, `before_gather` waits for the updates of the unit's
sub-groups and writes their 16-bit publishes (the forward's thread owns the shard store, as
the backward's does at each landing); a prefetch does not wait, it stops at a unit not
ready yet. So the forward of unit k overlaps the update of unit k+1, and the result is
bit-identical: every gather reads the updated shard, as it did after step(). The step's
end (the store's write-back hand-over and the next step's read-ahead) runs when the last
update is done, on the thread that finds it done. Anything that reads masters, optimizer
state or gradient files waits for all of it first (`finish_carried`: the placement's
`wait`, and before a gradient lands again), and the hyperparameters are those of step(),
as for the updates during the backward. Off, or when a sub-group has a gradient outside
the files, step() waits for all the updates as before.
What the backward leaves undone is left to chance as much as to the disk: where the
updates keep up with the landings, little is, and the forward's disk idles again. So the
backward also holds back, on purpose, the updates of the units the next forward gathers
last (landed first, they would otherwise go first): as many as the disk can do in half
the last forward's own seconds (`Pace` in background.py: its time without the waits for
updates, at the disk's throughput over the last step). The forward reaches them last, so
it waits for them least; a step leaves none to the forward before its first step() has
measured both. The read-ahead after a step reads the sub-groups the next backward
updates first, not the held ones.
Measured (2B GPT, the ZeRO-Infinity tutorial's config, world 1, this 2-core CPU machine).
First it did not pay: over four pairs of runs the median step with it was within the runs'
own spread of the median without it (50.5 against 50.0 s at b044002). The forward's idle
disk was the CPU's busy time then: the updates the forward takes bring their CPU work
(the gradients' widening, Adam, the 16-bit copies) into it, and the cores were taken by
gloo's copies at world 1 and by fresh-page faults (Note [a group of one] in
comm/local.py, Note [landing without fresh pages] in grad_files.py, Note [gathered buffers
without fresh pages] in parallel/zero/flat_cache.py). With those gone, the same pair
measured 33.9 s with it against 40.5 s without (the disk busy 89% against 87% of the
step), and it became the default. `update_into_forward: false` gives the step that waits.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from meshspeed.offload.background import UPDATE_BYTES, Handoff, Pace, SerialRunner
from meshspeed.offload.state import SubGroup, split_sub_groups
from meshspeed.parallel.protocol import Closeable


class BackgroundStep:
    """One background thread that runs at most one optimizer step at a time."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="meshspeed-offload-step")
        self._future: Future | None = None
        self._lock = threading.Lock()

    @property
    def pending(self) -> bool:
        return self._future is not None

    def submit(self, fn, *args) -> None:
        self.wait()
        self._future = self._pool.submit(fn, *args)

    def wait(self) -> bool:
        """Join the running step (re-raising its error); True when there was one."""
        with self._lock:
            future, self._future = self._future, None
        if future is None:
            return False
        future.result()
        return True

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)


@dataclass
class _Work:
    sg: SubGroup
    stepped: list[bool]  # which parameters of the sub-group have a gradient this step
    grads: list[torch.Tensor]  # their gradients, in order


class OffloadOptimizer(torch.optim.Optimizer, Closeable):
    """A torch-compatible optimizer whose state lives in a host or NVMe store.

    `template` is the optimizer the config would build without offload (it supplies the
    param groups and their defaults, so options mean exactly what they mean there);
    `rule` the update (kernels.py); `make_store(sub_groups)` the state store."""

    def __init__(self, template: torch.optim.Optimizer, rule, make_store, *,
                 sub_group_size: int, runner: BackgroundStep | None = None):
        self._state_store = None
        super().__init__([dict(g) for g in template.param_groups], dict(template.defaults))
        self.kind = type(template).__name__  # "AdamW", "Adam", "SGD"
        self.rule = rule
        self.runner = runner
        self._group_of = {p: i for i, g in enumerate(self.param_groups) for p in g["params"]}
        params = [p for g in self.param_groups for p in g["params"]]
        self.sub_groups = split_sub_groups(params, sub_group_size)
        self._state_store = make_store(self.sub_groups)
        # Note [the update during the backward]: None, or the masters' files when it is on
        self._files = None
        self._early_runner: SerialRunner | None = None
        self._early: list[SubGroup] = []  # updated during this step's backward, in order
        self._early_options: list[dict] | None = None
        self._publishes: Handoff | None = None  # 16-bit copies, from the background thread
        self._begun = False  # the store's step has begun (the first update of a step begins it)
        self.updated_in_backward = 0  # sub-groups updated during a backward, all steps (tests)
        # Note [the update that runs into the next forward]
        self._into_forward = False
        self._sgs_of_unit: dict[int, list[int]] = {}  # MasterFiles unit -> its sub-groups
        self._carried: set[int] = set()  # sub-groups step() left running, not updated yet
        self._updated_now: set[int] = set()  # sub-groups updated in the background this step
        self._carried_cv = threading.Condition()
        self._ending: list[SubGroup] | None = None  # the step's sub-groups, until its end
        self.updated_in_forward = 0  # sub-groups the next forward waited for or overlapped (tests)
        self._forward: dict[int, None] = {}  # units in the order this step's passes gathered them
        self._order: dict[int, int] = {}  # unit -> its place in the last forward
        self._held: set[int] = set()  # sub-groups the backward leaves to the next forward
        self._pace = Pace()

    # torch.optim.Optimizer.__init__ assigns `self.state`; the store owns it instead.
    @property
    def state(self):
        if self._state_store is None:
            return self.__dict__.get("_torch_state", {})
        self.wait()
        return self._state_store.state

    @state.setter
    def state(self, value) -> None:
        self.__dict__["_torch_state"] = value

    @property
    def store(self):
        return self._state_store

    def add_param_group(self, param_group: dict) -> None:
        if self._state_store is not None:
            raise RuntimeError("an offloaded optimizer's parameter groups are fixed at initialize")
        super().add_param_group(param_group)

    # -- the step -----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("an offloaded optimizer takes no closure (the step may run on "
                             "another thread); compute the loss before calling step()")
        if self._into_forward and self._carry_into_forward():
            return
        early = self._join_early()
        done = {sg.index for sg in early}
        work = []
        for sg in self.sub_groups:
            stepped = [p.grad is not None for p in sg.params]
            if any(stepped) and sg.index not in done:
                work.append(_Work(sg, stepped, [p.grad for p in sg.params if p.grad is not None]))
        options = self._options()
        if early and not _same(options, self._early_options):
            raise _changed(len(early))
        if self.runner is None:
            self._run(work, options, early)
        else:
            self.runner.submit(self._run, work, options, early)

    def _options(self) -> list[dict]:
        """Each group's hyperparameters as they are now (a tensor one copied: a scheduler may
        change it in place)."""
        return [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in g.items() if k != "params"}
                for g in self.param_groups]

    def wait(self) -> None:
        if self.runner is not None:
            self.runner.wait()
        if self._early_runner is not None:
            self._early_runner.wait(self._publish_handed_over)
            self._publish_handed_over()
            self._end_carried_step()

    # -- Note [the update during the backward] ---------------------------------------------
    def update_in_backward(self, files, into_forward: bool = False) -> None:
        """Update each sub-group as soon as its gradients are in their files (`files`: the
        masters' MasterFiles); the engine turns this on where the step leaves the gradients
        as they are (setup.update_in_backward_allowed). `into_forward`: `step()` leaves the
        updates not done yet running into the next forward, which waits for each unit's
        (Note [the update that runs into the next forward])."""
        self._files = files
        self._early_runner = SerialRunner()
        # one sub-group's 16-bit values wait at most (the largest sub-group's, 2 B each)
        self._publishes = Handoff(2 * max((sg.numel for sg in self.sub_groups), default=0))
        self._into_forward = into_forward
        of_unit: dict[int, set[int]] = defaultdict(set)
        for sg in self.sub_groups:
            for p in sg.params:
                if files.holds(p):
                    of_unit[files.unit_index(p)].add(sg.index)
        self._sgs_of_unit = {u: sorted(v) for u, v in of_unit.items()}

    def grads_landed(self, landed: set[int]) -> None:
        """The boundary backward's thread, after a unit's gradient went to its file: start the
        update of every sub-group whose gradients are all in files now."""
        if self._files is None:
            return
        self._publish_handed_over()
        done = {sg.index for sg in self._early}
        ready = [sg for sg in self.sub_groups if sg.index not in done and sg.index not in self._held
                 and self._landed(sg, landed)]
        if not ready:
            return
        if not self._early:
            self._early_options = self._options()
        self._early += ready
        self._early_runner.submit(self._run_early, [self._from_file(sg) for sg in ready], self._early_options)

    @staticmethod
    def _from_file(sg: SubGroup) -> _Work:
        """A sub-group's work whose gradients the store reads from their files."""
        stepped = [p.requires_grad for p in sg.params]
        return _Work(sg, stepped, [None] * sum(stepped))

    def _landed(self, sg: SubGroup, landed: set[int]) -> bool:
        files = self._files
        return any(p.requires_grad for p in sg.params) and all(
            files.holds(p) and files.unit_index(p) in landed for p in sg.params)

    def _run_early(self, work: list[_Work], options: list[dict]) -> None:
        store = self._state_store
        with torch.no_grad():
            if not self._begun:
                store.begin_step()
                self._begun = True
            store.defer_publish = self._publishes.put
            try:
                self._pipeline(work, options, self._updated)
            finally:
                store.defer_publish = None

    def _updated(self, sg: SubGroup) -> None:
        """The background thread: `sg` is updated and its publishes handed over."""
        with self._carried_cv:
            self._updated_now.add(sg.index)
            self._carried.discard(sg.index)
            self._carried_cv.notify_all()

    def _publish_handed_over(self) -> None:
        self._publishes.drain(self._files.publish)

    def _join_early(self) -> list[SubGroup]:
        """Wait for the updates of this backward and write their publishes; the sub-groups
        they updated (and forget them: the next backward starts afresh)."""
        if self._early_runner is None or not self._early:
            return []
        self._early_runner.wait(self._publish_handed_over)
        self._publish_handed_over()
        early, self._early = self._early, []
        self.updated_in_backward += len(early)
        self._updated_now = set()
        return early

    # -- Note [the update that runs into the next forward] -------------------------------------
    def _carry_into_forward(self) -> bool:
        """step() with the update during the backward: the sub-groups not updated yet are
        queued in the order the next forward gathers their units, and step() returns; False
        (the step then runs as without) when a sub-group's gradients are not all in files."""
        self.finish_carried()  # (the last step's, when no forward ran since)
        submitted = {sg.index for sg in self._early}
        rest = [sg for sg in self.sub_groups if sg.index not in submitted
                and any(p.grad is not None for p in sg.params)]
        if any(not self._files.holds(p) for sg in rest for p in sg.params):
            return False
        options = self._options()
        if self._early and not _same(options, self._early_options):
            raise _changed(len(self._join_early()))
        if not self._early:
            self._early_options = options
        self._order = {u: i for i, u in enumerate(self._forward)}
        self._forward = {}
        back = [item for work, _ in self._early_runner.take_back() for item in work]
        carried = sorted(back + [self._from_file(sg) for sg in rest], key=self._forward_order)
        self._held = self._to_hold()
        everything = self._early + rest
        self._early = []
        with self._carried_cv:  # (a batch still running updates some that were not taken back)
            self._carried = {sg.index for sg in everything} - self._updated_now
        self.updated_in_backward += len(everything) - len(self._carried)
        self.updated_in_forward += len(self._carried)
        self._ending = everything
        if carried:
            self._early_runner.submit(self._run_early, carried, self._early_options)
        return True

    def _forward_order(self, item: _Work) -> int:
        """Where the next forward first needs `item` (the first of its units it gathers)."""
        units = {self._files.unit_index(p) for p in item.sg.params}
        return min(self._order.get(u, len(self._order) + u) for u in units)

    def _to_hold(self) -> set[int]:
        """The sub-groups the next backward leaves to the forward after it: those of the units
        that forward gathers last, as many as the disk can update in the forward's time
        beyond its own reads (the last forward's, at the last step's disk throughput)."""
        budget = self._pace.budget()
        if budget <= 0 or not self._order:
            return set()
        held: set[int] = set()
        units = sorted(self._order, key=self._order.get, reverse=True)
        for u in units[:-1]:  # (never the first: the forward could not start)
            extra = [i for i in self._sgs_of_unit.get(u, ()) if i not in held]
            cost = sum(self.sub_groups[i].numel for i in extra) * UPDATE_BYTES
            if cost > budget:
                break
            held.update(extra)
            budget -= cost
        return held

    def before_gather(self, u: int, block: bool = True) -> bool:
        """The unit `u` of the masters' files is about to be gathered: wait for the updates
        of its sub-groups that step() left running, and write their publishes first. Not
        `block`: whether it would not wait (publishing what is handed over meanwhile)."""
        if block:
            self._pace.gathered(again=u in self._forward)
            self._forward.setdefault(u, None)
        if self._ending is None:
            return True
        wanted = self._sgs_of_unit.get(u, ())
        t = time.perf_counter()
        while True:
            self._publish_handed_over()
            with self._carried_cv:
                if not any(i in self._carried for i in wanted):
                    break
                if not block:
                    return False
                self._carried_cv.wait(0.05)
            self._early_runner.check()
        self._pace.waited(time.perf_counter() - t)
        self._publish_handed_over()
        if self._early_runner.idle():
            self._end_carried_step()
        return True

    def finish_carried(self) -> None:
        """Wait for every update step() left running and end that step (before anything
        writes new gradients into the files those updates read)."""
        if self._ending is None:
            return
        self._early_runner.wait(self._publish_handed_over)
        self._publish_handed_over()
        self._end_carried_step()

    def _end_carried_step(self) -> None:
        """All of a carried step's updates are done: end it (the store's write-back and the
        next step's read-ahead), on the caller's thread (the runner is idle)."""
        if self._ending is None:
            return
        self._early_runner.check()
        ending, self._ending = self._ending, None
        self._carried, self._updated_now = set(), set()
        self._begun = False
        # read ahead what the next backward updates first (not what it leaves to the forward)
        self._state_store.finish_step([sg for sg in ending if sg.index not in self._held])

    def settle(self) -> None:
        """Wait for the step, and for the I/O it leaves running (Note [the step's I/O
        outside the step] in state.py): before counting a step's bytes."""
        self.wait()
        self._state_store.settle()

    def _run(self, work: list[_Work], options: list[dict], early: list[SubGroup] = ()) -> None:
        """`early`: sub-groups this step already updated during the backward (then begun)."""
        store = self._state_store
        with torch.no_grad():  # grad mode is per thread: set it here, not only in step()
            if not self._begun:
                store.begin_step()
            self._pipeline(work, options)
            self._begun = False
            # the write-back drains behind the next forward, and the next step's first
            # sub-groups are read meanwhile (Note [the step's I/O outside the step] in state.py);
            # with updates during the backward, the next step starts where this one did
            store.finish_step(list(early) + [item.sg for item in work])

    def _pipeline(self, work: list[_Work], options: list[dict], updated=None) -> None:
        """Swap in, update and write back `work`'s sub-groups, k+1's reads in flight while k
        is updated."""
        store = self._state_store
        ahead = store.prefetch(work[0].sg) if work else None
        for i, item in enumerate(work):
            handle, ahead = ahead, None
            state = store.acquire(handle, item.stepped)
            nxt = work[i + 1] if i + 1 < len(work) else None
            if nxt is not None:  # swap in the next sub-group while this one updates
                ahead = store.prefetch(nxt.sg, block=False)
            self._update(item, state, store.params(handle, item.stepped),
                         store.step_tensors(item.sg, item.stepped), options,
                         store.step_grads(handle, item.stepped, item.grads))
            store.release(handle, item.stepped, state)
            if updated is not None:
                updated(item.sg)
            if nxt is not None and ahead is None:
                ahead = store.prefetch(nxt.sg)

    def _update(self, item: _Work, state: dict[str, list], targets: list[torch.Tensor], steps: list,
                options: list[dict], grads: list[torch.Tensor]) -> None:
        """`targets`: what the rule writes for each stepped parameter (the master itself, or
        its swapped-in copy: Note [masters on NVMe] in masters.py)."""
        params = [p for p, take in zip(item.sg.params, item.stepped) if take]
        by_group: dict[int, list[int]] = defaultdict(list)
        for j, p in enumerate(params):
            by_group[self._group_of[p]].append(j)
        for gi, idx in by_group.items():
            sub_state = {k: _pick(v, idx) for k, v in state.items()}
            self.rule.step(_pick(targets, idx), _pick(grads, idx), sub_state,
                           _pick(steps, idx) if steps else [], options[gi])
            for k, values in sub_state.items():  # state the step created (SGD momentum)
                for j, v in zip(idx, values):
                    state[k][j] = v

    # -- torch-format state dicts ---------------------------------------------------------------
    def state_dict(self) -> dict:
        """torch's layout (`state` by parameter index, `param_groups` with indices). For swap
        files this reads all state into memory."""
        self.wait()
        params = [p for g in self.param_groups for p in g["params"]]
        state = self._state_store.state
        packed = {i: {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                      for k, v in state[p].items()}
                  for i, p in enumerate(params) if p in state}
        groups, start = [], 0
        for g in self.param_groups:
            n = len(g["params"])
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": list(range(start, start + n))})
            start += n
        return {"state": packed, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        self.wait()
        groups = state_dict["param_groups"]
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("state_dict has different parameter groups than this optimizer")
        params = [p for g in self.param_groups for p in g["params"]]
        for mine, saved in zip(self.param_groups, groups):
            mine.update({k: v for k, v in saved.items() if k != "params"})
        index_of = {i: p for i, p in enumerate(params)}
        for i, entry in state_dict["state"].items():
            p = index_of[int(i)]
            self._state_store.state[p] = {
                k: (v.detach().to(p.device, torch.float32) if isinstance(v, torch.Tensor)
                    and v.dim() > 0 else v) for k, v in entry.items()}

    # -- accounting and shutdown ------------------------------------------------------------------
    def memory_tensors(self) -> list[torch.Tensor]:
        """Optimizer-state tensors resident in host memory (no swap-in)."""
        return self._state_store.resident_tensors()

    def host_tensors(self) -> list[torch.Tensor]:
        return self.memory_tensors()

    def nvme_bytes(self) -> dict[str, int]:
        return {"optimizer_state": self._state_store.nvme_bytes()}

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()
        if self._early_runner is not None:
            self._early_runner.close(self._publish_handed_over)
            self._publish_handed_over()
        self._state_store.close()


def _pick(values: list, idx: list[int]) -> list:
    return [values[j] for j in idx]


def _changed(updated: int) -> RuntimeError:
    return RuntimeError(
        "the optimizer's hyperparameters changed between backward() and step(), after "
        f"{updated} sub-groups had been updated during the backward with the old ones "
        "(Note [the update during the backward]); set them before backward(), or set "
        "zero_optimization.offload_optimizer.update_in_backward to false")


def _same(a, b) -> bool:
    """Equal hyperparameters (tensors compared by value)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b
