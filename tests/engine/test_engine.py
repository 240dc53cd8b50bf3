"""The engine's DeepSpeed-compatible surface: counters, accumulation boundary, LR, errors,
client optimizers and schedulers, and the comms logger."""

import logging

import pytest
import torch

import meshspeed
from meshspeed.models.gpt import GPT, GPTConfig
from meshspeed.testing import run_distributed

CFG = GPTConfig(vocab_size=64, max_seq_len=16, n_layer=2, n_head=2, d_model=32)


def _model():
    torch.manual_seed(0)
    return GPT(CFG)


def _batch():
    t = torch.randint(0, 64, (2, 17))
    return t[:, :-1], t[:, 1:]


def _accumulation_and_lr():
    model = _model()
    engine, opt, _, sched = meshspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-3,
                                                     "warmup_num_steps": 4, "warmup_type": "linear"}}})
    seen = []
    before = [p.detach().clone() for p in engine.module.parameters()]
    for micro in range(4):
        boundary = engine.is_gradient_accumulation_boundary()
        x, y = _batch()
        engine.backward(engine(x, y))
        engine.step()
        changed = any(not torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
        seen.append((micro, boundary, engine.global_steps, changed, engine.get_lr()))
    # methods, as in DeepSpeed (DeepSpeedExamples' train.py calls engine.gradient_accumulation_steps())
    counts = (engine.gradient_accumulation_steps(), engine.zero_optimization_stage())
    return counts, seen, opt is engine.optimizer, sched is engine.lr_scheduler


def test_step_is_a_noop_between_boundaries_and_lr_is_a_list():
    (gas, stage), seen, same_opt, same_sched = run_distributed(_accumulation_and_lr, world_size=2)[0]
    assert gas == 2  # 8 = 2 micro x 2 accumulation x 2 ranks
    assert stage == 0
    assert [s[1] for s in seen] == [False, True, False, True]
    assert [s[2] for s in seen] == [0, 1, 1, 2]
    assert seen[0][3] is False and seen[1][3] is True  # parameters move only at the boundary
    assert isinstance(seen[-1][4], list) and len(seen[-1][4]) == 1
    assert 1e-4 <= seen[1][4][0] < seen[3][4][0] < 1e-3  # warming up, one scheduler step per boundary
    assert same_opt and same_sched


def test_bad_config_raises_before_training():
    model = _model()
    with pytest.raises(meshspeed.ConfigError, match=r"zero_optimization\.stgae: unknown key; did you mean 'stage'"):
        meshspeed.initialize(model=model, config={"zero_optimization": {"stgae": 2},
                                                  "optimizer": {"type": "AdamW", "params": {"lr": 1}}})
    with pytest.raises(meshspeed.ConfigError, match=r"did you mean 'weight_decay'"):
        meshspeed.initialize(model=model, config={"optimizer": {"type": "AdamW", "params": {"weight_decy": 0.1}}})


def _triad_error():
    try:
        meshspeed.initialize(model=_model(), config={
            "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    except meshspeed.ConfigError as err:
        return str(err)
    return None


def test_batch_triad_error_names_all_numbers_and_world_size():
    message = run_distributed(_triad_error, world_size=2)[0]
    assert message is not None
    for part in ("32", "4", "2", "world size"):
        assert part in message, message


def _client_parts():
    model = _model()
    groups = [{"params": [p for n, p in model.named_parameters() if "norm" in n], "weight_decay": 0.0},
              {"params": [p for n, p in model.named_parameters() if "norm" not in n], "weight_decay": 0.1}]
    client = torch.optim.AdamW(groups, lr=1e-3)
    engine, opt, _, sched = meshspeed.initialize(
        model=model, optimizer=client, lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5),
        config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}})
    x, y = _batch()
    engine.backward(engine(x, y))
    engine.step()
    return opt is client, [g["weight_decay"] for g in opt.param_groups], engine.get_lr(), type(sched).__name__


def test_client_optimizer_groups_and_scheduler_factory_are_kept():
    same, decays, lrs, sched = run_distributed(_client_parts, world_size=2)[0]
    assert same and decays == [0.0, 0.1]
    assert lrs == [5e-4, 5e-4] and sched == "StepLR"


def _comms_logged():
    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logging.getLogger("meshspeed").addHandler(handler)
    logging.getLogger("meshspeed").setLevel(logging.INFO)
    try:
        model = _model()
        engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(), config={
            "train_micro_batch_size_per_gpu": 2, "steps_per_print": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "comms_logger": {"enabled": True}})
        for _ in range(2):
            x, y = _batch()
            engine.backward(engine(x, y))
            engine.step()
        engine.comm_logger.stop()
    finally:
        logging.getLogger("meshspeed").removeHandler(handler)
    return [m for m in records if "communication in the last" in m]


def test_comms_logger_prints_a_table_on_rank_zero_every_steps_per_print():
    per_rank = run_distributed(_comms_logged, world_size=2)
    assert len(per_rank[0]) == 1 and "all_reduce" in per_rank[0][0]
    assert per_rank[1] == []


def _memory_keys():
    model = _model()
    engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3}})
    return sorted(engine.memory_breakdown())


def test_memory_breakdown_keys():
    keys = run_distributed(_memory_keys, world_size=2)[0]
    for key in ("params", "master_params", "grads", "optimizer_state", "comm_buffers", "gathered_params"):
        assert key in keys


def _misordered_calls(stage):
    """Issue 9 case 5: step() before backward(), backward() twice, step() on a fresh engine."""
    model = _model()
    engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage}})
    out = {}
    with pytest.raises(RuntimeError) as err:
        engine.step()  # fresh engine
    out["fresh"] = (str(err.value), engine.global_steps, engine.micro_steps)
    x, y = _batch()
    engine.backward(engine(x, y))
    with pytest.raises(RuntimeError) as err:
        engine.backward(engine(x, y))
    out["twice"] = str(err.value)
    engine.step()  # the first backward's step still works
    with pytest.raises(RuntimeError) as err:
        engine.step()
    out["again"] = (str(err.value), engine.global_steps)
    engine.backward(engine(x, y))  # and training goes on normally
    engine.step()
    out["steps"] = engine.global_steps
    return out


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_misordered_step_and_backward_are_clear_errors(stage):
    for out in run_distributed(_misordered_calls, world_size=2, args=(stage,)):
        msg, steps, micro = out["fresh"]
        assert msg.startswith("engine.step() called before engine.backward()") and (steps, micro) == (0, 0)
        assert out["twice"].startswith("engine.backward() called twice without engine.step()")
        assert out["again"] == (out["again"][0], 1) and "optimizer step 1" in out["again"][0]
        assert out["steps"] == 2


def _frozen_model_error():
    model = _model()
    model.requires_grad_(False)
    try:
        meshspeed.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    except ValueError as err:
        return str(err)
    return "no error"


def test_a_model_without_trainable_parameters_is_refused():
    for msg in run_distributed(_frozen_model_error, world_size=2):
        assert msg.startswith("initialize(model=...): GPT has no trainable parameters")
        assert "requires_grad=False" in msg
