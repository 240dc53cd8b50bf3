"""A checkpoint written with one of the Adam classes loads into another: the config's "Adam"
builds DeepSpeed's FusedAdam, a script passes torch's AdamW, and both keep the same state."""

import pytest
import torch

from meshspeed.testing import run_distributed


def _resume(tmp, first: dict, second: dict):
    from meshspeed.testing.engines import small_engine, train_step

    torch.set_num_threads(1)
    tokens = torch.tensor([[1, 2, 3, 4]])
    a = small_engine(1, optimizer=first)
    train_step(a, tokens)
    a.save_checkpoint(tmp, tag="t")
    train_step(a, tokens)
    b = small_engine(1, seed=7, optimizer=second)
    b.load_checkpoint(tmp, tag="t")
    train_step(b, tokens)
    return ([p.detach().clone() for p in a.module.parameters()],
            [p.detach().clone() for p in b.module.parameters()])


@pytest.mark.parametrize(("first", "second"), [
    ({"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True, "weight_decay": 0.0}},
     {"type": "Adam", "params": {"lr": 1e-2}}),
    ({"type": "Adam", "params": {"lr": 1e-2}},
     {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True, "weight_decay": 0.0}}),
])
def test_adam_checkpoint_loads_into_fused_adam_and_back(tmp_path, first, second):
    for after_a, after_b in run_distributed(_resume, world_size=2, args=(str(tmp_path), first, second),
                                               timeout=120):
        for x, y in zip(after_a, after_b):
            assert torch.equal(x, y)


def _sgd_into_adam(tmp):
    from meshspeed.checkpoint.errors import CheckpointError
    try:
        _resume(tmp, {"type": "SGD", "params": {"lr": 1e-2}}, {"type": "Adam", "params": {"lr": 1e-2}})
    except CheckpointError as err:
        return str(err)
    return None


def test_sgd_checkpoint_still_refuses_adam(tmp_path):
    for msg in run_distributed(_sgd_into_adam, world_size=1, args=(str(tmp_path),), timeout=90):
        assert msg is not None and "holds SGD state but the engine's optimizer is FusedAdam" in msg
