"""Activation memory of a Llama-like decoder: the bytes autograd keeps between forward and
backward for one micro-batch. The terms are listed, one per saved tensor, in docs/memory.md.

Assumed block (pre-norm, no dropout, no biases), as in meshspeed.models.gpt and Llama:
    y = RMSNorm(x); q, k, v = Wq y, Wk y, Wv y; RoPE on q and k; k, v repeated to n_head
    a = scaled_dot_product_attention(q, k, v, causal)
    x = x + Wo a; y = RMSNorm(x); x = x + W2 (silu(W1 y) * W3 y)

Note [what is counted]: only tensors saved for backward, at their real sizes.
* Attention: SDPA's fused paths (flash / memory-efficient, and PyTorch's CPU flash kernel)
  keep q, k, v, the output and a float32 log-sum-exp per (row, head), never the T x T score
  matrix. The math fallback (an explicit mask, unusual head sizes) would add B*H*T*T per
  layer and is not modelled. With grouped-query attention k and v are counted at n_head
  width, because eager models (meshspeed's GPT, Hugging Face Llama) repeat them before SDPA;
  SDPA's enable_gqa would save 2 * (n_head - n_kv_head) * head_dim less per token.
* RMSNorm normalises in float32 and casts back: it keeps the float32 input and rstd, the
  normalised tensor at activation width, and its output is kept by the next matmul. A fused
  RMSNorm kernel keeps less (about 4 * d_model bytes per token per norm in bf16); nn.RMSNorm
  on CPU keeps its x * rstd in float32 too (2 * d_model more). Both are small next to the
  ~100 * d_model bytes per token of a bf16 block.
* Wo's input is counted apart from the SDPA output: turning (B, H, T, hd) back into
  (B, T, d) copies unless the kernel wrote the output in (B, T, H, hd) layout (CUDA flash
  does; the CPU kernel follows q's layout), so this may count d per token once too often.
* A tensor saved by several ops (the norm output read by Wq, Wk, Wv) is counted once.
The formula reproduces the bytes saved by such a block on CPU (tests/planner measures it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

FP32 = 4  # float32 bytes: log-sum-exp, rstd and the logits of the loss stay in float32
INDEX = 8  # int64 token ids (inputs and targets)


@dataclass(frozen=True)
class ModelShape:
    """The shape of a Llama-like decoder, enough to count its parameters and activations."""

    n_layer: int  # transformer blocks
    d_model: int  # residual-stream width
    n_head: int  # query heads
    vocab_size: int  # embedding rows and logit columns
    ffn_hidden: int | None = None  # SwiGLU hidden width; None -> 8/3 d_model (see ffn)
    n_kv_head: int | None = None  # key/value heads (GQA); None -> n_head
    tie_embeddings: bool = False  # lm_head shares the embedding matrix (parameter count only)

    @classmethod
    def from_any(cls, shape: Any) -> ModelShape:
        """Accept a ModelShape, a mapping, or any object with the same attribute names
        (e.g. a model config dataclass); extra fields are ignored."""
        if isinstance(shape, cls):
            return shape
        get = shape.get if isinstance(shape, dict) else lambda k: getattr(shape, k, None)
        missing = [k for k in ("n_layer", "d_model", "n_head", "vocab_size") if get(k) is None]
        if missing:
            raise ValueError(f"model_shape is missing {', '.join(missing)}")
        return cls(
            n_layer=int(get("n_layer")),
            d_model=int(get("d_model")),
            n_head=int(get("n_head")),
            vocab_size=int(get("vocab_size")),
            ffn_hidden=None if get("ffn_hidden") is None else int(get("ffn_hidden")),
            n_kv_head=None if get("n_kv_head") is None else int(get("n_kv_head")),
            tie_embeddings=bool(get("tie_embeddings") or False),
        )

    @property
    def ffn(self) -> int:
        # meshspeed.models.gpt's rule: 8/3 d_model rounded up to a multiple of 32
        # (Llama-2 7B instead rounds to 256: 11008 for d_model 4096; pass it explicitly).
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return 32 * math.ceil(8 * self.d_model / 3 / 32)

    @property
    def kv_dim(self) -> int:
        """Width of k (and of v): n_kv_head * head_dim."""
        kv_heads = self.n_head if self.n_kv_head is None else self.n_kv_head
        return kv_heads * (self.d_model // self.n_head)


def param_count(shape: Any) -> int:
    """Parameters of the assumed decoder (no biases): embeddings, blocks, final norm, head."""
    s = ModelShape.from_any(shape)
    head = 0 if s.tie_embeddings else s.vocab_size * s.d_model
    return s.vocab_size * s.d_model + s.n_layer * block_param_count(s) + s.d_model + head


def split_param_count(shape: Any) -> int:
    """Parameters tensor parallelism splits: every projection, the embedding and the head
    (the norms stay whole on every tp rank)."""
    s = ModelShape.from_any(shape)
    return param_count(s) - s.n_layer * 2 * s.d_model - s.d_model


def block_param_count(shape: Any) -> int:
    """Parameters of one block: the unit a ZeRO-3 all-gather brings in at once."""
    s = ModelShape.from_any(shape)
    d = s.d_model
    return 2 * d * d + 2 * d * s.kv_dim + 3 * d * s.ffn + 2 * d  # q,o + k,v + mlp + 2 norms


def activation_bytes(
    shape: Any,
    micro_batch_size: int,
    seq_len: int,
    act_bytes: float = 2,
    checkpointing: bool = False,
    tp: int = 1,
    sequence_parallel: bool = False,
) -> dict[str, int]:
    """Bytes saved for backward by one micro-batch of micro_batch_size x seq_len tokens.

    act_bytes is the width of activations (2 for bf16/fp16, 4 for fp32). Returns the parts
    and their sum under "total". With checkpointing, each block keeps only its input, and
    one block's full activations exist again while that block is recomputed in backward.

    With tensor parallelism over `tp` ranks, what lives between a column- and a row-parallel
    layer (q, k, v, attention output, the SwiGLU intermediates, per-head statistics) and the
    vocabulary-parallel log-probabilities are 1/tp per rank; the norms' activations and block
    inputs are whole on every rank, unless `sequence_parallel` splits them along the
    sequence too (Korthikanti et al. 2022: everything is then 1/tp).
    """
    if micro_batch_size < 1 or seq_len < 1:
        raise ValueError("micro_batch_size and seq_len must be >= 1")
    s = ModelShape.from_any(shape)
    tokens = micro_batch_size * seq_len
    d, f = s.d_model, s.ffn
    wide = max(act_bytes, FP32)  # RMSNorm works in float32 (Note [what is counted])
    # Bytes per token saved by one block (Note [what is counted]):
    #   2 RMSNorms: float32 input (2d, `wide`); normalised + output (4d, act_bytes);
    #   q, k, v at n_head width = 3d; SDPA output and Wo's input = 2d;
    #   SwiGLU: W1 y, silu(W1 y), W3 y, their product = 4f.
    #   Float32 extras: rstd of each norm (2) and a log-sum-exp per query head (n_head).
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    seq_split = tp if sequence_parallel else 1
    split = act_bytes * (5 * d + 4 * f) + FP32 * s.n_head  # between column and row layers
    whole = act_bytes * 4 * d + wide * 2 * d + FP32 * 2  # the two norms
    per_token = split / tp + whole / seq_split
    block = math.ceil(tokens * per_token)
    block_input = math.ceil(tokens * d * act_bytes / seq_split)
    # Outside the blocks: token ids and targets, the final norm, the float32 log-probabilities
    # the cross-entropy keeps (B*T*vocab*4: often the largest single activation).
    final_norm = math.ceil(tokens * (d * wide + 2 * d * act_bytes + FP32) / seq_split)
    logits = math.ceil(tokens * s.vocab_size * FP32 / tp)
    ids = 2 * tokens * INDEX
    if checkpointing:
        layers = s.n_layer * block_input + block  # kept inputs + one block being recomputed
    else:
        layers = s.n_layer * block
    return {
        "per_layer": block,
        "layers": layers,
        "final_norm": final_norm,
        "logits": logits,
        "token_ids": ids,
        "total": layers + final_norm + logits + ids,
    }
