"""Every strategy implements the engine's protocol (meshspeed/parallel/protocol.py) in full:
the engine, offload and the memory report call its methods, never probe for them."""

import inspect

import pytest

from meshspeed.parallel.data.ddp import DataParallel
from meshspeed.parallel.protocol import Strategy
from meshspeed.parallel.zero.placement import DevicePlacement
from meshspeed.parallel.zero.strategy import Zero
from meshspeed.testing import run_distributed

PROTOCOL = {name for name, _ in inspect.getmembers(Strategy) if not name.startswith("_")}


@pytest.mark.parametrize("cls", [DataParallel, Zero])
def test_strategy_classes_define_every_protocol_member(cls):
    assert PROTOCOL  # the protocol is not empty
    missing = sorted(name for name in PROTOCOL - {"master_of"} if not hasattr(cls, name))
    assert missing == [], f"{cls.__name__} lacks {missing}"


def test_offload_placement_defines_every_placement_hook():
    from meshspeed.offload.placement import OffloadPlacement

    hooks = {name for name, v in inspect.getmembers(DevicePlacement) if callable(v) and not name.startswith("_")}
    assert {"bind", "grad_shard_ready", "before_step", "attach_grads", "finish_step", "wait"} <= hooks
    assert sorted(h for h in hooks if not hasattr(OffloadPlacement, h)) == []


def _strategies():
    import torch

    import meshspeed
    from meshspeed.models.gpt import GPT, GPTConfig

    out = []
    for stage, zero in [(0, {}), (1, {}), (2, {}), (3, {}), (2, {"offload_optimizer": {"device": "cpu"}}),
                        (3, {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}})]:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=16, max_seq_len=4, n_layer=1, n_head=2, d_model=8))
        engine, *_ = meshspeed.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage, **zero}})
        s = engine.strategy
        out.append((stage, isinstance(s, Strategy), s.shards_params, len(s.grad_norm_groups())))
        meshspeed.offload.close(engine)
    return out


def test_built_strategies_are_protocol_instances():
    for rows in run_distributed(_strategies, world_size=2):
        for stage, is_strategy, shards, norm_groups in rows:
            assert is_strategy, stage
            assert shards == (stage == 3)
            assert norm_groups == (0 if stage == 0 else 1)  # replicated grads need no collective
