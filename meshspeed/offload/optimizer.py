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
"""

from __future__ import annotations

import threading
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
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
        work = []
        for sg in self.sub_groups:
            stepped = [p.grad is not None for p in sg.params]
            if any(stepped):
                work.append(_Work(sg, stepped, [p.grad for p in sg.params if p.grad is not None]))
        options = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        if self.runner is None:
            self._run(work, options)
        else:
            self.runner.submit(self._run, work, options)

    def wait(self) -> None:
        if self.runner is not None:
            self.runner.wait()

    def settle(self) -> None:
        """Wait for the step, and for the I/O it leaves running (Note [the step's I/O
        outside the step] in state.py): before counting a step's bytes."""
        self.wait()
        self._state_store.settle()

    def _run(self, work: list[_Work], options: list[dict]) -> None:
        store = self._state_store
        with torch.no_grad():  # grad mode is per thread: set it here, not only in step()
            store.begin_step()
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
            # the write-back drains behind the next forward, and the next step's first
            # sub-groups are read meanwhile (Note [the step's I/O outside the step] in state.py)
            store.finish_step([item.sg for item in work])

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
        self._state_store.close()


def _pick(values: list, idx: list[int]) -> list:
    return [values[j] for j in idx]
