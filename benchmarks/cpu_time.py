"""CPU seconds this process spent, whole and per thread, from /proc (Linux).

`cpu_seconds()` reads the process's user + system time (every thread, the exited ones
included) and each live thread's, named by its Python thread name where it has one
(trailing worker numbers dropped: "meshspeed-aio_0" and "meshspeed-aio_1" add up as
"meshspeed-aio"), else by the kernel's name for it (torch's OpenMP workers, gloo's threads).
The difference of two readings is what the process computed between them; over the wall
seconds times the cores it is how busy the machine's CPUs were with this process.
"""

from __future__ import annotations

import os
import re
import threading

_TICK = os.sysconf("SC_CLK_TCK")


def _stat_seconds(path: str) -> float | None:
    try:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:  # the thread exited between the listing and the read
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (fields 14, 15 of stat)


def _kernel_name(tid: str) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def cpu_seconds() -> dict[str, float]:
    """{"total": the process's CPU seconds, "<thread name>": that name's live threads'}."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    main = threading.main_thread().native_id
    out: dict[str, float] = {"total": _stat_seconds("/proc/self/stat") or 0.0}
    for tid in os.listdir("/proc/self/task"):
        s = _stat_seconds(f"/proc/self/task/{tid}/stat")
        if s is None:
            continue
        name = "main" if int(tid) == main else names.get(int(tid)) or _kernel_name(tid)
        name = re.sub(r"[_-]?\d+$", "", name) or name
        out[name] = out.get(name, 0.0) + s
    return out


def moved(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds per name between two readings; threads that exited in between count in
    "total" only, and the rest of "total" is reported as "exited"."""
    out = {k: max(after[k] - before.get(k, 0.0), 0.0) for k in after}  # < 0: one of a name's threads exited
    named = sum(v for k, v in out.items() if k != "total")
    out["exited"] = max(out["total"] - named, 0.0)
    return out
