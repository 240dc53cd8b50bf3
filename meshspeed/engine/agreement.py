"""Ranks agree on what they are about to do before an optimizer step.

Note [agreement before each step]
Ranks that disagree on the step they are taking (one skipped `engine.step()`, or ran a
micro-step more) would otherwise go on silently: data-parallel replicas drift apart, a
sharded optimizer steps on gradients of different steps. Before each optimizer step the
engine all-reduces one small int64 vector over the data-parallel group: the counters
(global step, micro step, skipped steps), the number and the digest of the collectives
the rank issued on the group since the previous agreement (Note [collective digest] in
comm/sequence.py), and their negations, with MAX, which gives every rank the largest and
the smallest value of each in one collective (80 bytes; measured cost in
docs/benchmarks.md). Only when they differ does it pay for an object all-gather to learn
which rank holds what (the counters, or the first collective where the ranks part), and
every rank raises the same `DivergenceError`.

Note [agreement before a micro-step's forward]
The step agreement catches a skipped `engine.step()` only if the skipping rank reaches
an agreement too. Where its next forward communicates (ZeRO-3's parameter gathers, tensor,
context and expert parallelism), it would instead sit in those collectives while the
others sit in the step agreement, until the comms timeout (300 s). So there the same
agreement also runs at the start of each micro-step's forward, before its first
collective: a rank that skipped a step meets the others' step agreement (or the next
forward's) with a micro-step count one short, and every rank raises at once, naming each
rank's place. It costs one more 80-byte all-reduce per micro-step, only where the forward
already communicates. Where the forward does not (stages 0-2 with data parallelism alone),
the skipping rank knows by itself: its forward follows a backward with no step(); if the
step it skipped was at the accumulation boundary, the others are in the step agreement, so
it joins with an agreement at that forward and every rank raises the same report. (A
skipped step inside an accumulation window is refused by the rank's next backward.)
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from meshspeed import comm
from meshspeed.comm import sequence
from meshspeed.comm.sequence import format_location

STEP_COUNTERS = ("global_step", "micro_step", "skipped_steps")
SEQUENCE_COUNTERS = ("collectives", "collective_digest")  # Note [collective digest]


def step_agreement_bytes(world: int) -> int:
    """Ring bytes of the agreement all-reduce before each optimizer step (CommCounter's
    accounting: 2 (N-1)/N of the 2 x (step + sequence counters) int64 values)."""
    return round(2 * (world - 1) / world * 2 * (len(STEP_COUNTERS) + len(SEQUENCE_COUNTERS)) * 8)


class DivergenceError(RuntimeError):
    """Ranks disagree on what they are about to do (names the ranks and their counters)."""


def agree(what: str, counters: dict[str, int], group=None, device: torch.device | None = None,
          place: str = "step") -> None:
    """Raise DivergenceError on every rank of `group` unless all hold the same `counters`
    and issued the same group collectives since the previous agreement. `place`: which
    agreement this is ("step" or "forward"); a report of ranks at different places names
    each one's `what` and the script's line."""
    if not comm.is_initialized() or comm.get_world_size(group) == 1:
        return
    count, digest, recent = sequence.take_window(group)
    values = torch.tensor([*counters.values(), count, digest], dtype=torch.int64, device=device)
    both = torch.cat([values, -values])
    comm.all_reduce(both, group=group, op="max")
    sequence.take_window(group)  # the agreement itself opens the next window
    n = len(values)
    if torch.equal(both[:n], -both[n:]):
        return
    everyone = comm.all_gather_object((dict(counters), count, digest, recent, (place, what, _user_location())),
                                      group=group)
    ranks = _group_ranks(group)
    raise DivergenceError(_report(what, everyone, ranks))


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # meshspeed/
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


def _user_location() -> str:
    """file:line of the nearest caller outside meshspeed and torch (the script's
    `engine.step()` or `engine(batch)`)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith((_PACKAGE, _TORCH)):
        frame = frame.f_back
    return "?" if frame is None else format_location((frame.f_code.co_filename, frame.f_lineno))


def _group_ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def _report(what: str, everyone: list, ranks: list[int]) -> str:
    states = [got for got, *_ in everyone]
    places = [place for *_, place in everyone]  # (place, what, the script's line)
    common = max(states, key=states.count)
    lines = [f"  rank {rank}: " + ", ".join(f"{k} {v}" for k, v in got.items())
             + ("   <-- differs" if got != common else "") for rank, got in zip(ranks, states)]
    where = [] if len({w for _, w, _ in places}) == 1 else [  # one place: the head names it
        f"  rank {rank} is before {w} ({loc})" for rank, (_, w, loc) in zip(ranks, places)]
    if len({p for p, _, _ in places}) > 1:  # Note [agreement before a micro-step's forward]
        head = ("ranks are at different places (a rank skipped engine.step(), or ran a different "
                "number of micro-steps); every rank stops:")
    elif all(got == common for got in states):
        head = (f"ranks issued different collectives since the previous step, before {what} "
                f"(a rank took another code path); every rank stops:")
        lines += _first_difference(everyone, ranks)
    else:
        head = (f"ranks disagree before {what} (a rank skipped engine.step(), or ran a different "
                f"number of micro-steps); every rank stops:")
    return "\n".join([head, *where, *lines])


def _first_difference(everyone: list, ranks: list[int]) -> list[str]:
    """Lines naming, per rank, the first collective of the window where the ranks part."""
    counts = [count for _, count, *_ in everyone]
    calls = [recent for _, _, _, recent, _ in everyone]
    longest = max(len(c) for c in calls)
    for i in range(longest):
        shapes = [c[i][1:4] if i < len(c) else None for c in calls]
        if len(set(shapes)) > 1:
            break
    else:
        return [f"  collectives since the previous step: {dict(zip(ranks, counts))}"]
    lines = [f"  collectives since the previous step: {dict(zip(ranks, counts))}; the first that differs:"]
    for rank, c in zip(ranks, calls):
        if i < len(c):
            seq, op, numel, dtype, where = c[i]
            lines.append(f"    rank {rank}: #{seq} {op} of {numel if numel >= 0 else '?'} {dtype} "
                         f"at {format_location(where)}")
        else:
            lines.append(f"    rank {rank}: none (it issued {len(c)} in this window)")
    return lines
