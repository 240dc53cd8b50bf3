"""Tiny models and configs shared by the compression tests."""

import torch
from torch import nn

from meshspeed.models.gpt import GPT, GPTConfig

torch.set_num_threads(1)

GPT_CFG = GPTConfig(vocab_size=32, max_seq_len=8, n_layer=2, n_head=4, d_model=32, ffn_hidden=32)


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def gpt(seed: int = 0, **changes) -> GPT:
    torch.manual_seed(seed)
    cfg = GPTConfig(**{**GPT_CFG.__dict__, **changes})
    return GPT(cfg)


def convnet(seed: int = 0, bn: bool = False) -> nn.Sequential:
    torch.manual_seed(seed)
    layers = [nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8) if bn else nn.Identity(), nn.ReLU(),
              nn.Conv2d(8, 6, 3, padding=1)]
    return nn.Sequential(*layers)


def tokens(seed: int = 1) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randint(0, GPT_CFG.vocab_size, (2, 8))


def technique(shared: dict, groups: dict) -> dict:
    """One technique block: {"shared_parameters": ..., "different_groups": ...}."""
    return {"shared_parameters": {"enabled": True, **shared}, "different_groups": groups}


def group(modules, related=None, **params) -> dict:
    out = {"params": params, "modules": modules}
    if related is not None:
        out["related_modules"] = related
    return out


def config(**techniques) -> dict:
    return {"compression_training": techniques}
