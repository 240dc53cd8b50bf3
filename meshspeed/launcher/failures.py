"""Which rank failed first, and why, in one line: what `meshspeed run` prints last.

Each rank runs under rank_entry.py, which writes a record (`write_record`) into the folder
`meshspeed run` made for the job (ERRORS_DIR_ENV) when the script ends with an uncaught
exception: the rank, the restart, the time, the exception's one-line cause and the
traceback. After the job fails, `report` reads the records of the last restart, takes the
earliest, and gives the lines to print: that rank's traceback, the other failed ranks in
one line, and last the cause. A rank that left no record (killed by a signal, `os._exit`,
a non-Python program) is reported from torchrun's view of the failure (`fallback_cause`).

Note [the first failure is the cause]
When one rank raises, the others usually fail a moment later for that reason alone (a
collective whose peer is gone: "Connection closed by peer"), and torchrun then prints a
failure block per rank. The earliest record is the one a user needs; the later ones are
named, not repeated.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

ERRORS_DIR_ENV = "MESHSPEED_RUN_ERRORS_DIR"
FIRST_PREFIX = "meshspeed run: rank "  # remote_run.py recognises a host's last line by it
FIRST_MARK = " failed first: "


@dataclass(frozen=True)
class Record:
    rank: int
    restart: int
    time: float
    cause: str  # "ValueError: tensor_parallel.autotp_size 3 ..." (one line)
    traceback: str  # the frames of the script, without the cause line


def write_record(folder: str, environ, cause: str, traceback_text: str) -> None:
    """This rank's record (rank_entry.py); the file name keeps ranks and restarts apart."""
    rank, restart = int(environ.get("RANK", "0")), int(environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    record = {"rank": rank, "restart": restart, "time": time.time(), "cause": cause,
              "traceback": traceback_text}
    path = os.path.join(folder, f"rank{rank}.restart{restart}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)  # whole or absent, if the rank is killed while writing


def read_records(folder: str) -> list[Record]:
    """The records of the last restart that left any, earliest first."""
    records = []
    for name in os.listdir(folder):
        if name.endswith(".json"):
            try:
                with open(os.path.join(folder, name)) as f:
                    records.append(Record(**json.load(f)))
            except (OSError, ValueError, TypeError):  # a stray or unreadable file is no cause
                continue
    if not records:
        return []
    last = max(r.restart for r in records)
    return sorted((r for r in records if r.restart == last), key=lambda r: (r.time, r.rank))


def one_line(text: str, limit: int = 500) -> str:
    """`text` on one line (an exception's message may span several), cut at `limit`."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def first_line(rank: int | str, cause: str, host: str | None = None) -> str:
    where = f" on {host}" if host else ""
    return f"{FIRST_PREFIX}{rank}{where}{FIRST_MARK}{cause}"


def fallback_cause(exitcode: int, signal_name: str | None) -> str:
    """A rank's cause when it left no record: how it ended."""
    if exitcode < 0:
        hint = " (out of memory?)" if signal_name == "SIGKILL" else ""
        return f"killed by signal {signal_name or -exitcode}{hint}, before it could report an error"
    return f"exited with status {exitcode} without a Python exception"


def report(records: list[Record], fallback: tuple[int, str] | None) -> list[str]:
    """The lines `meshspeed run` prints after a failed job, the cause last.

    `fallback` is (rank, cause) from torchrun's first failure, used when no rank left a record."""
    if not records:
        if fallback is None:
            return ["meshspeed run: the job failed"]
        return [first_line(*fallback)]
    first, later = records[0], records[1:]
    lines = [line for line in first.traceback.rstrip("\n").splitlines()]
    if lines:
        lines.insert(0, f"meshspeed run: rank {first.rank}'s traceback:")
    if later:
        same = [r.rank for r in later if r.cause == first.cause]
        other = [f"rank {r.rank} ({r.cause.split(':', 1)[0]})" for r in later if r.cause != first.cause]
        parts = ([f"rank{'s' * (len(same) > 1)} {', '.join(map(str, same))} with the same error"] if same else [])
        lines.append(f"meshspeed run: after it failed: {'; '.join(parts + other)}")
    lines.append(first_line(first.rank, first.cause))
    return lines
