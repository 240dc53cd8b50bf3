"""Data parallelism moves exactly the gradient bytes once per optimizer step, as bucketed
all-reduces launched from backward hooks, and nothing during accumulation micro-steps."""

import pytest
import torch

import meshspeed
from meshspeed import comm
from meshspeed.engine.agreement import step_agreement_bytes
from meshspeed.models.gpt import GPT, GPTConfig
from meshspeed.testing import run_distributed


def _volumes(bucket, stage):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, max_seq_len=16, n_layer=2, n_head=2, d_model=32))
    engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket}})
    tokens = torch.randint(0, 64, (2, 17))
    counters = []
    for _ in range(2):  # one micro-step, then the boundary micro-step
        with comm.CommCounter() as c:
            engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
            engine.step()
        counters.append(c.summary())
    grad_bytes = 4 * sum(p.numel() for p in engine.module.parameters())
    return counters, grad_bytes, len(list(engine.module.parameters()))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("bucket", [10**9, 3000])
def test_one_all_reduce_of_the_gradient_bytes_per_step(world, bucket):
    (micro, boundary), grad_bytes, n_params = run_distributed(_volumes, world_size=world, args=(bucket, 0))[0]
    assert sum(op["calls"] for op in micro.values()) == 0  # no collective inside accumulation
    # the gradients, and the step agreement (Note [agreement before each step])
    agree = step_agreement_bytes(world)
    assert boundary["all_reduce"]["bytes"] == round(2 * (world - 1) / world * grad_bytes) + agree
    others = {k: v for k, v in boundary.items() if k != "all_reduce"}
    assert all(v["calls"] == 0 for v in others.values()), others
    if bucket == 10**9:
        assert boundary["all_reduce"]["calls"] == 1 + 1  # the whole model fits one bucket
    else:
        assert 1 < boundary["all_reduce"]["calls"] - 1 <= n_params


def test_stage1_reduces_only_at_the_boundary():
    (micro, boundary), _, _ = run_distributed(_volumes, world_size=2, args=(10**9, 1))[0]
    assert sum(op["calls"] for op in micro.values()) == 0
    assert boundary["reduce_scatter"]["calls"] >= 1 and boundary["all_gather"]["calls"] >= 1
