"""`deepspeed.utils.safe_get_*` / `safe_set_*` at stages 0-3, fp32 and bf16, against a
one-process reference: the fp32 master weights, the averaged gradient between backward and
step, Adam's exp_avg / exp_avg_sq, full (gathered) and local (this rank's range), and
writes that the next step trains from. World 2, gloo.

fp32: each rank its own micro-batch; the reference takes the concatenated batch (1e-6).
bf16: the same micro-batch on both ranks, so that the reference is exact whatever the
stage reduces in (the average of equal gradients is the gradient)."""

import pytest
import torch

import meshspeed
from meshspeed import comm
from meshspeed.models.gpt import GPT, GPTConfig
from meshspeed.testing import run_distributed
from meshspeed.utils import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)
from tests.compat.models import one_thread

CFG = GPTConfig(vocab_size=64, max_seq_len=16, n_layer=2, n_head=2, d_model=32)
LR, EPS = 1e-4, 1e-6
TARGET = "layers.0.attn.wq.weight"  # the parameter the test writes to
KEYS = ("exp_avg", "exp_avg_sq")


def _batches(world, bf16):
    g = torch.Generator().manual_seed(9)
    data = [torch.randint(0, 64, (2 * world, 9), generator=g) for _ in range(2)]
    return [d[:2].repeat(world, 1) if bf16 else d for d in data]  # bf16: the same rows per rank


def _new_values(shape):
    return torch.linspace(-0.5, 0.5, shape.numel()).view(shape), torch.full(shape, 1e-3)


def _config(stage, bf16):
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10_000,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": EPS, "weight_decay": 0.0}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 40}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def _gather_locals(values: dict) -> dict:
    """Each rank's local ranges, concatenated in rank order."""
    every = comm.all_gather_object(values)
    return {n: torch.cat([v[n] for v in every]) for n in values}


def _run(stage, bf16, data):
    rank = comm.get_rank()
    torch.manual_seed(0)
    model = GPT(CFG)
    engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=_config(stage, bf16))
    params = dict(model.named_parameters())
    out = {"before": {n: safe_get_full_fp32_param(p) for n, p in params.items()},
           "grad_before_backward": [safe_get_full_grad(p) for p in params.values()],
           "state_before_step": [safe_get_full_optimizer_state(p, "exp_avg") for p in params.values()]}
    batch = data[0][2 * rank : 2 * rank + 2]
    engine.backward(engine(batch[:, :-1], batch[:, 1:]))
    out["grad"] = {n: safe_get_full_grad(p) for n, p in params.items()}
    out["local_grad"] = _gather_locals({n: safe_get_local_grad(p) for n, p in params.items()})
    engine.step()
    out["grad_after_step"] = [safe_get_full_grad(p) for p in params.values()]
    out["param"] = {n: safe_get_full_fp32_param(p) for n, p in params.items()}
    out["local_param"] = _gather_locals({n: safe_get_local_fp32_param(p) for n, p in params.items()})
    for key in KEYS:
        out[key] = {n: safe_get_full_optimizer_state(p, key) for n, p in params.items()}
        out[f"local_{key}"] = _gather_locals({n: safe_get_local_optimizer_state(p, key)
                                              for n, p in params.items()})
    # writes: the next step starts from them
    target = params[TARGET]
    value, moment = _new_values(out["param"][TARGET].shape)
    safe_set_full_fp32_param(target, value)
    safe_set_full_optimizer_state(target, moment, "exp_avg")
    out["read_back"] = (safe_get_full_fp32_param(target), safe_get_full_optimizer_state(target, "exp_avg"))
    with meshspeed.zero.GatheredParameters([target]):
        out["module_value"] = target.detach().float().clone()
    batch = data[1][2 * rank : 2 * rank + 2]
    engine.backward(engine(batch[:, :-1], batch[:, 1:]))
    engine.step()
    out["second"] = {n: safe_get_full_fp32_param(p) for n, p in params.items()}
    return out


@one_thread()
def _reference(bf16, data):
    """Plain torch: the model (bf16 or fp32), fp32 masters stepped by AdamW."""
    torch.manual_seed(0)
    model = GPT(CFG)
    if bf16:
        model = model.to(torch.bfloat16)
    named = dict(model.named_parameters())
    masters = {n: p.detach().float().clone().requires_grad_(True) for n, p in named.items()}
    opt = torch.optim.AdamW(list(masters.values()), lr=LR, eps=EPS, weight_decay=0.0)
    out = {"before": {n: m.detach().clone() for n, m in masters.items()}}

    def step(batch):
        rows = batch[:2] if bf16 else batch  # bf16: every rank had the same two rows
        model(rows[:, :-1], rows[:, 1:]).backward()
        grads = {}
        for n, p in named.items():
            grads[n] = p.grad.float()
            masters[n].grad = grads[n]
            p.grad = None
        opt.step()
        with torch.no_grad():
            for n, p in named.items():
                p.copy_(masters[n])
        return grads

    out["grad"] = step(data[0])
    out["param"] = {n: m.detach().clone() for n, m in masters.items()}
    for key in KEYS:
        out[key] = {n: opt.state[m][key].clone() for n, m in masters.items()}
    value, moment = _new_values(masters[TARGET].shape)
    with torch.no_grad():
        masters[TARGET].copy_(value)
        named[TARGET].copy_(value)
        opt.state[masters[TARGET]]["exp_avg"].copy_(moment)
    step(data[1])
    out["second"] = {n: m.detach().clone() for n, m in masters.items()}
    return out


def _close(got: dict, want: dict, what: str, tol: float = 1e-6) -> None:
    assert got.keys() == want.keys(), what
    for n, value in want.items():
        assert got[n].dtype == torch.float32, (what, n)
        torch.testing.assert_close(got[n], value, rtol=tol, atol=tol, msg=f"{what} {n}")


def _flat(values: dict, reps: int) -> dict:
    return {n: v.reshape(-1).repeat(reps) for n, v in values.items()}


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_safe_get_and_set_match_the_one_process_reference(stage, bf16):
    data = _batches(2, bf16)
    ref = _reference(bf16, data)
    for out in run_distributed(_run, world_size=2, args=(stage, bf16, data)):
        assert out["grad_before_backward"] == [None] * len(ref["param"])
        assert out["state_before_step"] == [None] * len(ref["param"])
        assert out["grad_after_step"] == [None] * len(ref["param"])
        _close(out["before"], ref["before"], "fp32 param before training", tol=0)
        _close(out["grad"], ref["grad"], "grad")
        _close(out["param"], ref["param"], "fp32 param after a step")
        for key in KEYS:
            _close(out[key], ref[key], key)
        # local: this rank's range; the ranks' ranges in order make the full value (stage
        # 0: every rank holds all of it, twice over here)
        reps = 2 if stage == 0 else 1
        _close(out["local_grad"], _flat(ref["grad"], reps), "local grad")
        _close(out["local_param"], _flat(ref["param"], reps), "local fp32 param")
        for key in KEYS:
            _close(out[f"local_{key}"], _flat(ref[key], reps), f"local {key}")
        value, moment = _new_values(ref["param"][TARGET].shape)
        torch.testing.assert_close(out["read_back"][0], value, rtol=0, atol=0)
        torch.testing.assert_close(out["read_back"][1], moment, rtol=0, atol=0)
        cast = value.to(torch.bfloat16).float() if bf16 else value
        torch.testing.assert_close(out["module_value"], cast, rtol=0, atol=0)  # the parameters follow
        _close(out["second"], ref["second"], "fp32 param after writing and a second step")


def _unowned():
    p = torch.nn.Parameter(torch.ones(3))
    out = [safe_get_full_fp32_param(p), safe_get_full_grad(p), safe_get_full_optimizer_state(p, "exp_avg")]
    try:
        safe_set_full_fp32_param(p, torch.zeros(3))
    except ValueError as err:
        out.append(str(err))
    return out


def test_a_parameter_no_engine_owns():
    (out,) = run_distributed(_unowned, world_size=1)
    assert out[:3] == [None, None, None]
    assert "meshspeed.initialize" in out[3]
