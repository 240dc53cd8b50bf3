"""Schedule offsets, the bit schedule, and the engine stepping the scheduler."""

import pytest
import torch

import meshspeed
from meshspeed.compression import compression_scheduler, init_compression
from meshspeed.compression.layers import Phase
from meshspeed.config import ConfigError
from tests.compression.models import config, gpt, group, mlp, technique, tokens

torch.set_num_threads(1)


def _phases(model):
    return {name: t.phase for m in model.modules() for name, t in getattr(m, "compression", {}).items()}


def test_each_technique_starts_at_its_offset():
    model = mlp()
    cfg = config(
        weight_quantization=technique({"schedule_offset": 0, "quantize_weight_in_forward": True},
                                      {"wq": group(["^0$"], start_bits=8, target_bits=8)}),
        sparse_pruning=technique({"schedule_offset": 2}, {"sp": group(["^2$"], dense_ratio=0.5)}),
        row_pruning=technique({}, {"rp": group(["^0$"], dense_ratio=0.5)}))  # offset 1000
    x = torch.randn(3, 8)
    reference = mlp()(x)
    init_compression(model, cfg)
    assert _phases(model) == {"weight_quantization": Phase.ACTIVE,  # offset 0: on at once
                              "sparse_pruning": Phase.WAITING, "row_pruning": Phase.WAITING}
    sched = compression_scheduler(model, cfg)
    sched.step()
    assert _phases(model)["sparse_pruning"] is Phase.WAITING
    sched.step()
    assert _phases(model)["sparse_pruning"] is Phase.ACTIVE and sched.training_steps == 2
    assert not torch.allclose(model(x), reference)
    for _ in range(997):
        sched.step()
    assert _phases(model)["row_pruning"] is Phase.WAITING
    sched.step(step_zero_check=True)  # DeepSpeed's first-forward check: no count
    assert sched.training_steps == 999
    sched.step()
    assert _phases(model)["row_pruning"] is Phase.ACTIVE
    assert sched.state_dict() == {"training_steps": 1000} and sched.weight_quantization_enabled


def test_bit_schedule_through_the_scheduler():
    model = mlp()
    cfg = config(weight_quantization=technique(
        {"schedule_offset": 3, "quantize_verbose": True},
        {"wq": group(["^0$"], start_bits=8, target_bits=4, quantization_period=2)}))
    init_compression(model, cfg)
    sched = compression_scheduler(model, cfg)
    quant = model[0].compression["weight_quantization"]
    seen = []
    for _ in range(20):
        seen.append((sched.training_steps, quant.phase is Phase.ACTIVE and quant.bits))
        sched.step()
    # quantization k = step - offset + 1: 8 bits at k=1, 7 from k=2, 6 from 4, 5 from 8, 4 from 16
    assert [b for _, b in seen] == [False, False, False, 8, 7, 7, 6, 6, 6, 6, 5, 5, 5, 5, 5, 5, 5, 5, 4, 4]
    forward = config(weight_quantization=technique(
        {"schedule_offset": 3, "quantize_weight_in_forward": True},
        {"wq": group(["^0$"], start_bits=8, target_bits=4)}))
    other = init_compression(mlp(), forward)
    compression_scheduler(other, forward).load_state_dict({"training_steps": 3})
    assert other[0].compression["weight_quantization"].bits == 4  # DeepSpeed: target at once


def _engine_config(**extra):
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
            **extra}


def test_the_engine_steps_the_scheduler_after_each_applied_step():
    cfg = config(head_pruning=technique(
        {"schedule_offset": 2, "num_heads": 4},
        {"hp": group([r"attn\.wo"], related=[[r"attn\.wq", r"attn\.wk", r"attn\.wv"]],
                     dense_ratio=0.5)}))
    model = init_compression(gpt(), cfg)
    engine, *_ = meshspeed.initialize(model=model, config=_engine_config(**cfg))
    idx = tokens()
    phases = []
    for _ in range(3):
        phases.append(_phases(engine.module)["head_pruning"])
        engine.backward(engine(idx[:, :-1], idx[:, 1:]))
        engine.step()
    assert phases == [Phase.WAITING, Phase.WAITING, Phase.ACTIVE]
    assert engine.compression_scheduler.training_steps == 3
    with pytest.raises(ConfigError, match="no compressed layers; call .*init_compression"):
        meshspeed.initialize(model=gpt(), config=_engine_config(**cfg))
