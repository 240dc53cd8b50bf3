"""The figures of one optimizer step, as events with DeepSpeed's names.

    Train/Samples/train_loss          mean loss of the step's micro-batches on rank 0
    Train/Samples/lr                  learning rate of the first parameter group
    Train/Samples/loss_scale          the fp16 loss scale (1.0 without fp16)
    Train/Samples/grad_norm           global gradient norm (only when clipping computes it)
    Train/Samples/samples_per_second  samples of the step (all data-parallel ranks) / its wall time
    Train/Samples/tokens_per_second   the same for tokens, when the model's first input holds
                                      token ids (an integer tensor of two or more dims)
    Train/Memory/peak_bytes_rank<r>   peak memory of rank r: the accelerator's peak allocation
                                      since the last step, or the process's peak resident size
                                      on a CPU (which never goes down)

The step of every event is the number of samples trained so far (DeepSpeed's x axis).
The loss is rank 0's, as in DeepSpeed: with data parallelism each rank sees other data.
"""

from __future__ import annotations

import resource
import sys
import time

import torch

from meshspeed import comm
from meshspeed.monitor.writers import Event


def count_tokens(inputs: tuple) -> int:
    """Token ids in the first positional input (0 when it does not hold token ids)."""
    first = inputs[0] if inputs else None
    if isinstance(first, torch.Tensor) and first.dim() >= 2 and not first.is_floating_point():
        return first.numel()
    return 0


def peak_bytes(device: torch.device) -> int:
    """This process's peak memory (see the module docstring); resets the accelerator's."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return int(peak)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux


class StepFigures:
    """Collects one optimizer step's figures on this rank; `events` closes the step."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.tokens = 0
        self.started: float | None = None
        self.samples_before = 0

    def on_forward(self, inputs: tuple, samples_so_far: int) -> None:
        if self.started is None:  # the step's first micro-batch
            self.started = time.perf_counter()
            self.samples_before = samples_so_far  # not 0 after loading a checkpoint
        self.tokens += count_tokens(inputs)

    def on_backward(self, loss: torch.Tensor) -> None:
        self.losses.append(loss.detach().float().reshape(-1).mean())

    def events(self, engine) -> list[Event]:
        """The step's events (every rank must call it: the memory figures are gathered);
        rank 0's list is the one to write."""
        seconds = time.perf_counter() - (self.started or time.perf_counter())
        peaks = [peak_bytes(engine.device)]
        if comm.is_initialized() and comm.get_world_size() > 1:
            peaks = comm.all_gather_object(peaks[0])
        step = engine.global_samples
        samples = step - self.samples_before
        out: list[Event] = []
        if self.losses:
            out.append(("Train/Samples/train_loss", float(torch.stack(self.losses).mean()), step))
        out.append(("Train/Samples/lr", float(engine.learning_rates()[0]), step))
        out.append(("Train/Samples/loss_scale", float(engine.loss_scale), step))
        if engine.grad_norm is not None:
            out.append(("Train/Samples/grad_norm", float(engine.grad_norm), step))
        if seconds > 0:
            out.append(("Train/Samples/samples_per_second", samples / seconds, step))
            if self.tokens:
                tokens = self.tokens * engine.topology.size("dp")
                out.append(("Train/Samples/tokens_per_second", tokens / seconds, step))
        out += [(f"Train/Memory/peak_bytes_rank{r}", float(b), step) for r, b in enumerate(peaks)]
        self.losses, self.tokens, self.started = [], 0, None
        return out
