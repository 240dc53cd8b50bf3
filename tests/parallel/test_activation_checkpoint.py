"""`meshspeed.checkpointing.checkpoint` against the same block run without it: losses and
gradients bit-for-bit equal with dropout on (inside and outside the tracker's fork),
tuple outputs and non-tensor arguments, saved bytes, and at tp=2 (world 2, gloo) each
rank keeping half of the input with gradients equal to the unpartitioned run."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import meshspeed as deepspeed
from meshspeed.parallel import activation_setup
from meshspeed.parallel.activation_checkpoint import (
    CheckpointPolicy,
    checkpoint_with,
    current_policy,
)
from meshspeed.testing import run_distributed
from meshspeed.testing.memtrack import saved_activation_bytes

D = 16


class _Block(nn.Module):
    """Two linears with dropout after each: the first on the default generator, the second
    on the tracker's model-parallel state."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        h = torch.dropout(torch.relu(self.fc1(x)), 0.5, True)
        with deepspeed.checkpointing.get_cuda_rng_tracker().fork():
            return torch.dropout(self.fc2(h), 0.3, True)


def _mlp(width: int = D, layers: int = 4) -> nn.Sequential:
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])


def _run(block, x0, ckpt, seed=3):
    """Loss, input gradient, parameter gradients and the next random number, from `seed`."""
    deepspeed.checkpointing.model_parallel_cuda_manual_seed(seed)
    block.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_()
    y = deepspeed.checkpointing.checkpoint(block, x) if ckpt else block(x)
    loss = torch.dropout(y, 0.2, True).square().sum()  # dropout after: the stream must go on
    loss.backward()
    return [loss.detach(), x.grad, *(p.grad for p in block.parameters()), torch.rand(3)]


def _equal(a, b) -> bool:
    return all(torch.equal(u, v) for u, v in zip(a, b, strict=True))


@pytest.fixture(autouse=True)
def _fresh():
    activation_setup._clear()
    yield
    activation_setup._clear()
    deepspeed.checkpointing.get_cuda_rng_tracker().reset()


def test_dropout_parity_bit_for_bit():
    torch.manual_seed(0)
    block, x0 = _Block(), torch.randn(4, D)
    ref = _run(block, x0, ckpt=False)
    assert _equal(ref, _run(block, x0, ckpt=True))
    assert not _equal(ref, _run(block, x0, ckpt=True, seed=4))  # the masks do depend on the seed


def test_tuple_outputs_non_tensor_args_and_a_passed_through_input():
    torch.manual_seed(0)
    mlp, x0, mask = _mlp(), torch.randn(3, D), torch.tensor([1, 0, 1])

    def layer(x, scale, mask, name):
        return mlp(x) * scale, mask, name, x

    def grads(ckpt):
        mlp.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        args = (x, 0.5, mask, "tag")
        out = deepspeed.checkpointing.checkpoint(layer, *args) if ckpt else layer(*args)
        (out[0].sum() + (out[3] * 2).sum()).backward()
        return out, [x.grad, *(p.grad for p in mlp.parameters())]

    (ref_out, ref), (out, got) = grads(False), grads(True)
    assert isinstance(out, tuple) and out[2] == "tag" and torch.equal(out[1], mask)
    assert torch.equal(out[0], ref_out[0]) and not out[1].requires_grad
    assert _equal(ref, got)


def test_a_block_whose_inputs_need_no_grad_still_trains():
    torch.manual_seed(0)
    mlp, x = _mlp(), torch.randn(2, D)  # x requires no grad, as a frozen embedding's output
    mlp(x).sum().backward()
    ref = [p.grad.clone() for p in mlp.parameters()]
    mlp.zero_grad(set_to_none=True)
    deepspeed.checkpointing.checkpoint(mlp, x).sum().backward()
    assert _equal(ref, [p.grad for p in mlp.parameters()])


def test_no_grad_is_a_plain_call_and_autograd_grad_is_refused():
    mlp, x = _mlp(), torch.randn(2, D, requires_grad=True)
    with torch.no_grad():
        assert not deepspeed.checkpointing.checkpoint(mlp, x).requires_grad
    y = deepspeed.checkpointing.checkpoint(mlp, x).sum()
    with pytest.raises(RuntimeError, match=r"torch.autograd.grad\(\) cannot reach them"):
        torch.autograd.grad(y, x)
    with pytest.raises(TypeError, match="must be callable"):
        deepspeed.checkpointing.checkpoint(x, mlp)
    with pytest.raises(TypeError, match="returned a dict"):
        deepspeed.checkpointing.checkpoint(lambda t: {"y": t * 2}, x)


def test_saved_bytes_are_the_input_alone():
    torch.manual_seed(0)
    mlp, x = _mlp(width=256), torch.randn(32, 256, requires_grad=True)
    plain = saved_activation_bytes(mlp, x)
    ckpt = saved_activation_bytes(lambda t: deepspeed.checkpointing.checkpoint(mlp, t), x,
                                  params=mlp.parameters())
    input_bytes = x.numel() * x.element_size()
    assert ckpt == input_bytes == 32768
    assert plain == 5 * input_bytes  # the input and four ReLU outputs (each next Linear's input)


def test_cpu_checkpointing_keeps_inputs_in_host_memory_and_profile_logs(caplog):
    devices = []

    def pack(t):
        devices.append(t.device.type)
        return t

    mlp, x = _mlp(), torch.randn(2, D, requires_grad=True)
    policy = CheckpointPolicy(cpu=True, synchronize=True, profile=True)
    with caplog.at_level(logging.INFO, logger="meshspeed"):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = checkpoint_with(policy, mlp, x)
        y.sum().backward()
    assert devices == ["cpu"] and x.grad is not None
    assert "activation checkpoint Sequential: forward" in caplog.text
    assert "activation checkpoint Sequential: recompute and backward" in caplog.text


# -- the RNG tracker --------------------------------------------------------------------------

def test_tracker_fork_draws_from_its_own_stream_and_restores_the_default():
    tracker = deepspeed.checkpointing.get_cuda_rng_tracker()
    tracker.add("mine", 11)
    torch.manual_seed(0)
    expected_default = torch.rand(4)
    torch.manual_seed(0)
    with tracker.fork("mine"):
        first = torch.rand(2)
    with tracker.fork("mine"):
        second = torch.rand(2)
    assert torch.equal(torch.rand(4), expected_default)  # the default stream never moved
    torch.manual_seed(11)
    assert torch.equal(torch.cat([first, second]), torch.rand(4))  # "mine" went on where it stopped

    snapshot = tracker.get_states()
    with tracker.fork("mine"):
        again = torch.rand(2)
    tracker.set_states(snapshot)
    with tracker.fork("mine"):
        assert torch.equal(torch.rand(2), again)

    with pytest.raises(KeyError, match="no state named 'other'"), tracker.fork("other"):
        pass
    with pytest.raises(ValueError, match="exists already"):
        tracker.add("mine", 12)
    with pytest.raises(ValueError, match="seed 11 is used"):
        tracker.add("yours", 11)
    tracker.reset()
    with pytest.raises(KeyError, match="or call model_parallel_cuda_manual_seed"), tracker.fork():
        pass


def test_model_parallel_seed_is_megatrons_offset():
    deepspeed.checkpointing.model_parallel_cuda_manual_seed(5)
    default = torch.rand(2)
    with deepspeed.checkpointing.get_cuda_rng_tracker().fork():
        parallel = torch.rand(2)
    torch.manual_seed(5)
    assert torch.equal(default, torch.rand(2))
    torch.manual_seed(5 + 2718)  # tp rank 0
    assert torch.equal(parallel, torch.rand(2))
    with pytest.raises(TypeError, match="must be an int"):
        deepspeed.checkpointing.model_parallel_cuda_manual_seed("5")


# -- configure() ---------------------------------------------------------------------------------

def test_configure_arguments_override_the_config(tmp_path):
    block = {"partition_activations": True, "cpu_checkpointing": True, "profile": True}
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 8, "activation_checkpointing": '
                    '{"partition_activations": true, "cpu_checkpointing": true, "profile": true}}')
    from meshspeed.config import load_config

    for source in ({"activation_checkpointing": block}, str(path),
                   load_config({"train_micro_batch_size_per_gpu": 1, "activation_checkpointing": block})):
        deepspeed.checkpointing.configure(None, deepspeed_config=source, checkpoint_in_cpu=False)
        policy = current_policy()
        assert deepspeed.checkpointing.is_configured()
        assert (policy.partition, policy.cpu, policy.profile, policy.size) == (True, False, True, 1)
    deepspeed.checkpointing.configure(None, synchronize=True)  # a new call starts from the defaults
    assert (current_policy().partition, current_policy().synchronize) == (False, True)


@pytest.mark.parametrize("kwargs, message", [
    ({"deepspeed_config": {"activation_checkpointing": {"partition_activation": True}}},
     "activation_checkpointing.partition_activation: unknown key; did you mean 'partition_activations'"),
    ({"deepspeed_config": {"activation_checkpointing": {"profile": "yes"}}},
     'activation_checkpointing.profile: expected true or false (got "yes")'),
    ({"deepspeed_config": 3}, "config must be a path to a JSON file"),
    ({"checkpoint_in_cpu": 1}, "configure(checkpoint_in_cpu=...): expected True or False, got 1"),
    ({"num_checkpoints": 0}, "configure(num_checkpoints=...): expected a positive integer, got 0"),
    ({"contiguous_checkpointing": True, "num_checkpoints": 4},
     "contiguous_memory_optimization needs partition_activations"),
    ({"contiguous_checkpointing": True, "partition_activations": True},
     "contiguous_memory_optimization needs number_checkpoints"),
])
def test_configure_errors_name_the_key_and_the_fix(kwargs, message):
    from meshspeed.config import ConfigError

    with pytest.raises(ConfigError) as info:
        deepspeed.checkpointing.configure(None, **kwargs)
    assert message in str(info.value)
    assert not deepspeed.checkpointing.is_configured()


def test_configure_refuses_an_object_that_is_no_mpu():
    with pytest.raises(TypeError, match=r"has neither get_model_parallel_group\(\).*nor group\('tp'\)"):
        deepspeed.checkpointing.configure(object())


def test_both_import_paths_and_the_no_effect_report():
    from meshspeed.config import load_config
    from meshspeed.config.no_effect import report_no_effect
    from meshspeed.runtime.activation_checkpointing import checkpointing

    assert checkpointing.checkpoint is deepspeed.checkpointing.checkpoint
    assert deepspeed.runtime.activation_checkpointing.checkpointing.configure is checkpointing.configure
    notes = report_no_effect(load_config({"train_micro_batch_size_per_gpu": 1, "activation_checkpointing": {
        "partition_activations": True, "cpu_checkpointing": True, "synchronize_checkpoint_boundary": True,
        "profile": True, "contiguous_memory_optimization": True, "number_checkpoints": 4}}))
    assert [n.split("=")[0] for n in notes] == ["activation_checkpointing.contiguous_memory_optimization",
                                                "activation_checkpointing.number_checkpoints"]


# -- tp=2, world 2 ----------------------------------------------------------------------------------

class _Mpu:
    """Megatron's mpu surface over a group."""

    def __init__(self, group):
        self.group_ = group

    def get_model_parallel_group(self):
        return self.group_


def _tp2_partition():
    from meshspeed import comm
    from meshspeed.topology import ParallelDims, build_topology

    activation_setup._clear()
    topo = build_topology(ParallelDims(comm.get_world_size(), tp=2))
    torch.manual_seed(0)  # the same block and input on both ranks, as in a tp group
    block, x0 = _Block(), torch.randn(3, 5, D)  # 240 elements
    odd = torch.randn(7)  # 7 elements: padded to 8, 4 per rank
    deepspeed.checkpointing.configure(topo, partition_activations=True)
    ref = _run(block, x0, ckpt=False)
    got = _run(block, x0, ckpt=True)

    def two_args(x, y):
        return block(x), y * 3

    saved = saved_activation_bytes(lambda x, y: deepspeed.checkpointing.checkpoint(two_args, x, y),
                                   x0.clone().requires_grad_(), odd.clone().requires_grad_(),
                                   params=block.parameters())
    y = odd.clone().requires_grad_()
    deepspeed.checkpointing.checkpoint(two_args, x0, y)[1].sum().backward()
    odd_grad_ok = torch.equal(y.grad, torch.full((7,), 3.0))

    deepspeed.checkpointing.configure(_Mpu(topo.group("tp")), partition_activations=True)
    policy = current_policy()
    deepspeed.checkpointing.model_parallel_cuda_manual_seed(9)
    with deepspeed.checkpointing.get_cuda_rng_tracker().fork():
        parallel = torch.rand(2)
    default = torch.rand(2)
    torch.manual_seed(9 + 2718 + topo.coord("tp"))
    return {"equal": _equal(ref, got), "saved": saved, "odd_grad_ok": odd_grad_ok,
            "mpu": (policy.partition, policy.size, policy.rank),
            "own_stream": torch.equal(parallel, torch.rand(2)), "default": default}


def test_tp2_each_rank_keeps_half_and_gradients_match():
    r0, r1 = run_distributed(_tp2_partition, world_size=2)
    for rank, r in enumerate((r0, r1)):
        assert r["equal"] and r["odd_grad_ok"] and r["own_stream"]
        assert r["saved"] == (3 * 5 * D // 2 + 4) * 4  # half of 240 floats, 4 of 7 padded to 8
        assert r["mpu"] == (True, 2, rank)
    assert torch.equal(r0["default"], r1["default"])  # the default stream is shared by the tp group


def _through_initialize():
    from meshspeed.testing.engines import small_engine

    activation_setup._clear()
    block = {"partition_activations": True, "cpu_checkpointing": True}
    small_engine(tensor_parallel={"autotp_size": 2}, activation_checkpointing=block)
    applied = (deepspeed.checkpointing.is_configured(), current_policy().partition,
               current_policy().cpu, current_policy().size)
    deepspeed.checkpointing.configure(None, profile=True)  # explicit: initialize keeps it
    small_engine(tensor_parallel={"autotp_size": 2}, activation_checkpointing=block)
    kept = (current_policy().partition, current_policy().profile, current_policy().size)
    activation_setup._clear()
    small_engine(tensor_parallel={"autotp_size": 2})  # no block: nothing configured
    return applied, kept, deepspeed.checkpointing.is_configured()


def test_initialize_applies_the_block_with_the_tp_group_unless_configure_came_first():
    applied, kept, unset = run_distributed(_through_initialize, world_size=2)[0]
    assert applied == (True, True, True, 2)
    assert kept == (False, True, 2)  # configure() reset partition; the group stays from before
    assert unset is False


def test_autocast_in_forward_is_autocast_in_the_recompute():
    torch.manual_seed(0)
    mlp, x0 = _mlp(), torch.randn(2, D)

    def grads(ckpt):
        mlp.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = deepspeed.checkpointing.checkpoint(mlp, x) if ckpt else mlp(x)
        y.float().sum().backward()
        return [y.detach(), x.grad, *(p.grad for p in mlp.parameters())]

    ref = grads(False)
    assert ref[0].dtype == torch.bfloat16 and _equal(ref, grads(True))


def test_deepspeeds_single_setters():
    deepspeed.checkpointing.partition_activations_in_checkpoint(True)
    deepspeed.checkpointing.set_num_layers(6)
    assert current_policy().partition and activation_setup._setting.block.number_checkpoints == 6
    with pytest.raises(ValueError, match="expected a positive integer"):
        deepspeed.checkpointing.set_num_layers(-1)
    deepspeed.checkpointing.reset()  # nothing buffered: the configuration stays
    assert deepspeed.checkpointing.is_configured() and current_policy().partition


def test_tensors_passed_by_keyword_get_gradients():
    torch.manual_seed(0)
    mlp, x0, b0 = _mlp(), torch.randn(2, D), torch.randn(D)

    def layer(x, bias, scale):
        return mlp(x + bias) * scale

    def grads(ckpt):
        x, bias = x0.clone().requires_grad_(), b0.clone().requires_grad_()
        if ckpt:
            out = deepspeed.checkpointing.checkpoint(layer, x, bias=bias, scale=2.0)
        else:
            out = layer(x, bias=bias, scale=2.0)
        out.sum().backward()
        return [x.grad, bias.grad]

    assert _equal(grads(False), grads(True))
