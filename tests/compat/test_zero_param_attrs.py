"""DeepSpeed's attributes on ZeRO-3 partitioned parameters (`ds_id`, `ds_status`, `ds_shape`,
`ds_numel`, `ds_tensor`), live as the unit is gathered and released, absent below stage 3;
and a DeepSpeed-Chat-style save of a stage-3 model, written as its users write it, gives
the one-process model's weights exactly. World 2, gloo."""

import copy
import pickle

import pytest
import torch
from torch import nn

import meshspeed
from meshspeed import comm
from meshspeed.runtime.zero.partition_parameters import ZeroParamStatus
from meshspeed.testing import run_distributed
from tests.compat.models import batches, build, loss, one_thread


def _config(stage, threshold=0):
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10_000,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": threshold}}


def _z3_params_to_fetch(params):
    return [p for p in params if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]


def save_zero_three_model(model, global_rank: int, zero_stage: int, take: str = "clone") -> dict:
    """How DeepSpeed-Chat saves a ZeRO-3 model: gather each partitioned parameter. Its own
    code takes `v.data.cpu()`, on a CPU run the very storage the block then releases."""
    output_state_dict = {}
    for k, v in model.named_parameters():
        if hasattr(v, "ds_id"):
            with meshspeed.zero.GatheredParameters(_z3_params_to_fetch([v]), enabled=zero_stage == 3):
                v_p = v.data.clone() if take == "clone" else v.data.cpu()
        else:
            v_p = v.clone().detach()
        if global_rank == 0:
            output_state_dict[k] = v_p
    return output_state_dict


def _train_and_save(kind, stage, data, under_init, take="clone"):
    torch.manual_seed(0)
    if under_init:
        with meshspeed.zero.Init():
            model = build(kind)
    else:
        model = build(kind)
    engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=_config(stage, threshold=40))
    for batch in data:  # the same batch on every rank: the reference sees it alone
        out = loss(kind, engine, batch)
        engine.backward(out)
        engine.step()
    saved = save_zero_three_model(engine.module, comm.get_rank(), stage, take)
    saved = {k: v.clone() for k, v in saved.items()}  # read after every block was left
    return saved, [hasattr(p, "ds_id") for p in engine.module.parameters()]


@one_thread()
def _reference(kind, data):
    torch.manual_seed(0)
    model = build(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in data:
        loss(kind, model, batch).backward()
        opt.step()
        opt.zero_grad()
    return dict(model.named_parameters())


@pytest.mark.parametrize("under_init", [False, True])
@pytest.mark.parametrize("kind", ["gpt2", "gpt"])
def test_deepspeed_chat_save_gives_the_one_process_weights(kind, under_init):
    data = batches(2)
    ref = _reference(kind, data)
    (saved, has_id), (other, _) = run_distributed(_train_and_save, world_size=2,
                                                   args=(kind, 3, data, under_init))
    assert all(has_id) and other == {}
    assert saved.keys() == ref.keys()
    for name, p in ref.items():
        assert saved[name].shape == p.shape, name  # full shape, not the rank's slice
        torch.testing.assert_close(saved[name], p.detach(), rtol=0, atol=0, msg=name)


def test_deepspeed_chat_save_with_cpu_aliases_keeps_the_values():
    data = batches(2)
    ref = _reference("gpt2", data)
    (saved, _), _ = run_distributed(_train_and_save, world_size=2, args=("gpt2", 3, data, False, "cpu"))
    for name, p in ref.items():
        torch.testing.assert_close(saved[name], p.detach(), rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_no_ds_attributes_below_stage_3(stage):
    data = batches(1)
    ref = _reference("gpt", data)
    for under_init in (False, True):
        results = run_distributed(_train_and_save, world_size=2, args=("gpt", stage, data, under_init))
        assert not any(has for _, has_id in results for has in has_id)  # then saved directly
        saved = results[0][0]
        for name, p in ref.items():
            torch.testing.assert_close(saved[name], p.detach(), rtol=0, atol=0, msg=name)


class _Probe(nn.Module):
    """Records the status of a block's weight while the block runs."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __call__(self, module, args):
        self.seen.append(module.attn.wq.weight.ds_status)


def _slices_make(params, whole) -> bool:
    """ds_tensor is this rank's slice: the ranks' slices, in rank order, make the parameter."""
    slices = comm.all_gather_object({n: p.ds_tensor.clone() for n, p in params.items()})
    return all(torch.equal(torch.cat([s[n] for s in slices]), whole[n].reshape(-1)) for n in params)


def _attributes():
    torch.manual_seed(0)
    model = build("gpt")
    shapes = {n: p.shape for n, p in model.named_parameters()}
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=_config(3, threshold=40))
    params = dict(model.named_parameters())
    w = params["layers.0.attn.wq.weight"]
    out = {
        "is_parameter": all(isinstance(p, nn.Parameter) for p in params.values()),
        "ids": [p.ds_id for p in params.values()],
        "shapes": all(p.ds_shape == shapes[n] and p.ds_numel == shapes[n].numel() for n, p in params.items()),
        "placeholder": w.numel(),
        "status_outside": w.ds_status,
        "persistent_status": params["norm.weight"].ds_status,  # 32 elements <= threshold: whole
        "tensor_is_1d": all(p.ds_tensor.dim() == 1 for p in params.values()),
    }
    out["slices_make_param"] = _slices_make(params, full)
    with meshspeed.zero.GatheredParameters([w]):
        out["status_inside"] = w.ds_status
        out["shape_inside"] = tuple(w.shape)
    out["status_after"] = w.ds_status
    probe = _Probe()
    handle = model.layers[0].register_forward_pre_hook(probe)
    batch = batches(1)[0]
    engine.backward(loss("gpt", engine, batch))
    engine.step()
    handle.remove()
    out["status_in_forward"] = probe.seen
    out["status_after_step"] = w.ds_status
    # ds_tensor read after the step is the updated slice (a live view, not a stale copy)
    with meshspeed.zero.GatheredParameters(list(params.values())):
        trained = {n: p.detach().clone() for n, p in params.items()}
    out["tensor_live"] = not torch.equal(trained["layers.0.attn.wq.weight"], full["layers.0.attn.wq.weight"]) \
        and _slices_make(params, trained)
    # what leaves the model is plain: state_dict tensors, a pickled copy, a deep copy
    out["state_dict_plain"] = not any(hasattr(t, "ds_id") for t in model.state_dict().values())
    out["pickled_plain"] = not hasattr(pickle.loads(pickle.dumps(w)), "ds_id")
    out["copy_plain"] = not hasattr(copy.deepcopy(w), "ds_id")
    with pytest.raises(AttributeError):
        w.ds_shape = torch.Size([1])  # read-only
    return out


def test_attributes_follow_the_unit_state():
    for out in run_distributed(_attributes, world_size=2):
        assert out["is_parameter"]
        assert len(set(out["ids"])) == len(out["ids"]) and all(isinstance(i, int) for i in out["ids"])
        assert out["shapes"] and out["tensor_is_1d"] and out["slices_make_param"]
        assert out["placeholder"] == 0
        assert out["status_outside"] == ZeroParamStatus.NOT_AVAILABLE
        assert out["persistent_status"] == ZeroParamStatus.AVAILABLE
        assert out["status_inside"] == ZeroParamStatus.AVAILABLE and out["shape_inside"] == (32, 32)
        assert out["status_after"] == ZeroParamStatus.NOT_AVAILABLE
        assert out["status_in_forward"] == [ZeroParamStatus.AVAILABLE]
        assert out["status_after_step"] == ZeroParamStatus.NOT_AVAILABLE
        assert out["tensor_live"]
        assert out["state_dict_plain"] and out["pickled_plain"] and out["copy_plain"]


def test_deepspeed_names():
    from meshspeed.zero import ZeroParamStatus as from_zero

    assert from_zero is ZeroParamStatus
    assert [(s.name, s.value) for s in ZeroParamStatus] == [("AVAILABLE", 1), ("NOT_AVAILABLE", 2),
                                                            ("INFLIGHT", 3)]
