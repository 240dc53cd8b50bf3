"""Engine methods DeepSpeed scripts call, with DeepSpeed's meaning (issue 10)."""

import pytest
import torch

from meshspeed.testing import run_distributed
from meshspeed.testing.engines import small_engine, train_step


def _accessors(stage):
    engine = small_engine(stage, gradient_accumulation_steps=2, bf16={"enabled": True})
    x = torch.randint(0, 16, (1, 4))
    applied = []
    for _ in range(4):
        train_step(engine, x)
        applied.append(engine.was_step_applied())
    return {
        "gas_call": engine.gradient_accumulation_steps(), "gas_attr": engine.gradient_accumulation_steps + 0,
        "stage_call": engine.zero_optimization_stage(), "stage_attr": int(engine.zero_optimization_stage),
        "bf16": engine.bfloat16_enabled(), "fp16": engine.fp16_enabled(),
        "rank": engine.global_rank, "world": engine.world_size, "applied": applied,
        "partition_grads": engine.zero_optimization_partition_gradients(),
    }


def test_both_spellings_and_the_simple_accessors():
    for rank, got in enumerate(run_distributed(_accessors, world_size=2, args=(2,))):
        assert got["gas_call"] == got["gas_attr"] == 2
        assert got["stage_call"] == got["stage_attr"] == 2
        assert got["bf16"] is True and got["fp16"] is False
        assert (got["rank"], got["world"]) == (rank, 2)
        assert got["applied"] == [False, True, False, True]
        assert got["partition_grads"] is True


def _params(engine):
    from meshspeed.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):
        return [p.detach().clone() for p in engine.module.parameters()]


def _manual_boundary(stage, mode):
    """Three optimizer steps of two micro-batches each: the counter's way ("counted"), or
    DeepSpeed's manual way (set_gradient_accumulation_boundary, one step() per accumulation),
    the boundary set before each forward ("before forward") or, as accelerate does, between
    the forward and the backward ("before backward")."""
    from meshspeed import comm

    engine = small_engine(stage, gradient_accumulation_steps=2)
    g = torch.Generator().manual_seed(comm.get_rank())
    for _ in range(3):
        batches = [torch.randint(0, 16, (1, 4), generator=g) for _ in range(2)]
        if mode == "counted":
            for b in batches:
                train_step(engine, b)
            continue
        for i, b in enumerate(batches):
            last = i == len(batches) - 1
            if mode == "before forward":
                engine.set_gradient_accumulation_boundary(last)
            loss = engine(b, b)
            if mode == "before backward":
                engine.set_gradient_accumulation_boundary(last)
            engine.backward(loss)
        engine.step()
    return engine.global_steps, _params(engine)


@pytest.mark.parametrize("mode", ["before forward", "before backward"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_manual_accumulation_boundary_equals_the_counted_one(stage, mode):
    counted = run_distributed(_manual_boundary, world_size=2, args=(stage, "counted"))
    manual = run_distributed(_manual_boundary, world_size=2, args=(stage, mode))
    for (steps_a, a), (steps_b, b) in zip(counted, manual):
        assert steps_a == steps_b == 3
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)


def _no_sync(use_no_sync):
    """One step over two micro-batches: the first inside no_sync, reduced with the second;
    the reference puts both losses into one backward."""
    from meshspeed import comm

    engine = small_engine(0, optimizer={"type": "SGD", "params": {"lr": 0.1}})
    g = torch.Generator().manual_seed(comm.get_rank())
    a, b = (torch.randint(0, 16, (1, 4), generator=g) for _ in range(2))
    if use_no_sync:
        with engine.no_sync():
            engine.backward(engine(a, a))
            try:
                engine.step()
            except RuntimeError as err:
                inside = str(err)
        engine.backward(engine(b, b))
    else:
        inside = None
        engine.backward(engine(a, a) + engine(b, b))
    engine.step()
    return inside, _params(engine)


def test_no_sync_defers_the_reduction_to_the_next_backward():
    with_ns = run_distributed(_no_sync, world_size=2, args=(True,))
    reference = run_distributed(_no_sync, world_size=2, args=(False,))
    for (inside, got), (_, want) in zip(with_ns, reference):
        assert "engine.step() inside engine.no_sync()" in inside
        for x, y in zip(got, want):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)
    # the replicas agree: the deferred gradients were reduced
    for x, y in zip(with_ns[0][1], with_ns[1][1]):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def _no_sync_refused():
    engine = small_engine(2)
    try:
        with engine.no_sync():
            pass
    except RuntimeError as err:
        return str(err)
    return None


def test_no_sync_is_refused_where_gradients_are_sharded():
    (msg,) = run_distributed(_no_sync_refused, world_size=1)
    assert msg is not None and "ZeRO stage 2" in msg


def _forwarding():
    from meshspeed import comm

    engine = small_engine(0)
    engine.module.custom_flag = "from the model"
    t = torch.ones(2)
    comm.all_reduce(t, "sum")  # DeepSpeed's positional order: (tensor, op, group)
    comm.all_reduce(t, comm.ReduceOp.SUM, None)
    try:
        engine.no_such_attribute  # noqa: B018 (the access is the test)
    except AttributeError as err:
        missing = str(err)
    return engine.custom_flag, t.tolist(), missing


def test_model_attributes_through_the_engine_and_deepspeed_all_reduce_order():
    for flag, t, missing in run_distributed(_forwarding, world_size=2):
        assert flag == "from the model"
        assert t == [4.0, 4.0]
        assert "no_such_attribute" in missing
