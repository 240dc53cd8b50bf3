"""Automatic tensor-parallel plans for Hugging Face decoder layouts, and the attribute
fixes their attention modules need once their projections are split.

Families, by `config.model_type`:
  llama, mistral, qwen2   q_proj/k_proj/v_proj, gate_proj/up_proj column; o_proj, down_proj
                          row (heads split whole: query and kv heads must divide by tp);
                          embed_tokens vocab; lm_head vocab_head (tied if the model ties)
  gpt2                    c_attn (Conv1D, fused q|k|v) column split per part and per head;
                          attn.c_proj row; mlp.c_fc column; mlp.c_proj row; wte vocab, tied
                          to lm_head; wpe replicated

Note [HF sequence boundaries]
Under sequence parallelism the reference GPT reduce-scatters in its embedding. HF models
build the causal mask and rotary tables from the embedding output's length, so here the
embedding stays a plain vocab-parallel one (all-reduced, whole sequence) and the sequence
is split at the first decoder layer's input; the residual stream stays sharded to the
final norm, whose output is gathered before lm_head. Two HF forwards read sizes from
their input rather than from the projection output: Llama-style attention views q/k/v
with `hidden_states.shape[:-1]`, and GPT-2 views the final norm's output with the
sequence length of the input ids. So for Llama-style attention the whole sequence is
gathered at the attention input (one all-gather for q/k/v, reduce-scattered backward;
boundaries.py) and o_proj reduce-scatters it again; GPT-2's attention reads its sizes
from c_attn's output, so its c_attn gathers as a sequence-parallel column layer does.
MLPs use the sequence-parallel column/row pair as in Megatron. The final norm's output
is gathered for lm_head with a backward that keeps this rank's piece after lm_head has
all-reduced its input gradient: twice the bytes of a reduce-scatter, once per step, in
exchange for HF's code unchanged.
"""

from __future__ import annotations

from torch import nn

LLAMA_LIKE = ("llama", "mistral", "qwen2")
GPT2_LIKE = ("gpt2",)


def hf_plan(model: nn.Module) -> dict | None:
    """The plan for a transformers model of a known family, or None."""
    config = getattr(model, "config", None)
    family = getattr(config, "model_type", None)
    if family in LLAMA_LIKE:
        return _llama_plan(model, config)
    if family in GPT2_LIKE:
        return _gpt2_plan(model, config)
    return None


def family_of(model: nn.Module) -> str | None:
    family = getattr(getattr(model, "config", None), "model_type", None)
    return family if family in LLAMA_LIKE + GPT2_LIKE else None


def _prefix(model: nn.Module) -> str:
    """'model.' for LlamaForCausalLM, '' for a bare LlamaModel."""
    base = getattr(model, "base_model_prefix", "")
    return f"{base}." if base and isinstance(getattr(model, base, None), nn.Module) else ""


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _lm_tail(model: nn.Module) -> dict:
    if not isinstance(getattr(model, "lm_head", None), nn.Linear):
        return {}
    # lm_head's input is already gathered (Note [HF sequence boundaries]).
    return {"lm_head": {"kind": "vocab_head", "sequence_parallel": False},
            "loss_function": "loss"}


def _llama_plan(model: nn.Module, config) -> dict:
    p, hd = _prefix(model), _head_dim(config)
    qkv = {"kind": "column", "multiple": hd}
    return {
        f"{p}embed_tokens": {"kind": "vocab", "sequence_parallel": False},
        f"{p}layers.0": {"kind": "replicate", "sp_input": "scatter"},
        f"{p}layers.*.self_attn": {"kind": "replicate", "sp_input": "gather"},
        f"{p}layers.*.self_attn.q_proj": qkv,
        f"{p}layers.*.self_attn.k_proj": qkv,
        f"{p}layers.*.self_attn.v_proj": qkv,
        f"{p}layers.*.self_attn.o_proj": {"kind": "row", "multiple": hd},
        f"{p}layers.*.mlp.gate_proj": "column",
        f"{p}layers.*.mlp.up_proj": "column",
        f"{p}layers.*.mlp.down_proj": "row",
        f"{p}layers.*.input_layernorm": "sequence_norm",
        f"{p}layers.*.post_attention_layernorm": "sequence_norm",
        f"{p}norm": {"kind": "sequence_norm", "sp_output": "gather"},
        **_lm_tail(model),
    }


def _gpt2_plan(model: nn.Module, config) -> dict:
    p, e = _prefix(model), config.hidden_size
    hd = e // config.num_attention_heads
    return {
        f"{p}wte": {"kind": "vocab", "sequence_parallel": False},
        f"{p}h.0": {"kind": "replicate", "sp_input": "scatter"},
        f"{p}h.*.attn.c_attn": {"kind": "column", "parts": (e, e, e), "multiple": hd,
                                "weight_layout": "in_out"},
        f"{p}h.*.attn.c_proj": {"kind": "row", "multiple": hd, "weight_layout": "in_out"},
        f"{p}h.*.mlp.c_fc": {"kind": "column", "weight_layout": "in_out"},
        f"{p}h.*.mlp.c_proj": {"kind": "row", "weight_layout": "in_out"},
        f"{p}h.*.ln_1": "sequence_norm",
        f"{p}h.*.ln_2": "sequence_norm",
        f"{p}ln_f": {"kind": "sequence_norm", "sp_output": "gather"},
        **_lm_tail(model),
    }


def after_split(model: nn.Module, tp: int) -> None:
    """Fix the attributes a split attention module's forward reads. Llama-style attention
    reads only head_dim and the q/kv head ratio (both unchanged); GPT-2's splits c_attn's
    output with `split_size` (q|k|v are each embed_dim wide), so its local sizes shrink."""
    for module in model.modules():
        if type(module).__name__ == "GPT2Attention" and getattr(module.c_attn, "tp_shards", None):
            module.split_size //= tp
            module.embed_dim //= tp
            module.num_heads //= tp
