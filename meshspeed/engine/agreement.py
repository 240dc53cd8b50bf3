"""Ranks agree on what they are about to do before an optimizer step.

Note [agreement before each step]
Ranks that disagree on the step they are taking (one skipped `engine.step()`, or ran a
micro-step more) would otherwise go on silently: data-parallel replicas drift apart, a
sharded optimizer steps on gradients of different steps. Before each optimizer step the
engine all-reduces one small int64 vector over the data-parallel group: the counters
(global step, micro step, skipped steps) and their negations, with MAX, which gives every
rank the largest and the smallest value of each counter in one collective (64 bytes at
three counters; measured cost in docs/benchmarks.md). Only when they differ does it pay
for an object all-gather to learn which rank holds what, and every rank raises the same
`DivergenceError`.
"""

from __future__ import annotations

import torch

from meshspeed import comm

STEP_COUNTERS = ("global_step", "micro_step", "skipped_steps")


def step_agreement_bytes(world: int) -> int:
    """Ring bytes of the agreement all-reduce before each optimizer step (CommCounter's
    accounting: 2 (N-1)/N of the 2 x len(STEP_COUNTERS) int64 values)."""
    return round(2 * (world - 1) / world * 2 * len(STEP_COUNTERS) * 8)


class DivergenceError(RuntimeError):
    """Ranks disagree on what they are about to do (names the ranks and their counters)."""


def agree(what: str, counters: dict[str, int], group=None, device: torch.device | None = None) -> None:
    """Raise DivergenceError on every rank of `group` unless all hold the same `counters`."""
    if not comm.is_initialized() or comm.get_world_size(group) == 1:
        return
    values = torch.tensor(list(counters.values()), dtype=torch.int64, device=device)
    both = torch.cat([values, -values])
    comm.all_reduce(both, group=group, op="max")
    n = len(values)
    if torch.equal(both[:n], -both[n:]):
        return
    everyone = comm.all_gather_object(dict(counters), group=group)
    common = max(everyone, key=everyone.count)
    lines = [f"  rank {rank}: " + ", ".join(f"{k} {v}" for k, v in got.items())
             + ("   <-- differs" if got != common else "") for rank, got in enumerate(everyone)]
    raise DivergenceError(
        f"ranks disagree before {what} (a rank skipped engine.step(), or ran a different number "
        f"of micro-steps); every rank stops:\n" + "\n".join(lines))
