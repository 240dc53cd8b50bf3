"""The loop each persistent rank process runs (the parent side is `pool.py`).

Wire protocol, one pickled tuple per message over a private pipe:

    parent -> worker   ("call", call_id, payload, env, sys_path)   payload = pickle((fn, args, kwargs))
                       ("stop",)
    worker -> parent   ("ready", pid) | ("startup_error", traceback_text)
                       ("ok", call_id, pickled_result, recycle)
                       ("error", call_id, failure_fields, recycle)

Plain `pickle` is used on purpose, not multiprocessing's ForkingPickler: torch registers
shared-memory reducers with the latter, which would move the caller's tensors into
shared memory as a side effect of passing them as arguments.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import random
import signal
import sys
import threading
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

MASTER_ADDR = "127.0.0.1"
_STORE_TIMEOUT = datetime.timedelta(seconds=120)


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun would set for a single-node job, plus a CPU-only device view."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "MASTER_ADDR": MASTER_ADDR,
        "MASTER_PORT": str(port),
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1",
    }


def worker_main(
    rank: int, world_size: int, port: int, parent_pid: int, stacks_path: str, conn: Any
) -> None:
    """Entry point of a rank process: join the gloo group, then serve calls until told to stop."""
    _watch_parent(parent_pid)
    stacks = open(stacks_path, "w")  # noqa: SIM115 - open for the process's lifetime
    if hasattr(signal, "SIGUSR1"):
        # The parent sends SIGUSR1 to a hung rank to learn where it is stuck.
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    base_env = rank_env(rank, world_size, port)
    try:
        os.environ.update(base_env)
        _reset_torch_state()
        store = dist.TCPStore(MASTER_ADDR, port, is_master=False, timeout=_STORE_TIMEOUT)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        dist.barrier()
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        conn.send_bytes(pickle.dumps(("startup_error", traceback.format_exc())))
        return
    conn.send_bytes(pickle.dumps(("ready", os.getpid())))
    base_cwd = os.getcwd()
    try:
        _serve(conn, base_env, base_cwd)
    finally:
        stacks.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _serve(conn: Any, base_env: dict[str, str], base_cwd: str) -> None:
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except EOFError:  # parent went away
            return
        if message[0] == "stop":
            return
        _, call_id, payload, env, sys_path = message
        _prepare_call(env, base_env, sys_path, base_cwd)
        conn.send_bytes(_run_call(call_id, payload))
        if not dist.is_initialized():  # the call destroyed the default group: retire
            return


def _prepare_call(env: dict[str, str], base_env: dict[str, str], sys_path: list[str], cwd: str):
    """Make each call start from the same state, whatever the previous call did."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)  # the caller's environment at call time ...
    os.environ.update(base_env)  # ... with the torchrun variables on top
    sys.path[:] = list(sys_path) + [p for p in sys.path if p not in sys_path]
    _reset_torch_state()
    for name in ("meshspeed.comm.counter", "meshspeed.comm.debug", "meshspeed.comm.sequence"):
        module = sys.modules.get(name)
        if module is not None:
            module.reset_for_tests()


def _reset_torch_state() -> None:
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    torch.manual_seed(0)
    random.seed(0)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(0)


def _run_call(call_id: int, payload: bytes) -> bytes:
    try:
        fn, args, kwargs = pickle.loads(payload)
        dist.barrier()  # all ranks start together; also proves the default group still works
        result = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - every failure must travel back
        return _error_reply(call_id, exc)
    recycle = not dist.is_initialized()  # the call destroyed the default group
    try:
        return pickle.dumps(("ok", call_id, pickle.dumps(_detach(result)), recycle))
    except Exception as exc:  # noqa: BLE001
        wrapped = TypeError(
            f"the return value of the function ({type(result).__name__}) could not be "
            f"pickled: {exc}. Return small tensors, numbers or containers of them."
        )
        return _error_reply(call_id, wrapped)


def _error_reply(call_id: int, exc: BaseException) -> bytes:
    fields = {
        "exc_type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        "exception": None,
    }
    try:
        fields["exception"] = pickle.dumps(exc.with_traceback(None))
    except Exception:  # noqa: BLE001, S110 - the traceback text is enough
        pass
    return pickle.dumps(("error", call_id, fields, not dist.is_initialized()))


def _detach(value: Any) -> Any:
    """Results travel as compact copies: no autograd history, no oversized base storage."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_detach(v) for v in value)
    if type(value) is dict:
        return {k: _detach(v) for k, v in value.items()}
    return value


def _watch_parent(parent_pid: int) -> None:
    """Exit if the test process dies, even while the main thread is stuck in a collective."""

    def watch() -> None:
        while True:
            time.sleep(1.0)
            try:
                os.kill(parent_pid, 0)
            except ProcessLookupError:
                os._exit(1)
            except PermissionError:
                pass

    threading.Thread(target=watch, name="meshspeed-parent-watch", daemon=True).start()
