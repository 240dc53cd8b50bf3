"""DeepSpeed's `deepspeed.comm` extras (inference_all_reduce, coalesced and object collectives,
group queries), `deepspeed.checkpointing` (checkpoint, non_reentrant_checkpoint, the module
globals) and `deepspeed.runtime.utils` (clip_grad_norm_, get_global_norm, call_to_str)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import meshspeed as deepspeed
from meshspeed.compat.deepspeed import comm as ds_comm
from meshspeed.compat.deepspeed.runtime import utils as ds_utils
from meshspeed.compat.deepspeed.runtime.activation_checkpointing import checkpointing as ds_ckpt
from meshspeed.parallel import activation_setup
from meshspeed.parallel.activation_checkpoint import current_policy
from meshspeed.testing import run_distributed

# -- deepspeed.comm on 2 ranks ----------------------------------------------------------------------


def _comm_on_two_ranks() -> dict:
    torch.set_num_threads(1)
    rank = ds_comm.get_rank()
    out = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.full((1, 3), float(rank + 1), dtype=dtype)
        ds_comm.inference_all_reduce(x)
        out[str(dtype)] = (x.dtype, x.tolist())
    a, b = torch.full((2, 2), rank + 1.0), torch.arange(3) * (rank + 1)
    ds_comm.all_reduce_coalesced([a, b])
    out["coalesced"] = (a.tolist(), b.tolist())
    gathered = [None, None]
    ds_comm.all_gather_object(gathered, {"rank": rank})
    out["objects"] = gathered
    shared = [f"from {rank}", rank]
    ds_comm.broadcast_object_list(shared, src=1)
    out["broadcast"] = shared
    out["ranks"] = ds_comm.get_all_ranks_from_group(ds_comm.get_world_group())
    # identical gradients on both ranks: torch's result; different ones: averaged norm
    same = [nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))]
    same[0].grad, same[1].grad = torch.tensor([1.0]), torch.tensor([1.0])
    out["same_norm"] = float(ds_utils.clip_grad_norm_(same, max_norm=0.1))
    out["same_grads"] = [p.grad.item() for p in same]
    moe = nn.Parameter(torch.zeros(1))
    moe.grad = torch.tensor([3.0 * (rank + 1)])
    out["moe_norm"] = float(ds_utils.clip_grad_norm_([moe], max_norm=100.0))
    return out


def test_comm_extras_and_clip_grad_norm_on_two_ranks():
    r0, r1 = run_distributed(_comm_on_two_ranks, 2)
    for r in (r0, r1):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            assert r[str(dtype)] == (dtype, [[3.0, 3.0, 3.0]])  # 1 + 2, dtype kept
        assert r["coalesced"] == ([[3.0, 3.0], [3.0, 3.0]], [0, 3, 6])
        assert r["objects"] == [{"rank": 0}, {"rank": 1}]
        assert r["broadcast"] == ["from 1", 1]
        assert r["ranks"] == [0, 1]
        assert r["same_norm"] == pytest.approx(math.sqrt(2), rel=1e-6)
        assert r["same_grads"] == pytest.approx([0.1 / (math.sqrt(2) + 1e-6)] * 2, rel=1e-6)
        assert r["moe_norm"] == pytest.approx((3.0 + 6.0) / 2)  # each rank's norm, averaged


def test_clip_grad_norm_matches_torch_and_refuses_no_gradients():
    def params():
        ps = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2))]
        ps[0].grad, ps[1].grad = torch.tensor([1.0, -2.0, 3.0]), torch.tensor([0.5, 4.0])
        return ps

    for norm_type in (2, 1, math.inf):
        expected, actual = params(), params()
        want = torch.nn.utils.clip_grad_norm_(expected, 1.0, norm_type=norm_type)
        got = ds_utils.clip_grad_norm_(actual, max_norm=1.0, norm_type=norm_type)
        assert float(got) == pytest.approx(float(want), rel=1e-6)
        for e, a in zip(expected, actual):
            torch.testing.assert_close(a.grad, e.grad, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="none of the parameters has a gradient"):
        ds_utils.clip_grad_norm_([nn.Parameter(torch.zeros(1))], max_norm=1.0)


def test_get_global_norm_and_call_to_str():
    assert ds_utils.get_global_norm([3.0, torch.tensor(4.0)]) == 5.0
    assert ds_utils.get_global_norm([1.0, float("nan")]) == float("inf")
    assert ds_utils.get_global_norm([1.0, -1]) == float("inf")  # DeepSpeed's overflow marker
    assert ds_utils.call_to_str("int") == "int()"
    assert ds_utils.call_to_str("f", 3, "jeff", val=3) == "f(3, 'jeff', val=3)"


# -- checkpoint and non_reentrant_checkpoint against no checkpointing ------------------------------

class _Block(nn.Module):
    """Takes a non-tensor argument and a mask; returns a tensor that requires grad, a
    non-tensor, a tensor that needs no grad and the mask back."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.drop = nn.Dropout(0.3)

    def forward(self, x, scale, mask, extra=None):
        h = self.drop(torch.tanh(self.lin(x))) * scale
        h = h * mask.to(h.dtype)
        if extra is not None:
            h = h + extra[1]
        return h, "tag", torch.ones(2) * scale, mask


def _run(fn, seed: int, **inputs_kw):
    torch.manual_seed(0)
    block = _Block()
    x = torch.randn(4, 6, requires_grad=True)
    mask = torch.tensor([True, False, True, True, False, True])
    torch.manual_seed(seed)  # the dropout masks
    out = fn(block, x, 1.5, mask, (None, 0.25)) if fn else block(x, 1.5, mask, (None, 0.25))
    out[0].sum().backward()
    return out, x.grad, [p.grad for p in block.parameters()]


@pytest.mark.parametrize("which", ["checkpoint", "non_reentrant_checkpoint"])
def test_checkpoint_matches_no_checkpointing(which):
    fn = getattr(deepspeed.checkpointing, which)
    ref_out, ref_xg, ref_pg = _run(None, seed=7)
    out, xg, pg = _run(fn, seed=7)
    assert isinstance(out, tuple) and len(out) == 4
    torch.testing.assert_close(out[0], ref_out[0], rtol=1e-6, atol=1e-6)
    assert out[1] == "tag"
    assert torch.equal(out[2], ref_out[2]) and torch.equal(out[3], ref_out[3])
    assert out[3].dtype == torch.bool and not out[3].requires_grad
    torch.testing.assert_close(xg, ref_xg, rtol=1e-6, atol=1e-6)
    for g, ref in zip(pg, ref_pg, strict=True):
        torch.testing.assert_close(g, ref, rtol=1e-6, atol=1e-6)
    if which == "non_reentrant_checkpoint":  # what the block returns, as it returns it
        assert not out[2].requires_grad


def test_non_reentrant_supports_autograd_grad_and_inputs_without_grad():
    torch.manual_seed(0)
    lin = nn.Linear(5, 5)
    x = torch.randn(3, 5)  # no input requires grad: the parameters still get gradients
    out = ds_ckpt.non_reentrant_checkpoint(lin, x)
    (gw,) = torch.autograd.grad(out.sum(), [lin.weight])
    torch.testing.assert_close(gw, torch.ones(3, 5).t() @ x, rtol=1e-6, atol=1e-6)
    with torch.no_grad():  # a plain call
        assert not ds_ckpt.non_reentrant_checkpoint(lin, x).requires_grad


def test_non_reentrant_recompute_draws_the_trackers_stream_again():
    tracker = deepspeed.checkpointing.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("model-parallel-rng", 1234)

    def block(x):
        with tracker.fork():
            return torch.nn.functional.dropout(x, 0.5) * 2

    try:
        x = torch.ones(64, requires_grad=True)
        out = ds_ckpt.non_reentrant_checkpoint(block, x)
        out.sum().backward()
        # d(out)/dx is the forward's own mask times 2 / 0.5: the recompute drew the same mask
        torch.testing.assert_close(x.grad, (out.detach() != 0).float() * 4.0)
    finally:
        tracker.reset()


# -- the module and its DeepSpeed globals ------------------------------------------------------------

@pytest.fixture
def _fresh_setting():
    activation_setup._clear()
    yield
    activation_setup._clear()


def test_one_module_under_both_names_with_deepspeeds_globals(_fresh_setting):
    assert deepspeed.checkpointing is ds_ckpt
    assert (ds_ckpt.PARTITION_ACTIVATIONS, ds_ckpt.num_layers, ds_ckpt.mpu, ds_ckpt.mp_size,
            ds_ckpt.deepspeed_checkpointing_enabled) == (False, None, None, 1, False)
    ds_ckpt.configure(None, synchronize=True, num_checkpoints=3)
    assert (ds_ckpt.SYNCHRONIZE, ds_ckpt.num_layers, ds_ckpt.deepspeed_checkpointing_enabled) == (True, 3, True)
    ds_ckpt.CPU_CHECKPOINT = True  # an assignment changes the setting in force
    assert current_policy().cpu and ds_ckpt.CPU_CHECKPOINT
    ds_ckpt.deepspeed_checkpointing_enabled = False
    assert not ds_ckpt.is_configured()
    with pytest.raises(ValueError, match="expected true or false"):
        ds_ckpt.PROFILE_TIME = "yes"


def test_contiguous_without_a_count_is_an_assertion_and_a_config_error(_fresh_setting):
    from meshspeed.config import ConfigError

    with pytest.raises(AssertionError, match="number of layers") as info:
        ds_ckpt.configure(mpu_=None, partition_activations=True, contiguous_checkpointing=True)
    assert isinstance(info.value, ConfigError)
    assert not ds_ckpt.is_configured() and not ds_ckpt.PARTITION_ACTIVATIONS
