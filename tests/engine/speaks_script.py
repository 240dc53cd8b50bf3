"""A user's training script with no logging set-up, for tests/engine/test_speaks.py.

    python speaks_script.py plain           # 4 steps, steps_per_print 2 (any world size)
    python speaks_script.py phases          # one process: quiet by config, default, quiet by
                                            # MESHSPEED_LOG_LEVEL, after basicConfig

`phases` prints a marker line before each initialize so the test can tell the parts apart.
"""

from __future__ import annotations

import logging
import os
import sys

import torch

import meshspeed
from meshspeed.models.gpt import GPT, GPTConfig

CONFIG = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 2, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1}}


def train(steps: int, **config) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=16, max_seq_len=8, n_layer=1, n_head=2, d_model=16))
    engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config={**CONFIG, **config})
    tokens = torch.randint(0, 16, (2, 8))
    for _ in range(steps):
        engine.backward(engine(tokens, tokens))
        engine.step()


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "plain":
        train(4)
    else:
        print("PHASE quiet", flush=True)
        train(2, log_level="warning")
        print("PHASE default", flush=True)
        train(2)
        print("PHASE env", flush=True)  # the variable wins over the config's "info"
        os.environ["MESHSPEED_LOG_LEVEL"] = "warning"
        train(2, log_level="info")
        del os.environ["MESHSPEED_LOG_LEVEL"]
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="USER %(message)s")
        print("PHASE user", flush=True)
        train(2)
