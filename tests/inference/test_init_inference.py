"""`meshspeed.init_inference`: DeepSpeed's four calling forms and key spellings, forward
parity with the unsplit model (fp32, exact at tp=1; tp=2 on 2 gloo ranks within 1e-5,
the all-reduce summing partial products in another order), whole-vocabulary logits on
every rank, Hugging Face `engine.module.generate` token-identical to the unsplit model's,
the quantization / ZeRO-Inference hand-offs, and the deepspeed alias names.

Also the tiny model builders the other inference API tests import."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch

import meshspeed
from meshspeed.inference.config import InferenceConfig, load_inference_config
from meshspeed.inference.engine import InferenceEngine, init_inference
from meshspeed.testing import run_distributed

VOCAB = 128


def build(family: str, seed: int = 0, **over) -> torch.nn.Module:
    """A fresh tiny fp32 model of `family` ("gpt2", "llama", "gpt"); `over` changes config keys."""
    torch.manual_seed(seed)
    if family == "gpt2":
        import transformers

        cfg = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": VOCAB, "n_positions": 64, "bos_token_id": 0,
                   "eos_token_id": 1, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**cfg, **over})).float().eval()
    if family == "llama":
        import transformers

        cfg = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 128,
                   "bos_token_id": 0, "eos_token_id": 1}
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**cfg, **over})).float().eval()
    from meshspeed.models.gpt import GPT, GPTConfig

    cfg = {"vocab_size": VOCAB, "max_seq_len": 64, "n_layer": 2, "n_head": 4, "n_kv_head": 2, "d_model": 64}
    return GPT(GPTConfig(**{**cfg, **over})).float().eval()


def device() -> torch.device:
    """Where init_inference puts a CPU model in this process (it moves models to the GPU
    when there is one, as DeepSpeed does); references are run there too, so that exact
    comparisons compare the same kernels."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    """The model's logits for ids (moved to the model's device), on the CPU."""
    param = next(model.parameters()) if isinstance(model, torch.nn.Module) else None
    with torch.no_grad():
        out = model(ids.to(param.device) if param is not None else ids)
    return (out if torch.is_tensor(out) else out.logits).cpu()


def hf_generate(model, ids: torch.Tensor, new: int) -> torch.Tensor:
    """Greedy Hugging Face generate on the model's device; the tokens on the CPU."""
    ids = ids.to(next(model.parameters()).device)
    return model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0).cpu()


def prompt(batch: int = 2, length: int = 8, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (batch, length), generator=g)


FAMILIES = ("gpt2", "llama", "gpt")


# -- config: the four calling forms ------------------------------------------------------------
def test_calling_forms_give_one_config(tmp_path):
    path = tmp_path / "inference.json"
    path.write_text(json.dumps({"tensor_parallel": {"tp_size": 2}, "dtype": "fp16"}))
    want = {"tp_size": 2, "dtype": "fp16", "max_out_tokens": 1024}
    forms = [
        load_inference_config({"tensor_parallel": {"tp_size": 2}, "dtype": "fp16"}),
        load_inference_config(str(path)),
        load_inference_config(path),
        load_inference_config(tensor_parallel={"tp_size": 2}, dtype=torch.float16),
        load_inference_config({"tensor_parallel": {"tp_size": 2}}, dtype=torch.half),
        load_inference_config(str(path), dtype="fp16", mp_size=2),  # same values twice: fine
    ]
    for cfg in forms:
        assert {"tp_size": cfg.tp_size, "dtype": cfg.dtype, "max_out_tokens": cfg.max_out_tokens} == want
    assert load_inference_config().tp_size == 1 and load_inference_config().dtype == "fp32"


@pytest.mark.parametrize(("given", "field", "value"), [
    ({"mp_size": 4}, "tp_size", 4),
    ({"tp": {"tp_size": 4}}, "tp_size", 4),
    ({"tensor_parallel": {"tp_size": 4, "enabled": False}}, "tp_size", 1),
    ({"max_tokens": 64}, "max_out_tokens", 64),
    ({"kernel_inject": True}, "replace_with_kernel_inject", True),
    ({"dtype": torch.bfloat16}, "dtype", "bf16"),
    ({"dtype": "torch.float16"}, "dtype", "fp16"),
    ({"dtype": "float"}, "dtype", "fp32"),
    ({"dtype": torch.float}, "dtype", "fp32"),
])
def test_deepspeed_spellings(given, field, value):
    assert getattr(load_inference_config(given), field) == value
    assert getattr(load_inference_config(**given), field) == value


def test_no_effect_keys_are_accepted_and_logged(caplog):
    with caplog.at_level("WARNING", logger="meshspeed"):
        engine = init_inference(build("gpt2"), enable_cuda_graph=True, triangular_masking=False,
                                replace_with_kernel_inject=True, injection_policy={"a": "b"})
    text = caplog.text
    assert "enable_cuda_graph" in text and "triangular_masking" in text and "injection_policy" in text
    assert engine.config.replace_with_kernel_inject is True


# -- forward parity at tp=1 --------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_forward_matches_the_model(family):
    model = build(family).to(device())
    ids = prompt()
    ref = logits(model, ids)
    engine = init_inference(model, {"dtype": "fp32"})
    assert engine.module is model and isinstance(engine, InferenceEngine)
    assert not model.training
    assert torch.equal(logits(engine, ids), ref)
    with torch.no_grad():
        out = engine.forward(ids.to(device()))
    assert torch.equal((out if torch.is_tensor(out) else out.logits).cpu(), ref)


def test_dtype_casts_the_model():
    model, ref_model = build("llama"), build("llama").half().to(device())
    ids = prompt()
    engine = init_inference(model, dtype="fp16")
    assert {p.dtype for p in engine.module.parameters()} == {torch.float16}
    assert torch.equal(logits(engine, ids), logits(ref_model, ids))  # same ops, same dtype


def test_hf_generate_through_module():
    model = build("gpt2")
    ids = prompt()
    ref = hf_generate(copy.deepcopy(model).to(device()), ids, 6)
    engine = init_inference(model)
    assert torch.equal(hf_generate(engine.module, ids, 6), ref)


# -- quantization and ZeRO-Inference hand-offs ---------------------------------------------------
def test_quant_calls_quantize_weights(monkeypatch):
    from meshspeed.inference import engine as engine_module

    calls = []
    monkeypatch.setattr(engine_module, "quantize_weights",
                        lambda model, bits=8, group_size=None: calls.append((bits, group_size)) or model)
    init_inference(build("gpt2"), quant={"enabled": True, "bits": 4, "group_size": 32})
    assert calls == [(4, 32)]
    init_inference(build("gpt2"), quant={"enabled": False, "bits": 4})
    assert calls == [(4, 32)]  # not enabled: not called


def _zero_handoff():
    from meshspeed.inference import engine as engine_module

    calls = []
    real = engine_module.partition_for_inference
    engine_module.partition_for_inference = lambda model, cfg, group: calls.append(
        (dict(cfg), torch.distributed.get_world_size(group)))
    try:
        init_inference(build("gpt2"), zero={"stage": 3, "offload_param": {"device": "cpu"}})
    finally:
        engine_module.partition_for_inference = real
    return calls


def test_zero_stage3_calls_partition_for_inference():
    for calls in run_distributed(_zero_handoff, world_size=2):
        assert calls == [({"stage": 3, "offload_param": {"device": "cpu"}}, 2)]


# -- tensor parallelism: 2 gloo ranks -------------------------------------------------------------
def _tp2_parity(family: str):
    model = build(family)
    ref_model = copy.deepcopy(model)
    ids = prompt()
    ref = logits(ref_model, ids)
    engine = init_inference(model, tensor_parallel={"tp_size": 2})
    split = any(getattr(m, "tp_shards", None) for m in engine.module.modules())
    out = logits(engine, ids)
    with torch.no_grad():  # the model's own loss, over whole logits (no vocab-parallel swap)
        if family == "gpt":
            losses = engine(ids, ids), ref_model(ids, ids)
        else:
            losses = engine(ids, labels=ids).loss, ref_model(ids, labels=ids).loss
    result = {"split": split, "shape": tuple(out.shape), "diff": (out - ref).abs().max().item(),
              "logits": out, "loss_diff": (losses[0] - losses[1]).abs().item()}
    if family != "gpt":
        result["same_tokens"] = torch.equal(hf_generate(engine.module, ids, 8), hf_generate(ref_model, ids, 8))
    return result


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_forward_and_hf_generate(family):
    r0, r1 = run_distributed(_tp2_parity, world_size=2, args=(family,))
    for r in (r0, r1):
        assert r["split"], "the model was not split"
        assert r["shape"] == (2, 8, VOCAB)  # whole vocabulary on every rank
        assert r["diff"] < 1e-5, r["diff"]
        assert r["loss_diff"] < 1e-5, r["loss_diff"]
        assert r.get("same_tokens", True)
    assert torch.equal(r0["logits"], r1["logits"])  # ranks agree bit for bit


# -- engine.generate ------------------------------------------------------------------------------
def test_engine_generate_matches_hf_greedy():
    model = build("gpt2")
    ids = prompt()
    ref = hf_generate(copy.deepcopy(model).to(device()), ids, 6)
    out = init_inference(model).generate(ids.to(device()), max_new_tokens=6)
    assert torch.equal(out.cpu(), ref)


def _tp2_engine_generate(family: str) -> bool:
    model = build(family)
    ref_model, ids = copy.deepcopy(model), prompt()
    out = init_inference(model, tensor_parallel={"tp_size": 2}).generate(ids, max_new_tokens=8)
    return torch.equal(out, hf_generate(ref_model, ids, 8))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_tp2_engine_generate_matches_hf_greedy(family):
    assert run_distributed(_tp2_engine_generate, world_size=2, args=(family,)) == [True, True]


# -- DeepSpeed names ------------------------------------------------------------------------------
def test_names_for_the_deepspeed_alias():
    from meshspeed.inference import config, engine

    assert meshspeed.init_inference is init_inference
    assert config.DeepSpeedInferenceConfig is InferenceConfig
    assert engine.InferenceEngine is InferenceEngine
    code = ("from meshspeed.compat.alias import install; install(); import deepspeed; "
            "from deepspeed.inference.config import DeepSpeedInferenceConfig; "
            "from deepspeed.inference.engine import InferenceEngine; "
            "import meshspeed.inference.engine as e; "
            "assert deepspeed.init_inference is e.init_inference and InferenceEngine is e.InferenceEngine; "
            "print(DeepSpeedInferenceConfig.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "InferenceConfig"
