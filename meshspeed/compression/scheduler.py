"""`compression_scheduler`: the step counter that starts each technique at its offset.

As in DeepSpeed, it counts optimizer steps that were applied (an fp16 step skipped for
overflow does not count) and, after each, starts every technique whose schedule_offset
has been reached and moves weight quantization along its bit schedule. The meshspeed
engine makes one and steps it when the config has `compression_training`; without the
engine, make one after `init_compression` and call `.step()` after each optimizer step.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from meshspeed.compression.compress import compression_config as typed
from meshspeed.compression.layers import Compressed, Phase
from meshspeed.config.errors import ConfigError
from meshspeed.parallel.protocol import StepCallback

log = logging.getLogger("meshspeed")


class compression_scheduler(StepCallback):  # DeepSpeed's (lower-case) name, which scripts import
    """Steps the techniques of every compressed layer in `model`."""

    def __init__(self, model: nn.Module, compression_config: Any):
        cfg = typed(compression_config)
        self.model = model
        self.layers = [m for m in model.modules() if isinstance(m, Compressed)]
        if cfg.enabled_techniques() and not self.layers:
            raise ConfigError(f"compression_training enables {', '.join(cfg.enabled_techniques())} "
                              "but the model has no compressed layers; call meshspeed.compression."
                              "compress.init_compression(model, config) before meshspeed.initialize")
        self.training_steps = 0
        self._started: set[str] = set()
        self.check_all_modules()

    def step(self, step_zero_check: bool = False) -> None:
        """Count one optimizer step (not with step_zero_check) and update the techniques."""
        if not step_zero_check:
            self.training_steps += 1
        self.check_all_modules()

    def check_all_modules(self) -> None:
        for layer in self.layers:
            layer.at_step(self.training_steps)
            for name, technique in layer.compression.items():
                if technique.phase is Phase.ACTIVE and name not in self._started:
                    self._started.add(name)
                    log.info("compression: %s is on from step %d", name, self.training_steps)

    @property
    def weight_quantization_enabled(self) -> bool:
        """Whether weight quantization has started (DeepSpeed's attribute)."""
        return "weight_quantization" in self._started

    def state_dict(self) -> dict[str, int]:
        return {"training_steps": self.training_steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.training_steps = int(state["training_steps"])
        self.check_all_modules()
