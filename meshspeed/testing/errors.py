"""What a failed multi-rank call reports: one `RankFailure` per rank that went wrong."""

from __future__ import annotations

import signal
from dataclasses import dataclass


@dataclass(frozen=True)
class RankFailure:
    """Why one rank did not return a result.

    `traceback` is the text formatted on the rank itself, so it is complete even when the
    exception object could not travel back (`exception` is then None). For a worker that
    died, `exitcode` is set (negative = killed by that signal) and `exc_type` is
    "WorkerDied".
    """

    rank: int
    exc_type: str
    message: str
    traceback: str
    exception: BaseException | None = None
    exitcode: int | None = None


class DistributedTestError(RuntimeError):
    """A function run by `run_distributed` failed on at least one rank.

    `failures` maps rank -> RankFailure for every rank that reported a failure;
    `unfinished` lists ranks that neither returned nor failed before the pool was killed
    (typically blocked in a collective waiting for the failed rank).
    """

    def __init__(
        self,
        message: str,
        failures: dict[int, RankFailure] | None = None,
        unfinished: list[int] | None = None,
    ) -> None:
        super().__init__(message)
        self.failures = dict(failures or {})
        self.unfinished = list(unfinished or [])


class DistributedTimeoutError(DistributedTestError, TimeoutError):
    """No failure was reported, but some ranks did not finish within the timeout."""


def describe_exitcode(exitcode: int | None) -> str:
    if exitcode is None:
        return "unknown exit code"
    if exitcode < 0:
        try:
            return f"exit code {exitcode} ({signal.Signals(-exitcode).name})"
        except ValueError:
            pass
    return f"exit code {exitcode}"


# Transport errors a rank sees when a peer died or failed: a consequence, not the cause.
_PEER_ERROR_MARKERS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def is_secondary(failure: RankFailure) -> bool:
    return any(marker in failure.message for marker in _PEER_ERROR_MARKERS)


def cause_first(failures: dict[int, RankFailure]) -> list[int]:
    """Ranks ordered likely-cause first: own errors and deaths before peer-loss errors."""
    return sorted(failures, key=lambda r: (is_secondary(failures[r]), r))


def format_failures(failures: dict[int, RankFailure]) -> str:
    """One block per distinct traceback; ranks with identical text share a block."""
    by_text: dict[str, list[int]] = {}
    for rank in cause_first(failures):
        by_text.setdefault(failures[rank].traceback, []).append(rank)
    blocks = []
    for text, ranks in by_text.items():
        head = f"--- rank {ranks[0]}"
        if len(ranks) > 1:
            head += f" (identical on ranks {', '.join(map(str, ranks[1:]))})"
        blocks.append(f"{head} ---\n{text.rstrip()}")
    return "\n".join(blocks)
