"""Tiny models for the inference tests, built from configs with random weights (never
downloaded), in eval mode and fp32: meshspeed's GPT, HF GPT-2 and HF Llama with
grouped-query attention (2 kv heads for 4 query heads). Call under a fixed torch seed."""

from __future__ import annotations

import pytest
import torch

FAMILIES = ("gpt", "gpt2", "llama")
EOS, PAD = 1, 0  # token ids given to both HF generate and ours


def build(family: str):
    if family == "gpt":
        from meshspeed.models.gpt import GPT, GPTConfig

        cfg = GPTConfig(vocab_size=128, max_seq_len=64, n_layer=2, n_head=4, n_kv_head=2, d_model=64)
        return GPT(cfg).eval()
    import transformers

    if family == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
                                      bos_token_id=EOS, eos_token_id=EOS, pad_token_id=PAD)
        return transformers.GPT2LMHeadModel(cfg).eval()
    if family == "llama":
        cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                       max_position_embeddings=128, bos_token_id=EOS, eos_token_id=EOS,
                                       pad_token_id=PAD)
        return transformers.LlamaForCausalLM(cfg).eval()
    if family in ("qwen2", "mistral"):  # the other Llama-family layouts (qwen2: q/k/v biases)
        cls = {"qwen2": transformers.Qwen2Config, "mistral": transformers.MistralConfig}[family]
        cfg = cls(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=128)
        model = {"qwen2": transformers.Qwen2ForCausalLM,
                 "mistral": transformers.MistralForCausalLM}[family](cfg)
        return model.eval()
    raise ValueError(f"unknown test family {family!r}")


@torch.no_grad()
def forward_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """(T, vocab) fp32 logits of the model's plain forward on one sequence."""
    out = model(ids[None])
    return (out if isinstance(out, torch.Tensor) else out.logits)[0].float()


@pytest.fixture
def one_thread():
    """Tiny GEMMs: extra intra-op threads only contend (HF generate ran 100x slower with
    them on a loaded 2-core machine). Use as `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
