"""A small Llama-style decoder-only transformer, dense or Mixture-of-Experts.

Reference model for tests, examples and benchmarks. It holds no parallel code: strategies
are applied from outside. Two layout facts that outside code relies on:

* `GPT.layers` is an `nn.ModuleList` of `Block`s (identical in a dense model) and each
  block maps `(B, T, d_model) -> (B, T, d_model)` with no other inputs, so a block is the
  natural unit to shard, checkpoint or place on a pipeline stage.
* `Attention` infers its local head counts from the projection output sizes, so column-
  sharding `wq`/`wk`/`wv` by heads (tensor parallelism) needs no change here.

The MoE variant (`moe_num_experts > 0`): every `moe_every`-th block's MLP is a
`meshspeed.moe.layer.MoE` whose experts are copies of that block's dense `SwiGLU` (GShard,
arXiv:2006.16668, and Switch, arXiv:2101.03961, replace every other FFN this way). The
loss then adds `moe_aux_loss_coef` times the sum of the layers' l_aux, DeepSpeed's
convention. The MoE layer is the one meshspeed module imported here (the style's "models
import nothing of ours" is about parallel code; this is a layer): it holds no process
group of its own, `meshspeed.initialize` hands it the mesh's expert-parallel group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from meshspeed.moe.layer import MoE


def _round_up(x: float, multiple: int) -> int:
    return multiple * math.ceil(x / multiple)


@dataclass
class GPTConfig:
    vocab_size: int = 256  # byte-level tokens by default
    max_seq_len: int = 256  # longest sequence the rotary tables cover
    n_layer: int = 4  # number of transformer blocks
    n_head: int = 4  # query heads per attention layer
    n_kv_head: int | None = None  # key/value heads; None = n_head, fewer = grouped-query attn
    d_model: int = 128  # residual stream width
    ffn_hidden: int | None = None  # SwiGLU hidden size; None = 8/3 * d_model rounded up to 32
    rope_theta: float = 10000.0  # rotary base frequency
    norm_eps: float = 1e-5  # RMSNorm epsilon
    tie_embeddings: bool = False  # lm_head reuses the token embedding matrix
    # Mixture of Experts (meshspeed.moe.layer.MoE; the names after the moe_ prefix are its
    # arguments'). Blocks moe_every-1, 2*moe_every-1, ... hold an MoE instead of an MLP.
    moe_num_experts: int = 0  # experts per MoE layer; 0 = a dense model, no MoE layers
    moe_every: int = 2  # every moe_every-th block is an MoE block (1 = every block)
    moe_top_k: int = 1  # experts per token: 1 (Switch) or 2 (GShard)
    moe_capacity_factor: float = 1.0  # expert slots = ceil(tokens / experts * factor * k), train and eval
    moe_min_capacity: int = 4  # fewest slots per expert
    moe_drop_tokens: bool = True  # False: dropless, every token reaches its experts
    moe_use_rts: bool = True  # top-1: random token selection when an expert is over-full
    moe_top2_2nd_expert_sampling: bool = True  # top-2: sample the second expert (Gumbel noise)
    moe_ep_size: int = 1  # expert-parallel degree: each rank holds moe_num_experts / moe_ep_size
    moe_aux_loss_coef: float = 0.01  # weight of the load-balancing loss added to the loss
    moe_z_loss_coef: float = 0.0  # router z-loss weight inside each layer's l_aux (ST-MoE)

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.n_head % self.kv_heads:
            raise ValueError(f"n_head={self.n_head} is not divisible by n_kv_head={self.kv_heads}")
        if self.moe_num_experts < 0 or self.moe_every < 1:
            raise ValueError(f"moe_num_experts={self.moe_num_experts} must be >= 0 (0: dense) and "
                             f"moe_every={self.moe_every} >= 1")
        if self.moe_num_experts and self.moe_num_experts % self.moe_ep_size:
            raise ValueError(f"moe_num_experts={self.moe_num_experts} is not divisible by "
                             f"moe_ep_size={self.moe_ep_size}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def hidden_dim(self) -> int:
        """The resolved SwiGLU hidden size."""
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return _round_up(8 * self.d_model / 3, 32)

    def is_moe_block(self, i: int) -> bool:
        """Whether block i holds an MoE layer in place of its MLP."""
        return self.moe_num_experts > 0 and (i + 1) % self.moe_every == 0

    def num_params(self) -> int:
        """Parameter count of `GPT(self)`, computed without building it (tied counted once;
        an MoE block counts the moe_num_experts / moe_ep_size experts one rank holds)."""
        d, kv_dim = self.d_model, self.kv_heads * self.head_dim
        attn = d * d + 2 * d * kv_dim + d * d  # wq, wk, wv, wo
        mlp = 3 * d * self.hidden_dim  # w1, w3, w2
        moe = self.moe_num_experts // self.moe_ep_size * mlp + d * self.moe_num_experts  # + gate
        blocks = sum(attn + (moe if self.is_moe_block(i) else mlp) + 2 * d  # + two RMSNorm weights
                     for i in range(self.n_layer))
        embed = self.vocab_size * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return embed + blocks + d + head  # + final norm


def param_count(model: nn.Module) -> int:
    """Number of unique parameter elements; a parameter used twice (tied) counts once."""
    # Module.parameters() already yields each Parameter object once.
    return sum(p.numel() for p in model.parameters())


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 so bf16/fp16 activations do not lose the mean-square.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


class Rotary(nn.Module):
    """Rotary position embedding (Su et al. 2021, https://arxiv.org/abs/2104.09864).

    The cos/sin tables are buffers with persistent=False: they are derived from the config,
    so checkpoints do not carry them. Code that builds the model on the meta device must
    call `reset_tables()` after materialising it.
    """

    def __init__(self, head_dim: int, max_seq_len: int, theta: float):
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        self.register_buffer("cos", torch.empty(max_seq_len, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, head_dim // 2), persistent=False)
        self.reset_tables()

    @torch.no_grad()
    def reset_tables(self) -> None:
        half = self.head_dim // 2
        device = self.cos.device
        inv_freq = self.theta ** (-torch.arange(half, device=device, dtype=torch.float32) / half)
        pos = torch.arange(self.max_seq_len, device=device, dtype=torch.float32)
        angles = torch.outer(pos, inv_freq)  # (max_seq_len, half)
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        # x: (B, heads, T, head_dim); rotate the two halves of each head as complex pairs.
        # positions: the tokens' global positions (T,) when x holds part of a longer
        # sequence (context parallelism); 0..T-1 otherwise.
        T = x.size(-2)
        cos = (self.cos[:T] if positions is None else self.cos[positions]).to(x.dtype)  # (T, half)
        sin = (self.sin[:T] if positions is None else self.sin[positions]).to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)  # each (B, heads, T, half)
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        kv_dim = cfg.kv_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wk = nn.Linear(cfg.d_model, kv_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, kv_dim, bias=False)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.rotary = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        # a meshspeed.sequence.context.ContextParallel when the engine splits sequences
        # over ranks: it gives the global positions and runs the distributed attention
        # (the ContextAttention protocol of meshspeed/sequence/models.py)
        self.context = None
        self.max_positions = cfg.max_seq_len

    def local_heads(self) -> tuple[int, int]:
        """(query heads, key/value heads) this rank's projections produce."""
        return self.wq.weight.shape[0] // self.head_dim, self.wk.weight.shape[0] // self.head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Head counts come from the tensors (-1), not the config, so a head-sharded
        # projection simply yields fewer local heads. B and T come from the projection's
        # output, not x: a sequence-parallel wq gathers the sequence that x holds a piece of.
        q = self.wq(x)
        B, T, _ = q.shape  # (B, T, n_head * hd)
        q = q.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, n_head, T, hd)
        k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, n_kv, T, hd)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, n_kv, T, hd)
        context = self.context
        positions = None if context is None else context.positions
        q, k = self.rotary(q, positions), self.rotary(k, positions)
        if context is not None:  # this rank's queries over the whole sequence (GQA inside)
            y = context.attend(q, k, v, causal=True)
            return self.wo(y.transpose(1, 2).reshape(B, T, -1))
        groups = q.size(1) // k.size(1)
        if groups > 1:  # grouped-query attention: each kv head serves `groups` query heads
            k = k.repeat_interleave(groups, dim=1)  # (B, n_head, T, hd)
            v = v.repeat_interleave(groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, n_head, T, hd)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, n_head * hd)
        return self.wo(y)  # (B, T, d_model)


class SwiGLU(nn.Module):
    """Gated MLP (Shazeer 2020, https://arxiv.org/abs/2002.05202): w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.hidden_dim, bias=False)  # gate
        self.w3 = nn.Linear(cfg.d_model, cfg.hidden_dim, bias=False)  # up
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.d_model, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # (B, T, d_model)


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(x)).

    With `moe=True` the MLP is an MoE layer of cfg.moe_num_experts copies of the SwiGLU.
    The block still maps x to x alone (the layout fact above); the layer's l_aux of the
    last forward is kept in `aux_loss` for the model's loss (None in a dense block). Under
    reentrant activation checkpointing of the block that stored value has no gradient."""

    def __init__(self, cfg: GPTConfig, moe: bool = False):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg) if not moe else MoE(
            cfg.d_model, SwiGLU(cfg), num_experts=cfg.moe_num_experts, ep_size=cfg.moe_ep_size,
            k=cfg.moe_top_k, capacity_factor=cfg.moe_capacity_factor,
            eval_capacity_factor=cfg.moe_capacity_factor, min_capacity=cfg.moe_min_capacity,
            drop_tokens=cfg.moe_drop_tokens, use_rts=cfg.moe_use_rts,
            top2_2nd_expert_sampling=cfg.moe_top2_2nd_expert_sampling,
            z_loss_coef=cfg.moe_z_loss_coef)
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))  # (B, T, d_model)
        if not isinstance(self.mlp, MoE):
            return x + self.mlp(self.mlp_norm(x))
        y, self.aux_loss, _ = self.mlp(self.mlp_norm(x))  # y (B, T, d_model), l_aux scalar
        return x + y


class GPT(nn.Module):
    # How tensor parallelism splits this model (meshspeed.apply_tensor_parallel reads it);
    # plain data, so this file imports nothing of meshspeed's. See tensor_parallel/plan.py.
    tp_plan: ClassVar[dict] = {
        "layers.*.attn.wq": {"kind": "column", "multiple": "head_dim"},
        "layers.*.attn.wk": {"kind": "column", "multiple": "head_dim"},
        "layers.*.attn.wv": {"kind": "column", "multiple": "head_dim"},
        "layers.*.attn.wo": {"kind": "row", "multiple": "head_dim"},
        "layers.*.mlp.w1": "column",
        "layers.*.mlp.w3": "column",
        "layers.*.mlp.w2": "row",
        "layers.*.attn_norm": "sequence_norm",
        "layers.*.mlp_norm": "sequence_norm",
        "norm": "sequence_norm",
        "tok_emb": "vocab",
        "lm_head": "vocab_head",
        "loss_fn": "loss",
    }

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, cfg.is_moe_block(i)) for i in range(cfg.n_layer))
        if cfg.moe_num_experts:
            self.tp_plan = moe_tp_plan(cfg)  # this instance's plan: experts stay whole
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight  # one Parameter, used twice
        # A module, not F.cross_entropy, so that tensor parallelism can swap in the
        # vocab-parallel cross-entropy and full-vocabulary logits are never built.
        self.loss_fn = nn.CrossEntropyLoss()
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Deterministic given the torch seed: N(0, 0.02) everywhere, with the projections
        that write into the residual stream (wo, w2) scaled by 1/sqrt(2 * n_layer) so the
        stream's variance does not grow with depth (GPT-2 paper, section 2.3)."""
        for name, module in self.named_modules():
            self.init_module(name, module)

    @torch.no_grad()
    def init_module(self, name: str, module: nn.Module) -> None:
        """Initialise one module's own parameters and buffers (not its children's), so that
        code materialising the model piece by piece (meshspeed.zero.Init) can reuse it."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            is_residual = name.endswith((".wo", ".w2"))
            nn.init.normal_(module.weight, std=residual_std if is_residual else 0.02)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, Rotary):
            module.reset_tables()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """idx: (B, T) token ids. Returns logits (B, T, vocab) when targets is None,
        else the mean cross-entropy of predicting targets (B, T) as a scalar.

        Under tensor parallelism the logits are this rank's shard of the vocabulary,
        (B, T, ceil(vocab / tp)), the last rank's tail columns padding; the loss is whole.
        With MoE blocks the loss includes moe_aux_loss_coef * the sum of their l_aux."""
        B, T = idx.shape
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len={self.config.max_seq_len}")
        x = self.tok_emb(idx)  # (B, T, d_model)
        for layer in self.layers:
            x = layer(x)  # (B, T, d_model)
        x = self.norm(x)
        logits = self.lm_head(x)  # (B, T, vocab)
        if targets is None:
            return logits
        # Cross-entropy in fp32 whatever the compute dtype: the softmax over the vocab is
        # where low precision hurts most.
        loss = self.loss_fn(logits.float().view(B * T, -1), targets.reshape(B * T))
        aux = [layer.aux_loss for layer in self.layers if layer.aux_loss is not None]
        if aux:  # MoE: the load-balancing losses of this forward, weighted (DeepSpeed's way)
            loss = loss + self.config.moe_aux_loss_coef * torch.stack(aux).sum()
        return loss

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
    ) -> torch.Tensor:
        """Append `max_new_tokens` sampled tokens to idx (B, T); returns (B, T + new).

        temperature == 0 picks the most likely token. There is no KV cache: each step
        re-runs the last max_seq_len tokens, which is fine for a reference model.
        """
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.max_seq_len :]  # (B, <=max_seq_len)
            logits = self(context)[:, -1, :].float()  # (B, vocab)
            if temperature == 0:
                next_id = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = F.softmax(logits, dim=-1)
                next_id = torch.multinomial(probs, num_samples=1)  # (B, 1)
            idx = torch.cat((idx, next_id), dim=1)
        return idx


def moe_tp_plan(cfg: GPTConfig) -> dict:
    """`GPT.tp_plan` for an MoE config: the MLP entries name the dense blocks only, so
    tensor parallelism never splits an expert (each tp rank holds whole experts and routes
    the same replicated tokens) nor the router; MoE blocks' attention and norms split as
    in the dense model."""
    mlp = {k: v for k, v in GPT.tp_plan.items() if k.startswith("layers.*.mlp.")}
    plan = {k: v for k, v in GPT.tp_plan.items() if k not in mlp}
    for i in range(cfg.n_layer):
        if not cfg.is_moe_block(i):
            plan.update({k.replace("*", str(i), 1): v for k, v in mlp.items()})
    return plan
