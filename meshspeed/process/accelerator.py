"""A small accelerator layer: the few device operations the runtime needs, per device type.

``get_accelerator()`` is a factory; the engine calls it once and passes the instance to
whatever needs it. Nothing reads a global accelerator behind the caller's back.

Memory numbers on CPU: there is no tensor allocator to ask, so ``CpuAccelerator`` reports
the process's resident set size (RSS, from /proc/self/statm) as "allocated" and the peak
RSS (VmHWM from /proc/self/status) as "max allocated". These count everything the process
holds -- interpreter, libraries, tensors -- so absolute values are larger than on CUDA,
but differences between two readings track tensor allocations and are what tests and
benchmarks compare. ``reset_peak_memory_stats`` resets the kernel's peak (writing "5" to
/proc/self/clear_refs, Linux >= 4.0); where that is refused the peak is tracked from the
readings this object takes, which can miss a short spike between readings.
"""

from __future__ import annotations

import functools
import os
import resource
from typing import Any

import torch


class Accelerator:
    """Operations on one kind of device. Subclasses: ``CudaAccelerator``, ``CpuAccelerator``."""

    name: str = ""

    def is_available(self) -> bool:
        raise NotImplementedError

    def device_count(self) -> int:
        raise NotImplementedError

    def device(self, local_rank: int | None = None) -> torch.device:
        """The device this process should use; ``local_rank`` selects among several."""
        raise NotImplementedError

    def set_device(self, local_rank: int) -> None:
        raise NotImplementedError

    def device_name(self, device_index: int | None = None) -> str:
        """DeepSpeed's spelling: "cuda" without an index (scripts write
        `torch.device(acc.device_name(), local_rank)`), "cuda:1" with one, "cpu" always;
        usable as `tensor.to(name)`."""
        if device_index is None:
            return self.name
        return str(self.device(device_index))

    def current_device_name(self) -> str:
        return self.device_name()

    def synchronize(self) -> None:
        raise NotImplementedError

    def memory_allocated(self) -> int:
        """Bytes currently allocated (see the module note for CPU)."""
        raise NotImplementedError

    def max_memory_allocated(self) -> int:
        """Peak bytes allocated since the last ``reset_peak_memory_stats``."""
        raise NotImplementedError

    def reset_peak_memory_stats(self) -> None:
        raise NotImplementedError

    def memory_stats(self) -> dict[str, Any]:
        """Allocator statistics. Both devices provide ``allocated_bytes.all.current`` and
        ``allocated_bytes.all.peak``; CUDA adds everything ``torch.cuda.memory_stats`` has."""
        raise NotImplementedError

    def is_pin_available(self) -> bool:
        """Whether page-locked host memory (for async host<->device copies) can be made."""
        raise NotImplementedError

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """A pinned copy of a host tensor, or the tensor itself when pinning is unavailable
        or it is already pinned."""
        if not self.is_pin_available() or tensor.device.type != "cpu" or tensor.is_pinned():
            return tensor
        return tensor.pin_memory()

    def default_backend(self) -> str:
        """torch.distributed backend for this device."""
        raise NotImplementedError

    def supports_bf16(self) -> bool:
        raise NotImplementedError

    def current_device(self) -> int:
        """Index of the selected device (0 on the host, which has one)."""
        raise NotImplementedError

    def manual_seed(self, seed: int) -> None:
        """Seed this device's generator (the host generator on CPU)."""
        raise NotImplementedError

    def manual_seed_all(self, seed: int) -> None:
        """Seed the generators of every device of this type."""
        raise NotImplementedError

    def empty_cache(self) -> None:
        """Return cached, unused device memory to the driver (nothing to do on CPU)."""
        raise NotImplementedError

    def memory_reserved(self) -> int:
        """Bytes the caching allocator holds (on CPU: the same figure as memory_allocated)."""
        raise NotImplementedError

    def max_memory_reserved(self) -> int:
        raise NotImplementedError

    def total_memory(self) -> int:
        """Bytes of memory on the device (physical RAM on CPU)."""
        raise NotImplementedError

    def available_memory(self) -> int:
        """Bytes that can still be allocated (MemAvailable on CPU)."""
        raise NotImplementedError

    # -- DeepSpeed's accelerator spelling ---------------------------------------------------
    # Note [DeepSpeed accelerator names]
    # Scripts written for DeepSpeed call `get_accelerator().<name>()` with DeepSpeed's
    # method names; these are those names, defined once here over the methods above.
    def initial_seed(self) -> int:
        return torch.initial_seed()

    def is_bf16_supported(self) -> bool:
        return self.supports_bf16()

    def is_fp16_supported(self) -> bool:
        return True  # CUDA and torch's CPU kernels both implement fp16

    def is_fp64_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float32]
        if self.is_fp16_supported():
            dtypes.append(torch.float16)
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        return dtypes

    def communication_backend_name(self) -> str:
        return self.default_backend()

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` lives on this kind of device."""
        return tensor.device.type == self.name

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and self.is_pin_available() and tensor.is_pinned()

    def reset_max_memory_allocated(self) -> None:
        self.reset_peak_memory_stats()

    def is_synchronized_device(self) -> bool:
        """True where kernels finish before they return (no streams to wait for)."""
        return False

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def range_push(self, msg: str) -> None:
        """Open a named range for a profiler timeline (NVTX on CUDA; nothing on CPU)."""

    def range_pop(self) -> None:
        """Close the innermost range opened by range_push."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class CudaAccelerator(Accelerator):
    name = "cuda"

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def device(self, local_rank: int | None = None) -> torch.device:
        index = torch.cuda.current_device() if local_rank is None else local_rank
        return torch.device("cuda", index)

    def set_device(self, local_rank: int) -> None:
        torch.cuda.set_device(local_rank)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated()

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated()

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def memory_stats(self) -> dict[str, Any]:
        return dict(torch.cuda.memory_stats())

    def is_pin_available(self) -> bool:
        return torch.cuda.is_available()

    def default_backend(self) -> str:
        return "nccl"

    def supports_bf16(self) -> bool:
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_reserved(self) -> int:
        return torch.cuda.memory_reserved()

    def max_memory_reserved(self) -> int:
        return torch.cuda.max_memory_reserved()

    def total_memory(self) -> int:
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory

    def available_memory(self) -> int:
        return torch.cuda.mem_get_info()[0]

    def range_push(self, msg: str) -> None:
        torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        torch.cuda.nvtx.range_pop()


class CpuAccelerator(Accelerator):
    """The host as the compute device; memory figures are process RSS (module note)."""

    name = "cpu"

    def __init__(self) -> None:
        self._peak_fallback: int | None = None  # set when the kernel peak cannot be reset

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        """LOCAL_SIZE when a launcher set it (the processes of this node, each one "device"),
        else 1: DeepSpeed's CPU accelerator counts the same way, and test harnesses copied
        from DeepSpeed's skip a test of N ranks when this is below N."""
        local = os.environ.get("LOCAL_SIZE", "")
        return int(local) if local.isdigit() and int(local) > 0 else 1

    def device(self, local_rank: int | None = None) -> torch.device:
        return torch.device("cpu")

    def set_device(self, local_rank: int) -> None:
        pass  # one host device; nothing to select

    def synchronize(self) -> None:
        pass  # CPU kernels complete before returning

    def memory_allocated(self) -> int:
        rss = _rss_bytes()
        if self._peak_fallback is not None:
            self._peak_fallback = max(self._peak_fallback, rss)
        return rss

    def max_memory_allocated(self) -> int:
        rss = self.memory_allocated()
        if self._peak_fallback is not None:
            return self._peak_fallback
        return max(_peak_rss_bytes(), rss)

    def reset_peak_memory_stats(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
            self._peak_fallback = None
        except OSError:
            self._peak_fallback = _rss_bytes()

    def memory_stats(self) -> dict[str, Any]:
        current, peak = self.memory_allocated(), self.max_memory_allocated()
        return {
            "allocated_bytes.all.current": current,
            "allocated_bytes.all.peak": peak,
            "rss_bytes": current,
            "peak_rss_bytes": peak,
        }

    def is_pin_available(self) -> bool:
        # Pinning exists to speed host->device copies; with no device it only costs.
        return False

    def default_backend(self) -> str:
        return "gloo"

    def supports_bf16(self) -> bool:
        return True  # torch implements bf16 kernels on CPU (slow without AVX512-BF16/AMX)

    def current_device(self) -> int:
        return 0

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def empty_cache(self) -> None:
        pass  # no caching allocator on the host

    def memory_reserved(self) -> int:
        return self.memory_allocated()

    def max_memory_reserved(self) -> int:
        return self.max_memory_allocated()

    def total_memory(self) -> int:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    def available_memory(self) -> int:
        return meminfo_bytes("MemAvailable:") or self.total_memory()

    def is_synchronized_device(self) -> bool:
        return True


_ACCELERATORS = {"cuda": CudaAccelerator, "cpu": CpuAccelerator}


@functools.cache
def get_accelerator(device_type: str | None = None) -> Accelerator:
    """The accelerator for ``device_type`` ("cuda" or "cpu"); ``None`` detects: CUDA when
    available, else CPU. Cached per device type; pass the result around rather than
    calling this from deep inside library code."""
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type not in _ACCELERATORS:
        raise ValueError(f"unknown device type {device_type!r}; expected one of "
                         f"{', '.join(_ACCELERATORS)}")
    accelerator = _ACCELERATORS[device_type]()
    if not accelerator.is_available():
        raise RuntimeError(f"device type {device_type!r} requested but not available "
                           f"(torch {torch.__version__}, CUDA build {torch.version.cuda})")
    return accelerator


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            resident_pages = int(f.read().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # not Linux: fall back to the peak
        return _peak_rss_bytes()


def _peak_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if os.uname().sysname == "Darwin" else peak * 1024  # macOS: bytes, else kB


def meminfo_bytes(field: str) -> int | None:
    """The /proc/meminfo line `field` (e.g. "MemAvailable:") in bytes; None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        pass
    return None


# the process's resident set and its peak (what CpuAccelerator reports), for benchmarks and tests
rss_bytes = _rss_bytes
peak_rss_bytes = _peak_rss_bytes
