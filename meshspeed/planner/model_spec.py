"""The model the planner prices: a Llama-like decoder (ModelShape) plus its Mixture-of-
Experts layout, read from a meshspeed GPTConfig, a dict, or a JSON file (meshspeed's field
names or a Hugging Face config.json)."""

from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshspeed.planner.activations import ModelShape, block_param_count, param_count

# Hugging Face config.json names -> ModelShape / PlanModel names
_HF = {"num_hidden_layers": "n_layer", "hidden_size": "d_model", "num_attention_heads": "n_head",
       "num_key_value_heads": "n_kv_head", "intermediate_size": "ffn_hidden",
       "tie_word_embeddings": "tie_embeddings", "num_local_experts": "moe_num_experts",
       "num_experts": "moe_num_experts", "num_experts_per_tok": "moe_top_k",
       "n_embd": "d_model"}


# meshspeed's names (GPTConfig's fields; tests/planner/test_plan.py checks they agree)
KNOWN_KEYS = ("vocab_size", "max_seq_len", "n_layer", "n_head", "n_kv_head", "d_model", "ffn_hidden",
              "rope_theta", "norm_eps", "tie_embeddings", "moe_num_experts", "moe_every", "moe_top_k",
              "moe_capacity_factor", "moe_min_capacity", "moe_drop_tokens", "moe_use_rts",
              "moe_top2_2nd_expert_sampling", "moe_ep_size", "moe_aux_loss_coef", "moe_z_loss_coef")
_REQUIRED = ("n_layer", "d_model", "n_head", "vocab_size")
_HF_MARKS = ("model_type", "architectures", "transformers_version")


def _did_you_mean(key: str, choices) -> str:
    close = difflib.get_close_matches(key, list(choices), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def check_keys(model: dict, where: str) -> None:
    """ValueError naming the first key of a meshspeed-style config that is not one of
    KNOWN_KEYS (a typo: 'n_layers'), or, in a Hugging Face config.json (which has many
    keys the planner does not read), a required size it does not give."""
    if any(k in model for k in _HF_MARKS) or any(k in model for k in _HF if k != "n_embd"):
        for need in _REQUIRED:
            names = [k for k, v in _HF.items() if v == need] + [need]  # the Hugging Face names first
            if not any(name in model for name in names):
                raise ValueError(f"{where} has no {names[0]!r} (meshspeed's {need})"
                                 f"{_did_you_mean(names[0], model)}")
        return
    for key in model:
        if key not in KNOWN_KEYS and key not in _HF:
            raise ValueError(f"unknown key {key!r} in {where}{_did_you_mean(key, KNOWN_KEYS)} "
                             f"known keys: {', '.join(KNOWN_KEYS)} (or a Hugging Face config.json's)")


@dataclass(frozen=True)
class PlanModel:
    shape: ModelShape
    num_experts: int = 0  # experts per MoE layer; 0: dense
    moe_every: int = 1  # every moe_every-th block is an MoE block
    top_k: int = 1  # experts each token visits
    capacity_factor: float = 1.0  # expert slots per token and k: the experts compute every slot

    @classmethod
    def from_any(cls, model: Any) -> PlanModel:
        if isinstance(model, cls):
            return model
        if isinstance(model, (str, Path)):
            path = Path(model)
            if not path.is_file():
                raise ValueError(f"model {str(model)!r} is not a file; give a config.json path, "
                                 "a GPTConfig or a dict")
            try:
                model = json.loads(path.read_text())
            except json.JSONDecodeError as err:
                raise ValueError(f"model {str(model)!r} is not JSON: {err}") from None
            if not isinstance(model, dict):
                raise ValueError(f"model {str(path)!r} holds a JSON {type(model).__name__}; give a JSON object "  # noqa: TRY004 - bad file content; the CLI reports ValueErrors
                                 "of the model's sizes ({\"n_layer\": 12, ...})")
            check_keys(model, str(path))
        if dataclasses.is_dataclass(model):
            model = dataclasses.asdict(model)
        if not isinstance(model, dict):
            raise TypeError(f"model must be a GPTConfig, a dict or a config.json path, "
                             f"got {type(model).__name__}")
        raw = {_HF.get(k, k): v for k, v in model.items()}
        experts = int(raw.get("moe_num_experts") or 0)
        # Hugging Face MoE configs put experts in every block; meshspeed's GPT every moe_every-th
        every = int(raw.get("moe_every") or (2 if "moe_every" in model or "n_layer" in model else 1))
        if "num_hidden_layers" in model:
            every = 1
        return cls(ModelShape.from_any(raw), experts, every, int(raw.get("moe_top_k") or 1),
                   float(raw.get("moe_capacity_factor") or 1.0))

    @property
    def moe_layers(self) -> int:
        return self.shape.n_layer // self.moe_every if self.num_experts else 0

    @property
    def mlp_params(self) -> int:
        return 3 * self.shape.d_model * self.shape.ffn

    def expert_params_per_layer(self) -> int:
        """Parameters of one MoE layer's experts (the router is counted as dense)."""
        return self.num_experts * self.mlp_params if self.num_experts else 0

    def dense_block_params(self, moe: bool) -> int:
        """A block's parameters outside the experts: attention, norms, and the dense MLP or
        the router."""
        b = block_param_count(self.shape)
        return b - self.mlp_params + self.shape.d_model * self.num_experts if moe else b

    @property
    def num_params(self) -> int:
        extra = self.moe_layers * (self.expert_params_per_layer() - self.mlp_params
                                   + self.shape.d_model * self.num_experts)
        return param_count(self.shape) + extra

    @property
    def active_params(self) -> int:
        """Parameters one token's forward multiplies by, on average: top_k experts per MoE
        layer, times the capacity factor (the experts compute their empty slots too)."""
        visits = self.top_k * self.capacity_factor
        extra = self.moe_layers * ((visits - 1) * self.mlp_params + self.shape.d_model * self.num_experts)
        return param_count(self.shape) + extra

    def train_flops_per_token(self, seq_len: int, recompute: bool = False) -> float:
        """6 x the matmul parameters (the embedding lookup is not a matmul) plus attention's
        two S x S products, 12 L d S per token (PaLM, arXiv:2204.02311, appendix B: no
        saving is assumed from the causal mask). Recomputation repeats the forward of the
        blocks: 8 instead of 6."""
        s = self.shape
        matmul = self.active_params - s.vocab_size * s.d_model * (0 if s.tie_embeddings else 1)
        blocks = matmul - s.vocab_size * s.d_model  # the head is not recomputed
        attn = 12 * s.n_layer * s.d_model * seq_len
        return 6 * matmul + attn + ((2 * blocks + attn / 3) if recompute else 0)
