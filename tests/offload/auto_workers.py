"""Functions tests/offload/test_auto_defaults.py runs on gloo ranks (module level: they
travel by reference)."""

from __future__ import annotations

import gc
import logging

import torch

from meshspeed.models.gpt import GPT, GPTConfig

# small enough for CI: a root of 2 x 512 x 64 and blocks of about 50K elements
TINY = {"vocab_size": 512, "d_model": 64, "n_layer": 3, "n_head": 4, "max_seq_len": 16}


def tutorial(nvme: str, **zero) -> dict:
    """The ZeRO-Infinity tutorial's config: stage 3, both offloads on nvme, nothing else
    (plus a batch, bf16 and an optimizer, which the tutorial's script gives)."""
    return {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3,
                                  "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
                                  "offload_param": {"device": "nvme", "nvme_path": nvme}, **zero}}


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def tutorial_run(nvme: str, available: int, steps: int = 2, **zero) -> dict:
    """initialize the tiny GPT with the tutorial's config, MemAvailable reading
    `available`, and train: the ZeRO-Infinity lines this rank logged, the losses, the
    settings the engine runs with, or the ConfigError's text."""
    import meshspeed
    from meshspeed.config import ConfigError
    from meshspeed.offload import auto, close

    real = auto.available_host_bytes
    auto.available_host_bytes = lambda: available
    lines = _Lines()
    log = logging.getLogger("meshspeed")
    log.addHandler(lines)
    engine = None
    try:
        torch.manual_seed(0)
        model = GPT(GPTConfig(**TINY))
        # our handler counts as logging the program configured (meshspeed/process/speak.py):
        # log_level then sets the "meshspeed" logger's level
        config = tutorial(nvme, **zero) | {"log_level": "info"}
        try:
            engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(),
                                              config=config)
        except ConfigError as err:
            return {"error": str(err), "lines": [x for x in lines.lines if "ZeRO-Infinity" in x]}
        g = torch.Generator().manual_seed(1)
        x = torch.randint(0, TINY["vocab_size"], (2, TINY["max_seq_len"] + 1), generator=g)
        losses = []
        for _ in range(steps):
            loss = engine(x[:, :-1], x[:, 1:])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        z = engine.config.zero_optimization
        settings = {"sub_group_size": z.sub_group_size,
                    "stage3_max_live_parameters": z.stage3_max_live_parameters,
                    "stage3_prefetch_bucket_size": z.stage3_prefetch_bucket_size,
                    "offload_optimizer.buffer_count": z.offload_optimizer.buffer_count,
                    "offload_param.buffer_count": z.offload_param.buffer_count,
                    "offload_param.buffer_size": z.offload_param.buffer_size}
        return {"lines": [x for x in lines.lines if "ZeRO-Infinity" in x], "losses": losses,
                "settings": settings}
    finally:
        auto.available_host_bytes = real
        log.removeHandler(lines)
        if engine is not None:
            close(engine)
        del engine
        gc.collect()
