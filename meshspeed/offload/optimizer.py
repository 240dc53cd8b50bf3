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
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import torch

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


class SerialRunner:
    """One background thread that runs what is submitted in order, without waiting for
    what runs before (Note [the update during the backward]); `wait` joins all of it."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="meshspeed-offload-early")
        self._futures: list[Future] = []

    def submit(self, fn, *args) -> None:
        self._futures.append(self._pool.submit(fn, *args))

    def wait(self, between=None) -> None:
        """Join everything submitted, re-raising the first error; `between()` runs every
        50 ms meanwhile (the publishes the background thread hands over)."""
        futures, self._futures = self._futures, []
        for f in futures:
            while True:
                try:
                    f.result(timeout=0.05)
                    break
                except FutureTimeout:
                    if between is not None:
                        between()

    def close(self, between=None) -> None:
        try:
            self.wait(between)
        finally:
            self._pool.shutdown(wait=True)


class Handoff:
    """(master, 16-bit values) from the background update to the backward's thread, which
    publishes them (Note [the update during the backward]); at most `limit` bytes wait,
    beyond one item: the background thread waits for the next `drain`."""

    def __init__(self, limit: int):
        self.limit = limit
        self._items: deque = deque()
        self._bytes = 0
        self._cv = threading.Condition()

    def put(self, master: torch.Tensor, values: torch.Tensor) -> None:
        with self._cv:
            while self._items and self._bytes + values.nbytes > self.limit:
                self._cv.wait()
            self._items.append((master, values))
            self._bytes += values.nbytes

    def drain(self, publish) -> None:
        while True:
            with self._cv:
                if not self._items:
                    return
                master, values = self._items.popleft()
            publish(master, values)
            with self._cv:
                self._bytes -= values.nbytes
                self._cv.notify_all()


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
        self.updated_in_backward = 0  # sub-groups updated during a backward, all steps (tests)

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
        early = self._join_early()
        done = {sg.index for sg in early}
        work = []
        for sg in self.sub_groups:
            stepped = [p.grad is not None for p in sg.params]
            if any(stepped) and sg.index not in done:
                work.append(_Work(sg, stepped, [p.grad for p in sg.params if p.grad is not None]))
        options = self._options()
        if early and not _same(options, self._early_options):
            raise RuntimeError(
                "the optimizer's hyperparameters changed between backward() and step(), after "
                f"{len(early)} sub-groups had been updated during the backward with the old ones "
                "(Note [the update during the backward]); set them before backward(), or set "
                "zero_optimization.offload_optimizer.update_in_backward to false")
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

    # -- Note [the update during the backward] ---------------------------------------------
    def update_in_backward(self, files) -> None:
        """Update each sub-group as soon as its gradients are in their files (`files`: the
        masters' MasterFiles); the engine turns this on where the step leaves the gradients
        as they are (setup.update_in_backward_allowed)."""
        self._files = files
        self._early_runner = SerialRunner()
        # one sub-group's 16-bit values wait at most (the largest sub-group's, 2 B each)
        self._publishes = Handoff(2 * max((sg.numel for sg in self.sub_groups), default=0))

    def grads_landed(self, landed: set[int]) -> None:
        """The boundary backward's thread, after a unit's gradient went to its file: start the
        update of every sub-group whose gradients are all in files now."""
        if self._files is None:
            return
        self._publish_handed_over()
        done = {sg.index for sg in self._early}
        ready = [sg for sg in self.sub_groups if sg.index not in done and self._landed(sg, landed)]
        if not ready:
            return
        if not self._early:
            self._early_options = self._options()
        self._early += ready
        work = [_Work(sg, [p.requires_grad for p in sg.params], [None] * sum(p.requires_grad for p in sg.params))
                for sg in ready]
        self._early_runner.submit(self._run_early, work, self._early_options, len(self._early) == len(ready))

    def _landed(self, sg: SubGroup, landed: set[int]) -> bool:
        files = self._files
        return any(p.requires_grad for p in sg.params) and all(
            files.holds(p) and files.unit_index(p) in landed for p in sg.params)

    def _run_early(self, work: list[_Work], options: list[dict], first: bool) -> None:
        store = self._state_store
        with torch.no_grad():
            if first:
                store.begin_step()
            store.defer_publish = self._publishes.put
            try:
                self._pipeline(work, options)
            finally:
                store.defer_publish = None

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
        return early

    def settle(self) -> None:
        """Wait for the step, and for the I/O it leaves running (Note [the step's I/O
        outside the step] in state.py): before counting a step's bytes."""
        self.wait()
        self._state_store.settle()

    def _run(self, work: list[_Work], options: list[dict], early: list[SubGroup] = ()) -> None:
        """`early`: sub-groups this step already updated during the backward (then begun)."""
        store = self._state_store
        with torch.no_grad():  # grad mode is per thread: set it here, not only in step()
            if not early:
                store.begin_step()
            self._pipeline(work, options)
            # the write-back drains behind the next forward, and the next step's first
            # sub-groups are read meanwhile (Note [the step's I/O outside the step] in state.py);
            # with updates during the backward, the next step starts where this one did
            store.finish_step(list(early) + [item.sg for item in work])

    def _pipeline(self, work: list[_Work], options: list[dict]) -> None:
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


def _same(a, b) -> bool:
    """Equal hyperparameters (tensors compared by value)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b
