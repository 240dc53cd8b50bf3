"""The model the planner prices: a Llama-like decoder (ModelShape) plus its Mixture-of-
Experts layout, read from a meshspeed GPTConfig, a dict, or a JSON file (meshspeed's field
names or a Hugging Face config.json)."""

from __future__ import annotations

import dataclasses
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
            model = json.loads(path.read_text())
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
