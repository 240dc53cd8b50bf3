"""The update during the backward (Note [the update during the backward] in
meshspeed/offload/optimizer.py): with the masters and gradients in files and a step that
leaves the gradients as they are, each sub-group is updated on a background thread as
soon as its gradients are in their files.

- bit for bit the run that updates at step() (`update_in_backward: false`) and the run
  without offload (torch's reference AdamW kernel), bf16 and fp32, world 1 and 2, with
  gradient accumulation, while most sub-groups really are updated during the backward;
- off where the step changes gradients first (clipping, fp16), saying why on rank 0;
- hyperparameters changed between backward() and step() are an error, not a silent mix.
"""

from __future__ import annotations

import logging

import pytest
import torch

from meshspeed.offload import close
from meshspeed.testing import run_distributed
from meshspeed.testing.parity import ParitySetup, full_state_dict, make_batches
from tests.offload.workers import _engine, _train_batches, exact_adamw

MODEL = {"vocab_size": 256, "d_model": 64, "n_layer": 3, "n_head": 2}


def _setup(nvme: str, *, precision: str = "bf16", world: int = 2, on: bool | None = True,
           offload: bool = True, extra: dict | None = None, into_forward: bool | None = None) -> ParitySetup:
    zero = {"stage": 3, "sub_group_size": 20_000, "stage3_param_persistence_threshold": 0}
    if offload:
        oo = {"device": "nvme", "nvme_path": nvme, "buffer_count": 8}
        if on is not None:
            oo["update_in_backward"] = on
        if into_forward is not None:
            oo["update_into_forward"] = into_forward
        zero.update(offload_optimizer=oo,
                    offload_param={"device": "nvme", "nvme_path": nvme, "buffer_count": 4,
                                   "buffer_size": 1 << 14})
    extra = dict(extra or {})
    clip = extra.pop("gradient_clipping", 0.0)  # (the parity setup's default is 1.0)
    return ParitySetup(stage=3, precision=precision, model=MODEL, world=world, steps=3, gas=2, clip=clip,
                       extra_config={**exact_adamw(), **extra, "zero_optimization": zero})


def trained(s: ParitySetup) -> dict:
    engine = _engine(s)
    losses = _train_batches(engine, s, make_batches(s))
    opt = engine.optimizer
    out = {"losses": losses, "params": full_state_dict(engine),
           "early": getattr(opt, "updated_in_backward", 0),
           "in_forward": getattr(opt, "updated_in_forward", 0),
           "sub_groups": len(getattr(opt, "sub_groups", ())) * s.steps}
    close(engine)
    return out


def trained_all(setups: list[ParitySetup]) -> list[dict]:
    return [trained(s) for s in setups]


def _equal(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"], (a["losses"], b["losses"])
    differ = [k for k in a["params"] if not torch.equal(a["params"][k], b["params"][k])]
    assert not differ, differ


@pytest.mark.parametrize("precision,world", [("bf16", 2), ("fp32", 1)])
def test_equal_to_the_update_at_step_and_to_no_offload(tmp_path, precision, world):
    setups = [_setup(str(tmp_path), precision=precision, world=world, on=on) for on in (None, False)]
    setups.append(_setup(str(tmp_path), precision=precision, world=world, into_forward=False))
    setups.append(_setup(str(tmp_path), precision=precision, world=world, offload=False))
    default, at_step, backward, plain = run_distributed(trained_all, world_size=world, args=(setups,),
                                                        timeout=300)[0]
    assert at_step["early"] == 0 and at_step["in_forward"] == 0
    # update_into_forward: false: most sub-groups go during the backward (those of the units
    # whose gradients land last, the embedding's, wait for step())
    assert backward["early"] >= 0.5 * backward["sub_groups"], (backward["early"], backward["sub_groups"])
    assert backward["in_forward"] == 0
    # the default (update_into_forward): every sub-group is updated in the background,
    # during the backward or (those step() left running) into the next forward, which
    # waited for them
    assert default["early"] >= 1 and default["in_forward"] >= 1, default
    assert default["early"] + default["in_forward"] == default["sub_groups"], default
    _equal(default, at_step)
    _equal(backward, at_step)
    _equal(default, plain)


def off_and_why(s: ParitySetup, caplog_level=logging.INFO) -> tuple[int, list[str]]:
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Keep(level=caplog_level)
    logger = logging.getLogger("meshspeed")
    level = logger.level
    logger.setLevel(caplog_level)  # (a handler of the script's own: meshspeed then keeps its level)
    logger.addHandler(handler)
    try:
        out = trained(s)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return out["early"], [m for m in records if "updates after the backward" in m]


@pytest.mark.parametrize("extra,precision,why", [
    ({"gradient_clipping": 1.0}, "bf16", "gradient_clipping needs the global norm first"),
    ({}, "fp16", "fp16 unscales and checks for overflow first"),
])
def test_off_where_the_step_changes_gradients_and_says_why(tmp_path, extra, precision, why):
    s = _setup(str(tmp_path), precision=precision, world=1, extra=extra)
    early, said = run_distributed(off_and_why, world_size=1, args=(s,), timeout=300)[0]
    assert early == 0
    assert len(said) == 1 and why in said[0], said


def lr_changed_after_backward(s: ParitySetup) -> str:
    engine = _engine(s)
    batch = make_batches(s)[0]
    try:
        for i, micro in enumerate(batch):
            tokens = micro[: s.micro]
            loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            if i == len(batch) - 1:  # the boundary: sub-groups were updated during it
                for g in engine.optimizer.param_groups:
                    g["lr"] = g["lr"] / 2
            engine.step()
    except RuntimeError as err:
        return str(err)
    finally:
        close(engine)
    return "no error"


def test_hyperparameters_changed_between_backward_and_step_are_an_error(tmp_path):
    err = run_distributed(lr_changed_after_backward, world_size=1, args=(_setup(str(tmp_path), world=1),),
                          timeout=300)[0]
    assert "changed between backward() and step()" in err and "update_in_backward" in err, err


def read_right_after_step(s: ParitySetup, share: float | None) -> dict:
    """Train, the last step's masters and moments read right after its step() (while the
    updates it left running may still run), and the updates the forwards took."""
    from meshspeed.parallel.access import safe_get_full_fp32_param, safe_get_full_optimizer_state

    engine = _engine(s)
    opt = engine.optimizer
    if share is not None:
        opt._pace.share = share  # the backward leaves this much of the forward's time to the updates
    losses = _train_batches(engine, s, make_batches(s))
    named = list(engine.module.named_parameters())
    out = {"losses": losses,
           "masters": {n: safe_get_full_fp32_param(p).clone() for n, p in named},
           "exp_avg": {n: safe_get_full_optimizer_state(p, "exp_avg").clone() for n, p in named},
           "in_forward": opt.updated_in_forward, "held": len(opt._held)}
    out["params"] = full_state_dict(engine)
    close(engine)
    return out


def read_all(args: list) -> list[dict]:
    return [read_right_after_step(s, share) for s, share in args]


def test_the_updates_step_leaves_running_are_waited_for(tmp_path):
    """With update_into_forward, masters, moments and parameters read right after step()
    are those of the update at step(), whether the next forward takes a few updates or most
    (`share`: all but the first unit's held back from the backward)."""
    runs = [(_setup(str(tmp_path), on=False), None), (_setup(str(tmp_path), into_forward=True), None),
            (_setup(str(tmp_path), into_forward=True), 100.0)]
    at_step, default, most = run_distributed(read_all, world_size=2, args=(runs,), timeout=300)[0]
    for run in (default, most):
        assert run["losses"] == at_step["losses"]
        for key in ("masters", "exp_avg", "params"):
            differ = [k for k in at_step[key] if not torch.equal(at_step[key][k], run[key][k])]
            assert not differ, (key, differ)
    assert at_step["in_forward"] == 0
    assert default["in_forward"] >= 1 and most["in_forward"] >= 1 and most["held"] >= 1, (default, most)
