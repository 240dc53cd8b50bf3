"""`init_inference` with each feature switched on, through `engine.generate` (meshspeed's
runner and cache) and through Hugging Face's `engine.module.generate`, one process, fp32:
ZeRO-Inference (host-memory shards gathered by the runner's layers), INT8 weights, and
the plain engine, against Hugging Face `generate` on the untouched model."""

import copy

import pytest
import torch

import meshspeed
from tests.inference.models import PAD, build


@pytest.fixture(autouse=True)
def _no_default_group_left():
    """ZeRO-Inference starts a one-process group in this process: tear it down after, so
    later tests see the process as they would alone."""
    was = torch.distributed.is_initialized()
    yield
    if not was and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("config", [
    {},
    {"zero": {"stage": 3, "offload_param": {"device": "cpu", "buffer_count": 4}}},
    {"quant": {"enabled": True, "bits": 8, "group_size": 16}},
], ids=["plain", "zero-inference-cpu", "int8-g16"])
def test_engine_generate_agrees_with_hf_and_with_its_own_module(family, config):
    """Plain and ZeRO-Inference: token-identical to HF on the original model (the gathered
    weights are the same values). INT8: the engine's runner and HF's generate on the same
    quantized module agree token for token (the same weights either way); against the fp32
    model nothing is asserted here (INT8 moves logits by ~1% and random weights have flat
    logits: tests/inference/test_quant.py measures the agreement)."""
    torch.manual_seed(0)
    model = build(family)
    x = torch.randint(2, 128, (3, 9), generator=torch.Generator().manual_seed(1))
    ref = model.generate(x, max_new_tokens=12, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    engine = meshspeed.init_inference(copy.deepcopy(model), config=config)
    ours = engine.generate(x, max_new_tokens=12, pad_token_id=PAD)
    theirs = engine.module.generate(x, max_new_tokens=12, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    assert torch.equal(ours, theirs)
    if "quant" not in config:
        assert torch.equal(ours, ref)
    if "zero" in config:  # the runner's layers gathered and released their units
        from meshspeed.inference.zero_inference import UnitState

        assert all(u.state is UnitState.SHARDED for u in engine.zero_inference.units)
        assert all(p.numel() == 0 for u in engine.zero_inference.units for p in u.params)
