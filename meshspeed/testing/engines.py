"""A small GPT and an engine around it, as the multi-rank tests build them."""

from __future__ import annotations

import torch

import meshspeed
from meshspeed.models.gpt import GPT, GPTConfig

TINY = GPTConfig(vocab_size=16, max_seq_len=4, n_layer=1, n_head=2, d_model=8)


def small_engine(stage: int = 0, cfg: GPTConfig = TINY, seed: int = 0, **config):
    """`meshspeed.initialize` over `GPT(cfg)` built from `seed`: micro-batch 1, AdamW lr 1e-3,
    ZeRO `stage`; keyword arguments are merged into the config."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    base = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage}}
    engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config={**base, **config})
    return engine


def train_step(engine, tokens: torch.Tensor) -> torch.Tensor:
    """One micro-step on `tokens` as input and target: forward, backward, step."""
    loss = engine(tokens, tokens)
    engine.backward(loss)
    engine.step()
    return loss
