"""The multi-rank harness itself: results, failures, hangs, deaths, reuse, resets."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
import torch
import torch.distributed as dist

from meshspeed.testing import (
    DistributedTestError,
    DistributedTimeoutError,
    close_pools,
    harness,
    pool_pids,
    run_distributed,
    world_sizes,
)

# -- rank bodies (module level, so they travel pickled by reference) --------------------------


def _identity_and_sum(offset):
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + offset)])
    dist.all_reduce(t)
    env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    return {
        "rank": rank,
        "world": world,
        "sum": t.item(),
        "env": env,
        "master": (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]),
        "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "threads": torch.get_num_threads(),
        "backend": dist.get_backend(),
        "module_loaded": __name__ in sys.modules,
    }


def _fail_on_rank1():
    if dist.get_rank() == 1:
        raise ValueError("boom from the second rank")
    dist.barrier()  # rank 0 blocks here forever: the harness must not wait for the timeout
    return "unreachable"


def _fail_everywhere():
    raise KeyError(f"bad key on rank {dist.get_rank()}")


def _hang_on_rank0():
    if dist.get_rank() == 0:
        time.sleep(3600)
    return dist.get_rank()


def _die_on_rank1():
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def _pid():
    return os.getpid()


def _dirty_state():
    torch.set_default_dtype(torch.float64)
    os.environ["MESHSPEED_HARNESS_LEAK"] = "1"
    torch.manual_seed(1234)
    os.chdir("/")
    return torch.rand(3)


def _observe_state():
    return {
        "dtype": torch.get_default_dtype(),
        "leak": os.environ.get("MESHSPEED_HARNESS_LEAK"),
        "caller_var": os.environ.get("MESHSPEED_HARNESS_CALLER_VAR"),
        "rand": torch.rand(3),
        "cwd": os.getcwd(),
    }


def _import_by_name(name):
    module = __import__(name)
    return module.VALUE


def _unpicklable_result():
    return lambda: None


def _grad_result():
    x = torch.ones(2, requires_grad=True)
    return x * 2  # a non-leaf that requires grad; plain pickle refuses it


def _destroy_default_group():
    dist.destroy_process_group()
    return "destroyed"


# -- tests ----------------------------------------------------------------------------------


@world_sizes(1, 2, 3, 4)
def test_results_come_back_per_rank(world_size):
    results = run_distributed(_identity_and_sum, world_size, args=(10,))
    expected_sum = sum(r + 10 for r in range(world_size))
    assert [r["rank"] for r in results] == list(range(world_size))
    for rank, res in enumerate(results):
        assert res["world"] == world_size
        assert res["sum"] == expected_sum
        assert res["env"] == {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
        }
        assert res["master"][0] == "127.0.0.1" and int(res["master"][1]) > 0
        assert res["cuda_visible"] == ""
        assert res["threads"] == 1
        assert res["backend"] == "gloo"
        assert res["module_loaded"]  # the worker imported this test module by name


def test_pools_are_reused():
    first = run_distributed(_pid, 2)
    second = run_distributed(_pid, 2)
    assert first == second == pool_pids(2)
    assert len(set(first)) == 2 and os.getpid() not in first


@pytest.mark.timeout(300)  # a harness that waited out the call's timeout would hang here
def test_exception_on_one_rank_is_reported_without_waiting_for_the_timeout():
    before = run_distributed(_pid, 2)
    with pytest.raises(DistributedTestError) as info:
        # far beyond the test's own timeout: the call returns only because the harness
        # stops waiting for rank 0 (blocked in a barrier) once rank 1 has failed
        run_distributed(_fail_on_rank1, 2, timeout=3600)
    message = str(info.value)
    assert "rank 1" in message
    assert "boom from the second rank" in message
    assert "Traceback" in message and "_fail_on_rank1" in message
    assert not isinstance(info.value, DistributedTimeoutError)
    assert set(info.value.failures) == {1}
    assert info.value.unfinished == [0]
    assert isinstance(info.value.failures[1].exception, ValueError)
    assert "after the first failure" in message and "were killed" in message  # rank 0
    assert pool_pids(2) is None  # the failed pool is gone, its workers killed
    after = run_distributed(_pid, 2)
    assert set(after).isdisjoint(before)  # a fresh pool serves the next call


def test_identical_failures_are_grouped():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_fail_everywhere, 3)
    assert set(info.value.failures) == {0, 1, 2}
    assert "bad key on rank 2" in str(info.value)
    assert info.value.failures[0].exc_type == "builtins.KeyError"


@pytest.mark.timeout(300)  # rank 0 sleeps for an hour: only the call's timeout ends it
def test_hang_is_reported_as_timeout_and_pool_recovers():
    before = run_distributed(_pid, 2)
    with pytest.raises(DistributedTimeoutError) as info:
        run_distributed(_hang_on_rank0, 2, timeout=2)
    assert info.value.unfinished == [0]
    message = str(info.value)
    assert "timed out after 2s" in message and "[0]" in message
    assert "_hang_on_rank0" in message  # the hung rank's stack was dumped
    after = run_distributed(_pid, 2)
    assert set(after).isdisjoint(before)  # a new pool


def test_dead_worker_is_reported_with_exit_code():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_die_on_rank1, 2, timeout=60)
    failure = info.value.failures[1]
    assert failure.exitcode == -signal.SIGKILL
    assert "SIGKILL" in str(info.value) and "rank 1" in str(info.value)
    assert run_distributed(_pid, 2)


def test_state_is_reset_between_calls(monkeypatch):
    run_distributed(_dirty_state, 2)
    monkeypatch.setenv("MESHSPEED_HARNESS_CALLER_VAR", "seen")
    results = run_distributed(_observe_state, 2)
    torch.manual_seed(0)
    expected = torch.rand(3)
    for res in results:
        assert res["dtype"] == torch.float32
        assert res["leak"] is None
        assert res["caller_var"] == "seen"  # the caller's environment is forwarded
        assert torch.equal(res["rand"], expected)
        assert res["cwd"] == os.getcwd()


def test_sys_path_added_after_pool_start_reaches_workers(tmp_path, monkeypatch):
    run_distributed(_pid, 2)  # make sure the pool already exists
    (tmp_path / "meshspeed_harness_probe.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert run_distributed(_import_by_name, 2, args=("meshspeed_harness_probe",)) == [42, 42]


def test_unpicklable_function_is_rejected_before_any_rank_runs():
    pids = run_distributed(_pid, 2)
    with pytest.raises(TypeError, match="module level"):
        run_distributed(lambda: None, 2)
    assert run_distributed(_pid, 2) == pids  # the pool was not disturbed


def test_unpicklable_result_is_reported():
    with pytest.raises(DistributedTestError, match="could not be pickled"):
        run_distributed(_unpicklable_result, 2)


def test_tensor_results_are_detached():
    results = run_distributed(_grad_result, 2)
    assert all(torch.equal(r, torch.full((2,), 2.0)) and not r.requires_grad for r in results)


def test_destroying_the_default_group_recycles_the_pool():
    before = run_distributed(_pid, 2)
    assert run_distributed(_destroy_default_group, 2) == ["destroyed"] * 2
    after = run_distributed(_pid, 2)
    assert set(after).isdisjoint(before)


def test_at_most_max_pools_stay_alive(monkeypatch):
    monkeypatch.setattr(harness, "MAX_POOLS", 2)
    for n in (1, 2, 3):
        run_distributed(_pid, n)
    assert list(harness._pools) == [2, 3]
    close_pools()
    assert pool_pids(2) is None
    assert len(run_distributed(_pid, 2)) == 2  # pools restart on demand


def test_world_size_must_be_positive():
    with pytest.raises(ValueError):
        run_distributed(_pid, 0)


class _TwoArgError(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a}/{b}")  # unpickling calls _TwoArgError("a/b"): TypeError


def _raise_unrebuildable():
    raise _TwoArgError("left", "right")


def test_exceptions_that_cannot_be_rebuilt_still_report_their_text():
    with pytest.raises(DistributedTestError, match="left/right") as info:
        run_distributed(_raise_unrebuildable, 2)
    failure = info.value.failures[0]
    assert failure.exception is None
    assert failure.exc_type.endswith("_TwoArgError") and "Traceback" in failure.traceback
