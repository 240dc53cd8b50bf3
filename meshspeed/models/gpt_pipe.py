"""The reference GPT in pipeline form: a list of layers for `PipelineModule`.

    net = GPTPipe(GPTConfig(n_layer=8), num_stages=4)     # a PipelineModule
    engine, *_ = meshspeed.initialize(model=net, config=cfg)
    loss = engine.train_batch(iter(batches))               # batches of (ids, targets)

The layers are `Embedding`, `n_layer` x `Block`, `RMSNorm`, `LMHead`, each a `LayerSpec`,
so a stage builds only its own (Note [only the owner builds] in
parallel/pipeline/module.py). With `tie_embeddings` the embedding and the head are one
`TiedLayerSpec` key, "embed", on the first and the last stage. Every layer initialises
itself as `GPT.init_weights` would (N(0, 0.02), the residual projections wo and w2 scaled
by 1/sqrt(2 n_layer)), from its own seed (`seed_layers`), so the values do not depend on
which stage builds them. `gpt_state_to_pipe` maps a `GPT`'s state_dict onto these names:
the two forms compute the same function (tests/models/test_gpt_pipe.py).

The loss is `LMLoss`: the mean next-token cross-entropy of logits (B, T, V) against
targets (B, T), computed in fp32. `tp_plan` is GPT's plan for the layers this stage holds.
"""

from __future__ import annotations

import fnmatch
import math

import torch
import torch.nn.functional as F
from torch import nn

from meshspeed.models.gpt import GPT, Block, GPTConfig, RMSNorm
from meshspeed.parallel.pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec
from meshspeed.tensor_parallel.plan import PlanError

__all__ = ["Embedding", "GPTPipe", "LMHead", "LMLoss", "gpt_pipeline_layers", "gpt_state_to_pipe"]


def _init_linear(module: nn.Module, cfg: GPTConfig) -> None:
    residual_std = 0.02 / math.sqrt(2 * cfg.n_layer)
    with torch.no_grad():
        for name, sub in module.named_modules():
            if isinstance(sub, (nn.Linear, nn.Embedding)):
                std = residual_std if name.endswith(("wo", "w2")) else 0.02
                nn.init.normal_(sub.weight, std=std)


class Embedding(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        _init_linear(self, cfg)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, d_model)
        return self.tok_emb(idx)


class PipeBlock(Block):
    def __init__(self, cfg: GPTConfig):
        super().__init__(cfg)
        _init_linear(self, cfg)


class FinalNorm(RMSNorm):
    def __init__(self, cfg: GPTConfig):
        super().__init__(cfg.d_model, cfg.norm_eps)


class LMHead(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        _init_linear(self, cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, d_model) -> (B, T, vocab)
        return self.lm_head(x)


def _tied_head(embedding: Embedding, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, embedding.tok_emb.weight)


class LMLoss(nn.Module):
    """Mean cross-entropy of logits (B, T, V) against targets (B, T), in fp32. A module
    holding the criterion, so tensor parallelism can swap in the vocab-parallel one."""

    def __init__(self):
        super().__init__()
        self.ce = nn.CrossEntropyLoss()

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.ce(logits.float().flatten(0, -2), targets.reshape(-1))


def gpt_pipeline_layers(cfg: GPTConfig) -> list[LayerSpec]:
    """The layer list: embedding, blocks, final norm, head (tied to the embedding or not)."""
    if cfg.moe_num_experts:
        raise ValueError(f"GPTPipe: moe_num_experts={cfg.moe_num_experts}, but the pipeline form has "
                         "no MoE variant (a stage passes activations only, so the MoE layers' "
                         "aux losses could not reach the loss); use GPT, or moe_num_experts=0")
    if cfg.tie_embeddings:
        first = TiedLayerSpec("embed", Embedding, cfg, tied_weight_attr="tok_emb.weight")
        last = TiedLayerSpec("embed", Embedding, cfg, forward_fn=_tied_head, tied_weight_attr="tok_emb.weight")
    else:
        first, last = LayerSpec(Embedding, cfg), LayerSpec(LMHead, cfg)
    return [first, *(LayerSpec(PipeBlock, cfg) for _ in range(cfg.n_layer)), LayerSpec(FinalNorm, cfg), last]


def _pipe_plan(final_norm: str) -> dict:
    """`GPT.tp_plan` under the pipeline form's module names."""
    renamed = {"norm": final_norm, "tok_emb": "*.tok_emb", "lm_head": "*.lm_head", "loss_fn": "loss_fn.ce"}
    return {renamed.get(k, k.replace("layers.*.", "*.", 1)): v for k, v in GPT.tp_plan.items()}


class GPTPipe(PipelineModule):
    """`PipelineModule(gpt_pipeline_layers(cfg), loss_fn=LMLoss(), seed_layers=True, ...)`."""

    def __init__(self, cfg: GPTConfig, num_stages: int | None = None, **kwargs):
        kwargs.setdefault("seed_layers", True)
        kwargs.setdefault("loss_fn", LMLoss())
        kwargs.setdefault("partition_method", "type:Block")
        super().__init__(gpt_pipeline_layers(cfg), num_stages=num_stages, **kwargs)
        self.config = cfg

    @property
    def tp_plan(self) -> dict:
        """GPT's tensor-parallel plan, for the modules this stage holds (a vocab-parallel
        loss only where the head is)."""
        if self.config.tie_embeddings:
            raise PlanError([("GPTPipe(tie_embeddings=True) under tensor parallelism: the tied head is "
                             "not a vocab-parallel layer here; build the pipeline form with "
                             "tie_embeddings=False for tp > 1")])
        names = [n for n, _ in self.named_modules() if n]
        plan = {k: v for k, v in _pipe_plan(str(self.num_layers - 2)).items()
                if any(fnmatch.fnmatchcase(n, k) for n in names)}
        if not any(fnmatch.fnmatchcase(n, "*.lm_head") for n in names):
            plan.pop("loss_fn.ce", None)
        return plan


def gpt_state_to_pipe(state: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """A `GPT` state_dict under the pipeline form's names (the whole model, one stage)."""
    n = cfg.n_layer
    out = {}
    for name, value in state.items():
        if name.startswith("tok_emb."):
            key = "tied_modules.embed." + name if cfg.tie_embeddings else "0." + name
        elif name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            key = f"{int(i) + 1}.{rest}"
        elif name.startswith("norm."):
            key = f"{n + 1}.{name[len('norm.'):]}"
        elif name.startswith("lm_head."):
            if cfg.tie_embeddings:
                continue
            key = f"{n + 2}.{name}"
        else:
            continue
        out[key] = value
    return out
