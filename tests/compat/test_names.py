"""What the DeepSpeed-path names do: pipeline layer specs, process topologies,
MoE parameter groups, DeepSpeed's Adam classes, the runtime/compression helpers."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from meshspeed.compression.helper import recursive_getattr, recursive_setattr
from meshspeed.moe.layer import MoE
from meshspeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer
from meshspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from meshspeed.pipe import (
    LayerSpec,
    PipeDataParallelTopology,
    PipelineModule,
    PipeModelDataParallelTopology,
    ProcessTopology,
    TiedLayerSpec,
)
from meshspeed.runtime.utils import see_memory_usage, set_random_seed
from meshspeed.testing import run_distributed


# -- pipe -----------------------------------------------------------------------------------
def test_layer_spec_builds_its_layer():
    spec = LayerSpec(nn.Linear, 4, 3, bias=False)
    layer = spec.build()
    assert isinstance(layer, nn.Linear) and layer.weight.shape == (3, 4) and layer.bias is None
    assert "Linear" in repr(spec)
    with pytest.raises(TypeError, match="nn.Module class"):
        LayerSpec(lambda: nn.Linear(1, 1))


def test_one_stage_pipeline_module_runs_its_layers_in_order():
    torch.manual_seed(0)
    embed = TiedLayerSpec("embed", nn.Linear, 4, 4, bias=False)
    head = TiedLayerSpec("embed", nn.Linear, 4, 4, bias=False, forward_fn=lambda m, x: x @ m.weight)
    net = PipelineModule([embed, LayerSpec(nn.Linear, 4, 4), nn.Tanh(), lambda x: x * 2, head],
                         num_stages=1, loss_fn=nn.MSELoss())
    x = torch.randn(3, 4)
    shared = net.tied_modules["embed"]
    expected = (torch.tanh(net.get_submodule("1")(shared(x))) * 2) @ shared.weight
    assert torch.allclose(net(x), expected)
    assert sorted(net.state_dict()) == ["1.bias", "1.weight", "tied_modules.embed.weight"]
    assert isinstance(net.loss_fn, nn.MSELoss) and net.topology().get_dim("pipe") == 1
    # activation checkpointing recomputes blocks and gives the same gradients
    ckpt = PipelineModule([embed, LayerSpec(nn.Linear, 4, 4), nn.Tanh(), lambda x: x * 2, head],
                          num_stages=1, activation_checkpoint_interval=2)
    ckpt.load_state_dict(net.state_dict())
    net(x).sum().backward()
    ckpt(x).sum().backward()
    for (name, a), (_, b) in zip(net.named_parameters(), ckpt.named_parameters()):
        assert torch.allclose(a.grad, b.grad), name


_TOPOLOGIES = {"pipe-data": PipeDataParallelTopology, "pipe-model-data": PipeModelDataParallelTopology}


def _refusal(kind, dims):
    """PipelineModule's error for this many stages or this topology (topologies do not pickle)."""
    kwargs = {"num_stages": dims} if kind == "num_stages" else {"topology": _TOPOLOGIES[kind](*dims)}
    try:
        PipelineModule([nn.Linear(2, 2), nn.Linear(2, 2)], **kwargs)
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.parametrize(("kind", "dims", "message"), [
    ("num_stages", 2, ("num_stages=2) on 1 rank(s): the number of stages must divide the world size; "
                       "launch a multiple of 2 processes (now 1)")),
    ("pipe-data", (2, 1), "num_stages=2) on 1 rank(s)"),
    ("pipe-model-data", (1, 2, 1), "has 2 ranks, the job has 1"),
])
def test_more_stages_than_the_job_has_ranks_is_refused(kind, dims, message):
    """(Several stages run: tests/parallel/pipeline, tests/compat/test_pipeline_example.py.)
    In a worker process, so that the test process makes no process group."""
    [got] = run_distributed(_refusal, world_size=1, args=(kind, dims))
    assert got is not None and message in got, got


def test_pipeline_module_needs_stages_and_enough_layers():
    with pytest.raises(ValueError, match="num_stages"):
        PipelineModule([nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="2 pipeline stages for 1 layers"):
        PipelineModule([nn.Linear(2, 2)], num_stages=2)
    with pytest.raises(ValueError, match="has 2 ranks, the job has 1"):
        PipelineModule([nn.Linear(2, 2)], topology=PipeModelDataParallelTopology(1, 2, 1))


def test_process_topology_rank_arithmetic():
    topo = ProcessTopology(axes=["pipe", "data", "model"], dims=[2, 2, 2])
    assert topo.world_size() == 8 and topo.get_dim("data") == 2 and topo.get_dim("nope") == 0
    assert topo.get_rank(pipe=1, data=0, model=1) == 5
    coord = topo.get_coord(6)
    assert (coord.pipe, coord.data, coord.model) == (1, 1, 0)
    assert all(topo.get_rank(**topo.get_coord(r)._asdict()) == r for r in range(8))
    assert topo.get_axis_comm_lists("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.get_axis_comm_lists("model") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.get_axis_comm_lists("nope") == []
    assert topo.filter_match(pipe=0, data=1) == [2, 3]
    assert topo.get_axis_list("data", 0) == [0, 1, 4, 5]
    assert topo.get_rank_repr(3) == "model_01"
    assert topo.get_rank_repr(3, omit_axes=[]) == "pipe_00-data_01-model_01"
    with pytest.raises(ValueError, match="every axis"):
        topo.get_rank(pipe=0)
    three = PipeModelDataParallelTopology(num_pp=2, num_mp=3, num_dp=1)
    assert three.axes == ["pipe", "data", "model"] and three.dims == [2, 1, 3]


# -- moe ------------------------------------------------------------------------------------
def test_without_moe_layers_the_groups_are_returned_unchanged():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    group = {"params": list(model.parameters()), "name": "parameters", "weight_decay": 0.1}
    out = split_params_into_different_moe_groups_for_optimizer(group)
    assert out == [group] and out[0] is group and len(group["params"]) == 4
    assert not any(is_moe_param(p) for p in model.parameters())
    groups = [{"params": [model[0].weight]}, {"params": [model[1].weight]}]
    assert split_params_into_different_moe_groups_for_optimizer(tuple(groups)) == groups


def test_expert_parameters_get_groups_of_their_own():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    for p in model[1].parameters():  # what DeepSpeed's MoE layers mark on expert weights
        p.allreduce, p.group_name = False, "ep_size_2"
    out = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "parameters", "lr": 0.1}, max_group_size=4)
    assert [(g["name"], len(g["params"]), g.get("moe", False), g["lr"]) for g in out] == [
        ("parameters", 2, False, 0.1), ("ep_size_2", 1, True, 0.1), ("ep_size_2", 1, True, 0.1)]


def test_moe_layer_builds_and_expert_parallel_training_initializes():
    """The layer exists (tests/moe); initialize hands ep_size > 1 layers the mesh's ep group
    (training parity: tests/moe/test_engine_parity.py) and refuses an ep_size that does
    not divide the data-parallel size."""
    from meshspeed.testing import run_distributed

    moe = MoE(hidden_size=8, expert=nn.Linear(8, 8), num_experts=2, ep_size=2, k=1)
    assert len(moe.deepspeed_moe.experts.deepspeed_experts) == 1
    assert "ep_size 2 does not divide the data-parallel size 1" in run_distributed(_initialize_ep2, world_size=1)[0]
    assert run_distributed(_initialize_ep2, world_size=2) == ["initialized: ep group of 2"] * 2


def _initialize_ep2() -> str:
    import meshspeed
    from meshspeed import comm
    from meshspeed.config import ConfigError

    moe = MoE(hidden_size=8, expert=nn.Linear(8, 8), num_experts=2, ep_size=2, k=1)
    try:
        meshspeed.initialize(model=nn.Sequential(moe), config={
            "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    except ConfigError as err:
        return str(err)
    return f"initialized: ep group of {comm.get_world_size(moe.deepspeed_moe.ep_group)}"


# -- ops.adam -------------------------------------------------------------------------------
def _steps(make_opt, steps: int = 3) -> torch.Tensor:
    torch.manual_seed(0)
    layer = nn.Linear(4, 4)
    opt = make_opt(layer.parameters())
    for _ in range(steps):
        layer(torch.randn(2, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return layer.weight.detach().clone()


@pytest.mark.parametrize("cls,mode", [(FusedAdam, "adam_w_mode"), (DeepSpeedCPUAdam, "adamw_mode")])
def test_deepspeed_adam_classes_mean_what_deepspeed_means(cls, mode):
    kw = {"lr": 0.1, "betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.5}
    adamw = _steps(lambda p: torch.optim.AdamW(p, **kw))
    adam_l2 = _steps(lambda p: torch.optim.Adam(p, **kw))
    assert torch.allclose(_steps(lambda p: cls(p, **kw)), adamw)  # default: decoupled decay
    assert torch.allclose(_steps(lambda p: cls(p, **kw, **{mode: False})), adam_l2)
    assert not torch.allclose(adamw, adam_l2)
    # groups as DeepSpeed-Chat builds them: generators inside dicts, read once by us, once by torch
    layer = nn.Linear(2, 2)
    opt = cls([{"params": (p for p in [layer.weight]), "weight_decay": 0.0}, {"params": layer.bias}])
    assert [len(g["params"]) for g in opt.param_groups] == [1, 1]
    with pytest.raises(NotImplementedError, match="bias_correction=False"):
        cls([nn.Parameter(torch.ones(1))], bias_correction=False)
    with pytest.raises(ValueError, match="AMSGrad"):
        cls([nn.Parameter(torch.ones(1))], amsgrad=True)


# -- runtime.utils, compression.helper ------------------------------------------------------
def test_set_random_seed_seeds_every_generator(capsys):
    draws = []
    for _ in range(2):
        set_random_seed(2**70 + 3)  # larger than numpy's and torch's seed ranges
        draws.append((random.random(), np.random.rand(), torch.rand(1).item()))
    assert draws[0] == draws[1]
    see_memory_usage("quiet")
    assert capsys.readouterr().out == ""
    see_memory_usage("loud", force=True)
    assert capsys.readouterr().out.startswith("loud\nMA ")


def test_recursive_attributes():
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2)))
    assert recursive_getattr(model, "0.0") is model[0][0]
    recursive_setattr(model, "0.0", nn.Identity())
    assert isinstance(model[0][0], nn.Identity)
