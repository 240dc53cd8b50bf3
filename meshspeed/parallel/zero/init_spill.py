"""`zero.Init(remote_device="nvme")`: the chunks a rank keeps, in a file until initialize.

Note [building straight to NVMe]
Under `zero.Init` each rank keeps its padded chunk of every parameter (init_shards.py):
2 bytes a parameter / dp in bf16, the one cost of building a ZeRO-Infinity model that grows
with the model (4 GiB for 2B parameters at dp 1). With `remote_device="nvme"` (DeepSpeed's
spelling, with the path from `config_dict_or_path`'s
`zero_optimization.offload_param.nvme_path`; unset, `remote_device` follows that config's
`offload_param.device`, as in DeepSpeed), each chunk is written to this rank's
`chunks.bin` as soon as it is cut from the replayed parameter and freed. Whatever reads a
chunk afterwards (GatheredParameters, `ds_tensor`, the unit build in `initialize`) reads
it back: one parameter's chunk in memory at a time. The file lives in its own directory,
`<nvme_path>/meshspeed-init-rank<r>-<pid>-*/`. It goes once every parameter it holds has
been taken by `initialize` (the object is collected), or at exit.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref

import torch

from meshspeed.config.loader import read_config
from meshspeed.config.offload import OffloadParamConfig, path_for_rank
from meshspeed.process.distributed import get_local_rank


def offload_param_of(config) -> OffloadParamConfig | None:
    """The `zero_optimization.offload_param` section of a DeepSpeed config (a dict or a JSON
    file), typed by the same class initialize uses; None without one. Only this section is
    read: zero.Init often gets a config whose other values are still Hugging Face's "auto"."""
    raw = read_config(config) if config is not None else {}
    section = (raw.get("zero_optimization") or {}).get("offload_param")
    if section is None:
        return None
    return OffloadParamConfig.checked(section, "zero_optimization.offload_param.")


def nvme_path_from(offload: OffloadParamConfig | None) -> str:
    """The directory zero.Init(remote_device="nvme") writes its chunks to."""
    if offload is None or not offload.nvme_path:
        raise ValueError('zero.Init(remote_device="nvme") needs config_dict_or_path: the DeepSpeed config '
                         "whose zero_optimization.offload_param.nvme_path says where to write (a directory "
                         "on a fast local disk)")
    path = path_for_rank(offload.nvme_path, get_local_rank())  # a list: this rank's disk
    if not os.path.isdir(path):
        raise ValueError(f'zero.Init(remote_device="nvme"): zero_optimization.offload_param.nvme_path '
                         f"{path!r} is not a directory; create it or point nvme_path elsewhere")
    return path


class ChunkFile:
    """Chunks appended to one file; `put` returns where a chunk went, `get` reads it back."""

    def __init__(self, directory: str, rank: int):
        self.dir = tempfile.mkdtemp(prefix=f"meshspeed-init-rank{rank}-{os.getpid()}-", dir=directory)
        self.path = os.path.join(self.dir, "chunks.bin")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self.end = 0
        self._finalizer = weakref.finalize(self, _remove, self.fd, self.dir)

    def put(self, chunk: torch.Tensor) -> int:
        """Append `chunk`'s bytes; returns their offset."""
        view = memoryview(chunk.detach().contiguous().view(-1).view(torch.uint8).numpy())
        offset, done = self.end, 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], offset + done)
        self.end += len(view)
        return offset

    def get(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(numel, dtype=dtype)
        view = memoryview(out.view(torch.uint8).numpy())
        done = 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n == 0:
                raise OSError(f"{self.path}: ends at byte {offset + done}, a chunk was expected there")
            done += n
        return out

    def nbytes(self) -> int:
        return self.end


def _remove(fd: int, directory: str) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
    shutil.rmtree(directory, ignore_errors=True)
