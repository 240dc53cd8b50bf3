"""eval_batch without a loss (meshspeed/engine/pipeline.py, Note [eval_batch without a
loss]): with PipelineModule(loss_fn=None) the value is the last stage's outputs, averaged
over micro-batches (and data-parallel replicas) and sent to every stage, equal to a
one-process forward; with compute_loss=False it stays on the last stage."""

import torch
from torch import nn

import meshspeed
from meshspeed.parallel.pipeline.module import LayerSpec, PipelineModule
from meshspeed.testing import run_distributed

CFG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
       "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "steps_per_print": 1000}


def _layers():
    return [LayerSpec(nn.Linear, 4, 8), nn.Tanh(), LayerSpec(nn.Linear, 8, 8), nn.Tanh(), LayerSpec(nn.Linear, 8, 3)]


def _batches(seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 4, generator=g), torch.zeros(2)) for _ in range(3)]


def _worker():
    torch.set_num_threads(1)
    net = PipelineModule(_layers(), num_stages=2, loss_fn=None, seed_layers=True)
    engine, *_ = meshspeed.initialize(model=net, config=dict(CFG))
    mean = engine.eval_batch(iter(_batches(0)))
    kept = engine.eval_batch(iter(_batches(0)), compute_loss=False)
    listed = engine.eval_batch(iter(_batches(0)), reduce_output=None)
    return {"mean": mean, "kept": kept,
            "listed": None if listed is None else [t.shape for t in listed]}


def _one_process(seed):
    torch.manual_seed(0)
    net = PipelineModule(_layers(), num_stages=1, seed_layers=True).eval()
    with torch.no_grad():
        return sum(net(x) for x, _ in _batches(seed)) / 3


def test_eval_batch_without_loss_returns_the_averaged_outputs_on_every_stage():
    out = run_distributed(_worker, world_size=2)
    expected = _one_process(0)
    for o in out:
        assert o["mean"].shape == (2, 3)
        torch.testing.assert_close(o["mean"], expected, rtol=1e-5, atol=1e-6)
    assert [o["kept"] is None for o in out] == [True, False]  # not broadcast
    torch.testing.assert_close(out[1]["kept"], expected, rtol=1e-5, atol=1e-6)
    assert [o["listed"] for o in out] == [None, [(2, 3)] * 3]
