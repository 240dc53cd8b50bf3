"""Kernel injection (`replace_with_kernel_inject`, inject.py): plain linear layers become
oneDNN-prepacked ones on the CPU; outputs within rounding of the plain model; tensor-parallel
and quantized layers are left alone; off under ZeRO-Inference."""

import copy

import pytest
import torch
from torch import nn

import meshspeed
from meshspeed.inference.inject import PackedLinear, inject_kernels, packed_linear_supported
from tests.inference.models import PAD, build

needs_onednn = pytest.mark.skipif(not packed_linear_supported("cpu", torch.float32),
                                  reason="this torch build has no oneDNN prepacked linear")


def _logits(model, x):
    with torch.no_grad():
        out = model(x)
    return out.logits if hasattr(out, "logits") else out


@needs_onednn
@pytest.mark.parametrize("family", ["gpt", "gpt2", "llama"])
def test_every_plain_linear_is_packed_and_outputs_agree_to_rounding(family):
    """fp32: relative 1e-5 (the packed GEMM sums in another order); the dense weight read
    back from a packed layer is the original exactly."""
    torch.manual_seed(0)
    model = build(family)
    plain = [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear or type(m).__name__ == "Conv1D"]
    injected = copy.deepcopy(model)
    assert inject_kernels(injected) == len(plain) > 0
    modules = dict(injected.named_modules())
    for name, m in plain:
        assert isinstance(modules[name], PackedLinear), name
        dense = m.weight.t() if type(m).__name__ == "Conv1D" else m.weight
        assert torch.equal(modules[name].weight, dense), name
    x = torch.randint(2, 128, (3, 9), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_logits(injected, x), _logits(model, x), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_engine_injects_and_hf_generate_still_runs():
    torch.manual_seed(0)
    model = build("gpt2")
    x = torch.randint(2, 128, (2, 7), generator=torch.Generator().manual_seed(2))
    engine = meshspeed.init_inference(copy.deepcopy(model), replace_with_kernel_inject=True)
    assert engine.injected > 0
    torch.testing.assert_close(engine(x).logits, _logits(model, x), rtol=1e-5, atol=1e-5)
    ours = engine.generate(x, max_new_tokens=8, pad_token_id=PAD)
    theirs = engine.module.generate(x, max_new_tokens=8, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    assert ours.shape == theirs.shape == (2, 15)


@needs_onednn
def test_quantized_layers_are_left_alone():
    from meshspeed.inference.quant import QuantizedLinear, quantize_weights

    torch.manual_seed(0)
    model = quantize_weights(build("llama"), bits=8)
    quantized = sum(isinstance(m, QuantizedLinear) for m in model.modules())
    inject_kernels(model)
    assert sum(isinstance(m, QuantizedLinear) for m in model.modules()) == quantized > 0


def test_nothing_is_replaced_where_the_device_or_dtype_has_no_packed_kernel():
    assert not packed_linear_supported("cuda", torch.float32)
    assert not packed_linear_supported("cpu", torch.float16)
    torch.manual_seed(0)
    model = build("gpt2").half()
    assert inject_kernels(model) == 0
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_the_runners_project_qkv_through_the_registry(family):
    """The runners compute q, k, v by `kernels.fused_qkv`: forced to its packed
    implementation (one matmul over the concatenated weights; the CUDA default) the prefill
    logits agree with the three separate projections to rounding."""
    from meshspeed.inference import kernels
    from meshspeed.inference.runners import runner_for

    torch.manual_seed(0)
    model = build(family)
    prompts = [torch.randint(2, 128, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 9)]

    def prefill():
        runner = runner_for(model)
        return runner.prefill(runner.new_cache("paged", 2, 32), [0, 1], prompts)

    with kernels.use("plain"):
        plain = prefill()
    with kernels.use("packed"):
        packed = prefill()
    q_modules = [m.attn.wq if family == "gpt" else m.self_attn.q_proj
                 for m in (model.layers if family == "gpt" else model.model.layers)]
    assert all(q in kernels._packs for q in q_modules)  # every layer went through the packed matmul
    assert kernels.describe(("cpu", torch.float32))["fused_qkv"]["cpu/torch.float32"] == "plain"  # restored
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5)
