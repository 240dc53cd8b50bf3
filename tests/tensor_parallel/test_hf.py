"""apply_tensor_parallel with the automatic plans on randomly initialised Hugging Face
models (built from small configs, never downloaded): one-process reference vs tp=2
(world 2, gloo), loss and every gradient in logical form, with and without sequence
parallelism. Plus the DeepSpeed layer_specs form giving the same split as the auto plan."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from meshspeed.tensor_parallel import apply_tensor_parallel, plan_from_deepspeed
from meshspeed.testing import run_distributed
from meshspeed.topology.shards import shards_by_name
from tests.tensor_parallel.parity import check_parity, topology

_DECODER = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32}


def _build(family: str, tie: bool = False):
    torch.manual_seed(0)
    if family == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                      n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(cfg).float()
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family]
    cfg = cls(**_DECODER, tie_word_embeddings=tie)
    model = {"llama": transformers.LlamaForCausalLM,
             "qwen2": transformers.Qwen2ForCausalLM}[family](cfg).float()
    return model


def _run(model):
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 64, (2, 8), generator=g)
    return model(input_ids=idx, labels=idx).loss


CASES = {"llama_gqa": ("llama", False), "llama_gqa_tied": ("llama", True),
         "gpt2_tied": ("gpt2", True), "qwen2_gqa": ("qwen2", False)}


def _hf_parity():
    out = {}
    for name, (family, tie) in CASES.items():
        for sp in (False, True):
            out[f"{name}/sp={sp}"] = check_parity(_build(family, tie), _run, sequence_parallel=sp)
    return out


def _layer_specs_split():
    """DeepSpeed's custom patterns (use_default_specs false) split the linear layers
    exactly as the auto plan does; with defaults on, they merge to the whole auto plan."""
    mesh = topology(2)
    specs = {"use_default_specs": False, "layer_specs": [
        {"patterns": [r".*\.o_proj\.weight$", r".*\.down_proj\.weight$"],
         "partition_type": "row"},
        {"patterns": [r".*\.[qkv]_proj\.weight$", r".*\.(gate|up)_proj\.weight$"],
         "partition_type": "column"}]}
    auto = apply_tensor_parallel(_build("llama"), mesh)
    custom_model = _build("llama")
    custom = apply_tensor_parallel(custom_model, mesh, plan_from_deepspeed(specs, custom_model))
    a = {n: s for n, s in shards_by_name(auto).items() if ".layers." in n}
    c = shards_by_name(custom)
    merged_model = _build("llama")
    merged = plan_from_deepspeed({**specs, "use_default_specs": True}, merged_model)
    apply_tensor_parallel(merged_model, mesh, merged)
    return a == c and len(a) == 14, shards_by_name(merged_model) == shards_by_name(auto)


def test_hf_parity_tp2():
    for result in run_distributed(_hf_parity, world_size=2):
        assert result == {k: [] for k in result}, result


def test_deepspeed_layer_specs_match_auto_plan():
    for same_layers, same_all in run_distributed(_layer_specs_split, world_size=2):
        assert same_layers and same_all
