"""`run_distributed`: run a function on N gloo ranks and get each rank's return value.

Pools of persistent rank processes are kept per world size and reused by later calls,
because a suite makes hundreds of calls. Starting a pool is cheap once the forkserver
runs (~0.1 s, see Note [why forkserver] in pool.py), but each worker holds ~100 MB of
private memory, so at most `MAX_POOLS` pools live at once (least recently used closed
first); MESHSPEED_TEST_MAX_POOLS overrides it.

What a call may rely on, on every rank:
  * the default process group is initialized (gloo, `world_size` ranks, on 127.0.0.1)
    and RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT are set
    as torchrun would set them, CUDA_VISIBLE_DEVICES is "" and OMP_NUM_THREADS is 1;
  * the rest of os.environ and sys.path are the caller's at the time of the call;
  * torch.manual_seed(0), random.seed(0) (and numpy's, if imported), float32 default
    dtype, grad mode on, one intra-op thread, no active CommCounter/CommLogger, the same
    working directory as when the pool started;
  * all ranks pass a barrier just before the function runs.
Process groups a call creates (new_group, DeviceMesh) are not cleaned up; they are
cheap on gloo and the default group stays usable. Module-level state of imported
modules is not reset either.
"""

from __future__ import annotations

import atexit
import os
import pickle
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from meshspeed.testing.pool import WorkerPool

MAX_POOLS = int(os.environ.get("MESHSPEED_TEST_MAX_POOLS", "2"))

_pools: OrderedDict[int, WorkerPool] = OrderedDict()  # world size -> pool, LRU order
_lock = threading.Lock()
_atexit_registered = False


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float = 120.0,
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` gloo ranks; return [result of rank 0, ...].

    `fn` must be a module-level function (it travels pickled by reference) and `args`,
    `kwargs` and the results must be picklable; keep them small.

    Raises DistributedTestError (with every failing rank's traceback text) if `fn` raises
    on any rank or a rank process dies, and DistributedTimeoutError (naming the ranks
    that did not finish, with their stacks) if no failure was reported but not all ranks
    finished within `timeout` seconds. In both cases the pool is killed and the next
    call starts a fresh one. After one rank fails the others get a few seconds to
    report, not the full timeout.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    try:
        payload = pickle.dumps((fn, tuple(args), dict(kwargs or {})))
    except Exception as exc:  # pickling raises many exception types
        raise TypeError(
            f"run_distributed could not pickle {getattr(fn, '__qualname__', fn)!r} or its "
            f"arguments: {exc}. The function must be defined at module level in an "
            "importable module, and its arguments must be picklable."
        ) from exc
    label = f"run_distributed({_name(fn)}, world_size={world_size})"
    with _lock:
        pool = _pool_for(world_size)
        try:
            return pool.call(payload, label, timeout)
        except BaseException:
            # Failures kill the pool already; this covers interrupts (Ctrl-C, pytest-timeout)
            # arriving while ranks may be mid-call.
            pool.kill()
            raise
        finally:
            if pool.closed:
                _pools.pop(world_size, None)


def close_pools() -> None:
    """Stop every worker pool (they are restarted on demand). Safe to call at any time."""
    with _lock:
        while _pools:
            _, pool = _pools.popitem(last=False)
            pool.close()


def pool_pids(world_size: int) -> list[int] | None:
    """The worker PIDs of the live pool for `world_size`, or None (for tests of the harness)."""
    pool = _pools.get(world_size)
    return list(pool.pids) if pool is not None and pool.alive() else None


def world_sizes(*sizes: int) -> Any:
    """`@world_sizes(2, 4)` parametrizes a test over an argument `world_size`."""
    import pytest  # lazy: only under pytest

    return pytest.mark.parametrize("world_size", sizes, ids=[f"ws{n}" for n in sizes])


def _pool_for(world_size: int) -> WorkerPool:
    global _atexit_registered
    pool = _pools.get(world_size)
    if pool is not None and pool.alive():
        _pools.move_to_end(world_size)
        return pool
    if pool is not None:  # a rank died between calls
        pool.kill()
        del _pools[world_size]
    while len(_pools) >= max(1, MAX_POOLS):
        _, oldest = _pools.popitem(last=False)
        oldest.close()
    if not _atexit_registered:
        # Registered after multiprocessing's own exit hook, so it runs before it (LIFO):
        # the workers are stopped before multiprocessing joins its children.
        atexit.register(close_pools)
        _atexit_registered = True
    pool = WorkerPool(world_size)
    _pools[world_size] = pool
    return pool


def _name(fn: Any) -> str:
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", repr(fn))
    return f"{module}.{qualname}" if module else qualname
