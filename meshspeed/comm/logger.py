"""The `comms_logger` config block: per-op calls, ring bytes and wall time on this rank.

Times are measured on the host around the call into torch.distributed. For a blocking
call that includes waiting for the slowest peer; for `async_op=True` calls (and isend /
irecv) it is the launch only, not the transfer, so treat those times as a lower bound.
Bytes follow Note [ring bytes] in counter.py.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from typing_extensions import Self

from meshspeed.comm import counter
from meshspeed.comm.counter import COMM_OPS

log = logging.getLogger("meshspeed.comm")

# torch / DeepSpeed spellings accepted in `prof_ops`, mapped to our op names.
_OP_ALIASES = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_base": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_base": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "isend": "send",
    "irecv": "recv",
}


def _normalize_ops(prof_ops: Iterable[str] | None) -> frozenset[str]:
    if not prof_ops:
        return frozenset(COMM_OPS)
    ops = set()
    for name in prof_ops:
        op = _OP_ALIASES.get(name, name)
        if op not in COMM_OPS:
            close = difflib.get_close_matches(name, [*COMM_OPS, *_OP_ALIASES], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"comms_logger.prof_ops: unknown op {name!r}{hint}")
        ops.add(op)
    return frozenset(ops)


class CommLogger:
    """Accumulates per-op statistics while started; `format_table()` renders them.

    `prof_ops` restricts recording to those ops (None or empty: all). With `verbose`,
    every recorded call is also logged at INFO on the "meshspeed.comm" logger. A
    disabled logger records nothing and `start()` is a no-op.
    """

    def __init__(
        self, enabled: bool = True, verbose: bool = False, prof_ops: Iterable[str] | None = None
    ) -> None:
        self.enabled = enabled
        self.verbose = verbose
        self.prof_ops = _normalize_ops(prof_ops)
        self._stats: dict[str, list[float]] = {}
        self.reset()

    @classmethod
    def from_config(cls, block: Mapping[str, Any] | Any) -> CommLogger:
        """Build from a `comms_logger` block (a mapping or an object with attributes).

        As in DeepSpeed, `prof_all` (default True) records every op and `prof_ops` only
        applies when it is False.
        """
        if isinstance(block, Mapping):
            get = block.get
        else:

            def get(key: str, default: Any = None) -> Any:
                return getattr(block, key, default)

        return cls(
            enabled=bool(get("enabled", False)),
            verbose=bool(get("verbose", False)),
            prof_ops=None if get("prof_all", True) else get("prof_ops", None),
        )

    # -- recording ----------------------------------------------------------------------------

    def start(self) -> Self:
        if self.enabled:
            counter.attach(self)
        return self

    def stop(self) -> None:
        counter.detach(self)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def on_collective(self, op: str, nbytes: int, seconds: float) -> None:
        if op not in self.prof_ops:
            return
        stats = self._stats[op]  # [calls, bytes, seconds]
        stats[0] += 1
        stats[1] += nbytes
        stats[2] += seconds
        if self.verbose:
            log.info("comm %s: %d bytes in %.3f ms", op, nbytes, seconds * 1e3)

    def reset(self) -> None:
        with counter.stats_lock:
            self._stats = {op: [0, 0, 0.0] for op in COMM_OPS}

    # -- reporting ----------------------------------------------------------------------------

    def summary(self) -> dict[str, dict[str, float]]:
        """{op: {"calls": int, "bytes": int, "seconds": float}} for all seven ops."""
        with counter.stats_lock:
            return {
                op: {"calls": int(c), "bytes": int(b), "seconds": float(s)}
                for op, (c, b, s) in self._stats.items()
            }

    def format_table(self) -> str:
        """A text table of the ops called so far (plus a total row)."""
        rows = [(op, s) for op, s in self.summary().items() if s["calls"]]
        if not rows:
            return "comm: no collectives recorded"
        header = (
            f"{'comm op':<16}{'calls':>8}{'bytes':>14}{'avg size':>12}{'time ms':>12}{'avg ms':>10}"
        )
        lines = [header, "-" * len(header)]
        total = {"calls": 0, "bytes": 0, "seconds": 0.0}
        for op, s in rows:
            lines.append(_row(op, s))
            for key in total:
                total[key] += s[key]
        if len(rows) > 1:
            lines.append(_row("total", total))
        return "\n".join(lines)


def _row(name: str, s: Mapping[str, float]) -> str:
    calls = int(s["calls"])
    return (
        f"{name:<16}{calls:>8}{_human(s['bytes']):>14}{_human(s['bytes'] / calls):>12}"
        f"{s['seconds'] * 1e3:>12.3f}{s['seconds'] * 1e3 / calls:>10.3f}"
    )


def _human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")
