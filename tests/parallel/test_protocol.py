"""Every strategy implements the engine's protocol (meshspeed/parallel/protocol.py) in full,
and every capability a class declares: the engine, offload and the memory report call
their methods, never probe for them (Note [one contract for every axis])."""


import inspect

import pytest

from meshspeed.compression.scheduler import compression_scheduler
from meshspeed.offload.optimizer import OffloadOptimizer
from meshspeed.parallel import protocol
from meshspeed.parallel.data.ddp import DataParallel
from meshspeed.parallel.pipeline.axis import PipelineStep
from meshspeed.parallel.protocol import Strategy, declares
from meshspeed.parallel.zero.init_shards import InitShards
from meshspeed.parallel.zero.placement import DevicePlacement
from meshspeed.parallel.zero.strategy import Zero
from meshspeed.sequence.axis import ContextForward
from meshspeed.tensor_parallel.grads import TensorParallelGrads
from meshspeed.testing import run_distributed

PROTOCOLS = [getattr(protocol, name) for name in protocol.__all__ if name != "declares"]
CAPABILITIES = [protocol.ParameterOwner, protocol.ExternalParameters, protocol.RankState,
                protocol.LocalGradients, protocol.Closeable]
CLASSES = [DataParallel, Zero, InitShards, OffloadOptimizer, TensorParallelGrads, PipelineStep, ContextForward,
           compression_scheduler]


def _members(proto) -> set[str]:
    """What a protocol's body defines (methods, properties; annotated data aside)."""
    return {name for name in vars(proto) if not name.startswith("_")}


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_each_class_implements_what_it_declares(cls):
    declared = [p for p in PROTOCOLS if p in cls.__mro__]
    assert declared, f"{cls.__name__} declares no protocol"
    for proto in declared:
        stubs = sorted(name for name in _members(proto)
                       if getattr(cls, name, None) is getattr(proto, name, None))  # the protocol's own body
        assert stubs == [], f"{cls.__name__} declares {proto.__name__} but leaves {stubs} unimplemented"


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_a_class_that_could_declare_a_capability_does(cls):
    """Capabilities are stated in the class line: a class with every member of a protocol
    that does not declare it would be invisible to `declares`."""
    declared = [p for p in PROTOCOLS if p in cls.__mro__]
    for proto in CAPABILITIES:
        covered = any(_members(proto) <= _members(d) for d in declared)  # Closeable inside Strategy
        if all(hasattr(cls, name) for name in _members(proto)) and proto not in cls.__mro__ and not covered:
            pytest.fail(f"{cls.__name__} has every member of {proto.__name__} but does not declare it")


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
        out.append((stage, declares(s, Strategy), s.shards_params, type(s).__name__))
        meshspeed.offload.close(engine)
    return out


def test_built_strategies_are_protocol_instances():
    for rows in run_distributed(_strategies, world_size=2):
        for stage, is_strategy, shards, name in rows:
            assert is_strategy, stage
            assert shards == (stage == 3)
            assert name == ("DataParallel" if stage == 0 else "Zero")
