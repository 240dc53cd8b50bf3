"""What a process and the disk under a path did over an interval, from /proc, the same
way for any framework (infinity_frameworks.py measures meshspeed and DeepSpeed with it).

- `read_bytes` / `write_bytes`: /proc/<pid>/io, every thread of the process. Bytes the
  process caused to be read from or written to the storage layer: page-cache hits are not
  reads, a buffered write counts when the page is dirtied (written back later by the
  kernel), a direct write when it is submitted.
- `disk_read_bytes` / `disk_write_bytes`: /proc/diskstats sectors (512 B) of the block
  device that holds the path, whoever caused them (other processes and writeback too).
- `busy_s`: that device's io_ticks, the time it had at least one request in flight;
  over the interval's wall time it is the disk busy fraction.

Without a block device under the path (tmpfs, an overlay with no device of its own) the
disk fields are None.
"""

from __future__ import annotations

import os
import time

SECTOR = 512


def proc_io(pid: int | str = "self") -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            key, value = line.split(":")
            out[key] = int(value)
    return {"read_bytes": out["read_bytes"], "write_bytes": out["write_bytes"]}


def block_device(path: str) -> str | None:
    """The /proc/diskstats name of the device holding `path`, or None."""
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    with open("/proc/diskstats") as f:
        for line in f:
            fields = line.split()
            if int(fields[0]) == major and int(fields[1]) == minor:
                return fields[2]
    return None


def _diskstats(name: str) -> tuple[int, int, int]:
    """(sectors read, sectors written, io_ticks ms) of device `name`."""
    with open("/proc/diskstats") as f:
        for line in f:
            fields = line.split()
            if fields[2] == name:
                return int(fields[5]), int(fields[9]), int(fields[12])
    raise LookupError(f"/proc/diskstats has no device {name!r}")


class DiskMeter:
    """`snapshot()` before and after an interval; `delta(a, b)` is what happened in it."""

    def __init__(self, path: str, pid: int | str = "self"):
        self.pid = pid
        self.device = block_device(path)

    def snapshot(self) -> dict:
        snap = {"t": time.perf_counter(), **proc_io(self.pid)}
        if self.device is not None:
            r, w, ticks = _diskstats(self.device)
            snap.update(disk_read_bytes=r * SECTOR, disk_write_bytes=w * SECTOR, busy_s=ticks / 1000)
        return snap

    @staticmethod
    def delta(a: dict, b: dict) -> dict:
        out = {k: b[k] - a[k] for k in a}
        wall = out.pop("t")
        out["wall_s"] = wall
        out["busy_fraction"] = out["busy_s"] / wall if "busy_s" in out and wall > 0 else None
        return out
