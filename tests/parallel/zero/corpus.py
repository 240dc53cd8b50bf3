"""Training an engine on the stdlib byte corpus, then its loss on held-out windows: the
convergence runs of the ZeRO++ tests (qwZ, qgZ, all options together)."""

from __future__ import annotations

from functools import cache

import torch

from meshspeed import comm

HELD_OUT = 64  # windows at the end of the corpus, never trained on


@cache
def _windows(seq: int):
    from meshspeed.data import ByteWindows, stdlib_corpus

    return ByteWindows(stdlib_corpus(max_bytes=400_000), seq_len=seq)


def train_and_hold_out(engine, steps: int, micro: int, seq: int) -> tuple[list[float], float]:
    """`steps` steps of `micro` windows per rank (rank r takes the r-th block of each
    step's world x micro windows, spread over the corpus), then the loss on the held-out
    windows in eval mode: (per-step losses, held-out loss), the same data in every run."""
    data = _windows(seq)
    train = len(data) - HELD_OUT
    world, rank = comm.get_world_size(), comm.get_rank()

    def batch(indices):
        return (torch.stack(t) for t in zip(*(data[i] for i in indices)))

    losses = []
    for step in range(steps):
        first = step * world * micro + rank * micro
        loss = engine(*batch([(first + i) * 97 % train for i in range(micro)]))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.eval()
    with torch.no_grad():
        held = engine(*batch(range(train, len(data)))).item()
    return losses, held
