"""`init_inference`'s errors: each is one sentence naming the bad thing and what would be
right. tp_size not dividing the heads or the world size (2 gloo ranks), a checkpoint for
another model, a dtype the device cannot run, a prompt longer than max_out_tokens,
conflicting config values, unknown keys and keys asking for missing features."""

from __future__ import annotations

import pytest
import torch

from meshspeed.checkpoint.errors import CheckpointError
from meshspeed.config.errors import ConfigError
from meshspeed.inference import engine as engine_mod
from meshspeed.inference.config import load_inference_config
from meshspeed.inference.engine import check_dtype_runs, init_inference
from meshspeed.testing import run_distributed
from tests.inference.test_init_inference import build, prompt


def _error_of(family: str, tp: int, over: dict) -> str:
    try:
        init_inference(build(family, **over), tensor_parallel={"tp_size": tp})
    except ConfigError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize(("family", "tp", "over", "want"), [
    ("gpt2", 2, {"n_head": 3, "n_embd": 48}, "tensor_parallel.tp_size 2 does not divide the 3 attention heads of GPT2LMHeadModel; use a tp_size in [1, 3]"),
    ("llama", 2, {"num_key_value_heads": 1}, "tensor_parallel.tp_size 2 does not divide the 1 key/value heads of LlamaForCausalLM; use a tp_size in [1]"),
    ("gpt", 2, {"n_head": 3, "n_kv_head": 3, "d_model": 48}, "tensor_parallel.tp_size 2 does not divide the 3 attention heads of GPT"),
    ("gpt2", 4, {}, "tensor_parallel.tp_size 4 does not divide the world size 2; use one of [1, 2] or launch a multiple of 4 processes (now 2)"),
    ("gpt2", 3, {}, "tensor_parallel.tp_size 3 does not divide the world size 2"),
])
def test_tp_size_errors(family, tp, over, want):
    for message in run_distributed(_error_of, world_size=2, args=(family, tp, over)):
        assert message.startswith(want), message
        assert "\n" not in message


def test_checkpoint_for_another_model_names_the_parameter_and_shapes(tmp_path):
    from safetensors.torch import save_model

    save_model(build("gpt2", n_embd=32), str(tmp_path / "small.safetensors"))
    with pytest.raises(CheckpointError) as err:
        init_inference(build("gpt2"), checkpoint=str(tmp_path / "small.safetensors"))
    assert str(err.value) == (f"checkpoint {tmp_path / 'small.safetensors'} is for another model: "
                              "parameter 'transformer.wte.weight' has shape (128, 32) in the "
                              "checkpoint but (128, 64) in the model")


def test_checkpoint_of_another_family_names_missing_and_unexpected(tmp_path):
    from safetensors.torch import save_model

    save_model(build("gpt2", n_layer=1), str(tmp_path / "one_layer.safetensors"))
    with pytest.raises(CheckpointError, match=r"parameter 'transformer\.h\.1\.ln_1\.weight' of the "
                       r"model is not in it \(12 missing"):
        init_inference(build("gpt2"), checkpoint=str(tmp_path / "one_layer.safetensors"))
    save_model(build("gpt2", n_layer=3), str(tmp_path / "three.safetensors"))
    with pytest.raises(CheckpointError, match=r"its tensor 'transformer\.h\.2\..*' is not a parameter "
                       r"of the model \(0 missing: \[\], 12 unexpected"):
        init_inference(build("gpt2"), checkpoint=str(tmp_path / "three.safetensors"))
    with pytest.raises(CheckpointError, match="does not exist"):
        init_inference(build("gpt2"), checkpoint=str(tmp_path / "nothing_here"))


def test_meta_model_without_checkpoint():
    with torch.device("meta"):
        model = build("gpt2")
    with pytest.raises(ConfigError, match=r"^\d+ parameters of GPT2LMHeadModel are on the meta device "
                       r"\(first: 'transformer\.wte\.weight'\) and no checkpoint is given"):
        init_inference(model)
    with torch.device("meta"):
        model = build("llama")  # its rotary table is a meta buffer too
    with pytest.raises(ConfigError, match=r"^buffer 'model\.rotary_emb\.inv_freq' of LlamaForCausalLM is "
                       r"on the meta device"):
        init_inference(model, checkpoint="anything")


def test_a_dtype_the_device_cannot_run():
    check_dtype_runs(torch.float32, torch.device("cpu"))  # runs: no error
    # CPU torch has no float8 matmul: the probe itself finds that, nothing patched.
    with pytest.raises(ConfigError, match=r"^dtype: float8_e4m3fn cannot run on cpu \(a small "
                       r"matmul failed: .*\); use dtype fp32 or a device that supports it$"):
        check_dtype_runs(torch.float8_e4m3fn, torch.device("cpu"))


def test_init_inference_checks_the_dtype_before_touching_the_model(monkeypatch):
    def no_half(dtype, device):
        if dtype == torch.float16:  # what a CPU torch without fp16 kernels raises
            raise RuntimeError('"addmm_impl_cpu_" not implemented for \'Half\'')

    monkeypatch.setattr(engine_mod, "_tiny_op", no_half)
    model = build("gpt2")
    with pytest.raises(ConfigError, match=r"^dtype: float16 cannot run on \S+ \(a small matmul "
                       r"failed: \"addmm_impl_cpu_\" not implemented for 'Half'\)"):
        init_inference(model, dtype="fp16")
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # left as it was


def test_prompt_longer_than_max_out_tokens():
    engine = init_inference(build("gpt2"), max_tokens=8)
    with pytest.raises(ValueError, match=r"^prompt of 9 tokens is longer than max_out_tokens=8; "):
        engine.generate(prompt(length=9), max_new_tokens=1)
    with pytest.raises(ValueError, match="prompt of 12 tokens"):
        engine.generate([torch.arange(3), torch.arange(12)], max_new_tokens=1)


@pytest.mark.parametrize(("config", "kwargs", "want"), [
    ({"tensor_parallel": {"tp_size": 2}}, {"tensor_parallel": {"tp_size": 4}},
     "tensor_parallel.tp_size: given twice with different values, 2 and 4; give it once"),
    ({"mp_size": 2}, {"tp": {"tp_size": 4}}, "tensor_parallel.tp_size: given twice with different values, 2 and 4"),
    ({"dtype": "fp16"}, {"dtype": torch.bfloat16}, 'dtype: given twice with different values, "fp16" and "bf16"'),
    ({"max_tokens": 10}, {"max_out_tokens": 20}, "max_out_tokens: given twice with different values, 10 and 20"),
    ({"dtpye": "fp16"}, {}, "dtpye: unknown init_inference key; did you mean 'dtype'?"),
    ({}, {"tensor_parallel": {"tp_sizes": 2}}, "tensor_parallel.tp_sizes: unknown init_inference key; did you mean 'tp_size'?"),
    ({}, {"quantization": True}, "quantization: unknown init_inference key; did you mean 'quant'?"),
    ({"dtype": "int8"}, {}, "dtype: int8 is weight quantization in meshspeed, not a compute dtype"),
    ({"dtype": "fp64"}, {}, "dtype: must be one of 'fp32', 'fp16' or 'bf16' (got \"fp64\")"),
    ({"quant": {"enabled": True, "bits": 2}}, {}, "quant.bits: must be one of 8 or 4 (got 2)"),
    ({"zero": {"stage": 2}}, {}, "zero.stage: must be one of 0 or 3 (got 2)"),
    ({"save_mp_checkpoint_path": "/tmp/x"}, {}, "save_mp_checkpoint_path: meshspeed does not write"),
    ({"ep_size": 2}, {}, "ep_size 2: expert parallelism is not part of meshspeed inference"),
    ({"tensor_parallel": {"tp_group": object()}}, {}, "tensor_parallel: tp_group: a process group of one's own is not supported"),
    ([1, 2], {}, "config must be a dict, a JSON file path or None, got list"),
])
def test_config_errors(config, kwargs, want):
    with pytest.raises(ConfigError) as err:
        load_inference_config(config, **kwargs)
    assert str(err.value).startswith(want), str(err.value)


def test_bad_config_file(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not JSON"):
        load_inference_config(str(tmp_path / "bad.json"))
    with pytest.raises(ConfigError, match="cannot be read"):
        load_inference_config(str(tmp_path / "missing.json"))
