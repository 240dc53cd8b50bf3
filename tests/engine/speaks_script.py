"""A user's training script with no logging set-up, for tests/engine/test_speaks.py; run
on 2 ranks. Four parts, each announced by a marker line on rank 0 ("PHASE <name>"):
quiet by the config's log_level, the default (4 steps, steps_per_print 2, wall_clock_breakdown), quiet by
MESHSPEED_LOG_LEVEL over the config's "info", and after the script's own
logging.basicConfig (every rank calls it, as scripts do)."""

from __future__ import annotations

import logging
import os
import sys

import torch
import torch.distributed as dist

import meshspeed
from meshspeed.models.gpt import GPT, GPTConfig

CONFIG = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 2, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1}}


def phase(name: str) -> None:
    if dist.is_initialized():
        dist.barrier()  # the previous part's lines are out
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"PHASE {name}", flush=True)


def train(steps: int, **config) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=16, max_seq_len=8, n_layer=1, n_head=2, d_model=16))
    engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config={**CONFIG, **config})
    tokens = torch.randint(0, 16, (2, 8))
    for _ in range(steps):
        engine.backward(engine(tokens, tokens))
        engine.step()
    sys.stdout.flush()


if __name__ == "__main__":
    torch.set_num_threads(1)
    phase("quiet")
    train(2, log_level="warning")
    phase("default")
    train(4, wall_clock_breakdown=True)
    phase("env")
    os.environ["MESHSPEED_LOG_LEVEL"] = "warning"
    train(2, log_level="info")
    del os.environ["MESHSPEED_LOG_LEVEL"]
    phase("user")
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="USER %(message)s")
    train(2)
    phase("end")
