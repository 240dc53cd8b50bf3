"""Host memory for offloaded state: page-aligned, pinned when the accelerator can use it.

Alignment: O_DIRECT reads and writes need the buffer address, the file offset and the
length to be multiples of the device's logical block size; 4096 covers every NVMe and
ext4/xfs setup in practice. torch's CPU allocator only guarantees 64 bytes, so
`host_empty(..., align=ALIGN)` over-allocates one alignment unit and returns an aligned view (the base
stays alive through the view).

Pinning: page-locked memory is only useful for (and only granted by) an accelerator
driver; on a CPU-only machine `pin=True` silently gives ordinary memory, which is the
same memory the "device" computes in.
"""

from __future__ import annotations

import logging
import os

import torch

from meshspeed.process.accelerator import get_accelerator, meminfo_bytes

log = logging.getLogger("meshspeed")

ALIGN = 4096


def round_up(nbytes: int, align: int = ALIGN) -> int:
    return -(-nbytes // align) * align


def host_empty(numel: int, dtype: torch.dtype = torch.float32, *, pin: bool = False,
               align: int = 64) -> torch.Tensor:
    """An uninitialised 1-D host tensor whose data pointer is a multiple of `align` (64, the
    allocator's own alignment, costs nothing; swap buffers ask for `ALIGN`)."""
    pin = pin and _pin_ok()
    if align <= 64:
        return torch.empty(numel, dtype=dtype, pin_memory=pin)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * itemsize
    raw = torch.empty(nbytes + align, dtype=torch.uint8, pin_memory=pin)
    start = (-raw.data_ptr()) % align
    return raw[start : start + nbytes].view(dtype)


def host_zeros(numel: int, dtype: torch.dtype = torch.float32, *, pin: bool = False) -> torch.Tensor:
    return host_empty(numel, dtype, pin=pin).zero_()


def _pin_ok() -> bool:
    return get_accelerator().is_pin_available()


def available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (bytes), or None where it cannot be read."""
    return meminfo_bytes("MemAvailable:")


def local_world_size() -> int:
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
