"""`pipeline.use_reentrant` and `pipeline.activation_checkpoint_interval` (meshspeed/config/
pipeline.py, applied by meshspeed/parallel/pipeline/axis.py): the config picks the pipeline
layers' checkpoint function and interval, as DeepSpeed's engine does, and the non-reentrant
checkpoint (meshspeed/parallel/activation_checkpoint.py) gives the gradients of a plain forward."""

import pytest
import torch
from torch import nn

import meshspeed
from meshspeed.config import ConfigError, load_config
from meshspeed.parallel.activation_checkpoint import (
    CheckpointPolicy,
    checkpoint,
    current_policy,
    set_policy,
)
from meshspeed.parallel.activation_checkpoint import NonReentrantCheckpointError, non_reentrant_checkpoint
from meshspeed.parallel.pipeline.module import LayerSpec, PipelineModule
from meshspeed.testing import run_distributed

BASE = {"train_micro_batch_size_per_gpu": 2}
CFG = {**BASE, "gradient_accumulation_steps": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
       "steps_per_print": 1000}


def test_the_key_loads_with_its_default():
    assert load_config(BASE).pipeline.use_reentrant is True
    cfg = load_config({**BASE, "pipeline": {"use_reentrant": False}})
    assert cfg.pipeline.use_reentrant is False and load_config(cfg.to_dict()).pipeline == cfg.pipeline
    with pytest.raises(ConfigError, match="pipeline.use_reentrant"):
        load_config({**BASE, "pipeline": {"use_reentrant": "sometimes"}})


def _layers():
    return [LayerSpec(nn.Linear, 4, 8), nn.Tanh(), LayerSpec(nn.Linear, 8, 8), nn.Tanh(), LayerSpec(nn.Linear, 8, 1)]


def _grads_worker(pipeline):
    torch.set_num_threads(1)
    net = PipelineModule(_layers(), num_stages=1, loss_fn=nn.MSELoss(), seed_layers=True)
    engine, *_ = meshspeed.initialize(model=net, config={**CFG, "pipeline": pipeline})
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(2, 4, generator=g), torch.randn(2, 1, generator=g)) for _ in range(2)]
    loss = engine.train_batch(iter(batches))
    return {"func": getattr(net.activation_checkpoint_func, "__name__", None),
            "interval": net.activation_checkpoint_interval, "loss": float(loss),
            "weights": [p.detach().clone() for p in net.parameters()]}


def test_the_config_picks_the_function_and_interval_and_training_is_unchanged():
    plain, non_reentrant, reentrant = (
        run_distributed(_grads_worker, world_size=1, args=(pipeline,))[0]
        for pipeline in ({}, {"use_reentrant": False, "activation_checkpoint_interval": 2},
                         {"activation_checkpoint_interval": 2}))
    assert (plain["func"], plain["interval"]) == (None, 0)  # None: meshspeed's checkpoint
    assert (non_reentrant["func"], non_reentrant["interval"]) == ("non_reentrant_checkpoint", 2)
    assert (reentrant["func"], reentrant["interval"]) == (None, 2)
    for run in (non_reentrant, reentrant):  # the same step as without checkpointing
        assert run["loss"] == pytest.approx(plain["loss"], rel=1e-6)
        for a, b in zip(run["weights"], plain["weights"]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_non_reentrant_checkpoint_matches_a_plain_forward_with_dropout_and_autograd_grad():
    block = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Tanh())
    x = torch.randn(3, 4, requires_grad=True)
    torch.manual_seed(1)
    plain = block(x)
    (gx_plain,) = torch.autograd.grad(plain.sum(), x)
    torch.manual_seed(1)
    out = non_reentrant_checkpoint(block, x)
    torch.testing.assert_close(out, plain)
    (gx,) = torch.autograd.grad(out.sum(), x)  # the reentrant checkpoint refuses autograd.grad
    torch.testing.assert_close(gx, gx_plain)
    with pytest.raises(RuntimeError, match="autograd.grad"):
        torch.autograd.grad(checkpoint(block, x).sum(), x)


def test_non_reentrant_refuses_sliced_or_offloaded_inputs():
    before = current_policy()
    set_policy(CheckpointPolicy(cpu=True))
    try:
        with pytest.raises(NonReentrantCheckpointError, match="cpu_checkpointing"):
            non_reentrant_checkpoint(nn.Linear(2, 2), torch.randn(1, 2))
    finally:
        set_policy(before)
