"""Safetensors files, written as a stream and read by element range.

The format (https://github.com/huggingface/safetensors) is: an 8-byte little-endian header
length, a JSON header mapping each name to dtype, shape and byte offsets, then the raw
tensor bytes. It holds no code, so reading one can never execute anything.

We read and write it ourselves rather than through the `safetensors` package because the
checkpoint needs three things that package does not give together:
  * streaming writes: the header is written first from (name, dtype, shape) specs, then
    each tensor as it is produced, so `meshspeed convert` holds one parameter at a time;
  * a SHA-256 of the file computed while writing (no second read to checksum it);
  * range reads straight into a caller's tensor (`readinto`, no mmap), so loading a slice
    of a saved range allocates nothing and counts no file pages in the process RSS.
Files written here load with `safetensors.torch.load_file` and vice versa (tested).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from math import prod

import torch

from meshspeed.checkpoint.atomic import fsync_dir, temp_name
from meshspeed.checkpoint.errors import CheckpointError, describe_os_error

DTYPE_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
_MAX_HEADER = 100 * 2**20  # a header larger than this is not a checkpoint we wrote
_CHUNK = 64 * 2**20  # bytes per write/read call


def _write_chunk(f, data: memoryview) -> None:
    """The one place bytes reach the disk (tests replace it to simulate a full disk)."""
    f.write(data)


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without copying.

    Not `t.numpy()`: numpy pins the storage as non-resizable, and ZeRO-3 frees parameter
    storage by resizing it (Note [freeing storage, not swapping tensors] in unit.py). The
    caller keeps `t` alive while the view is used."""
    assert t.device.type == "cpu" and t.is_contiguous()
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def _as_bytes(t: torch.Tensor) -> tuple[torch.Tensor, memoryview]:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    return t, raw_bytes(t)


@dataclass(frozen=True)
class Spec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * self.dtype.itemsize


class TensorFileWriter:
    """Write tensors in the order of `specs`; the file appears under `path` only on close().

        with TensorFileWriter(path, specs) as w:
            for spec in specs:
                w.write(spec.name, tensor_for(spec))
        w.nbytes, w.sha256
    """

    def __init__(self, path: str, specs: Iterable[Spec], metadata: dict[str, str] | None = None):
        self.path = path
        self.specs = list(specs)
        self._tmp = temp_name(path)
        self._hash = hashlib.sha256()
        self._next = 0
        self.nbytes = 0
        header, offset = {}, 0
        for s in self.specs:
            if s.dtype not in DTYPE_CODES:
                raise CheckpointError(f"cannot write {s.name} to {path}: dtype {s.dtype} has no safetensors code")
            header[s.name] = {"dtype": DTYPE_CODES[s.dtype], "shape": list(s.shape),
                              "data_offsets": [offset, offset + s.nbytes]}
            offset += s.nbytes
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # keep tensor data 8-byte aligned, as safetensors does
        try:
            self._f = open(self._tmp, "wb")  # noqa: SIM115 - closed in close()/abort()
        except OSError as err:
            raise CheckpointError(describe_os_error(err, path, "create")) from err
        self._put(struct.pack("<Q", len(raw)) + raw)

    def _put(self, data: bytes | memoryview) -> None:
        data = memoryview(data).cast("B")
        try:
            for i in range(0, len(data), _CHUNK):
                _write_chunk(self._f, data[i : i + _CHUNK])
        except OSError as err:
            self.abort()
            raise CheckpointError(describe_os_error(err, self.path, "write")) from err
        self._hash.update(data)
        self.nbytes += len(data)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        spec = self.specs[self._next]
        if name != spec.name or tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise ValueError(f"expected {spec} next, got {name} {tensor.dtype} {tuple(tensor.shape)}")
        keep, data = _as_bytes(tensor)  # `keep` owns the memory `data` points at
        self._put(data)
        del keep
        self._next += 1

    def close(self) -> None:
        """fsync, then rename into place, then fsync the directory: all or nothing."""
        if self._next != len(self.specs):
            self.abort()
            raise ValueError(f"{self.path}: {len(self.specs) - self._next} tensor(s) never written")
        try:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            os.replace(self._tmp, self.path)
            fsync_dir(os.path.dirname(self.path) or ".")
        except OSError as err:
            self.abort()
            raise CheckpointError(describe_os_error(err, self.path, "write")) from err

    def abort(self) -> None:
        if not self._f.closed:
            self._f.close()
        if os.path.exists(self._tmp):
            os.remove(self._tmp)

    @property
    def sha256(self) -> str:
        return self._hash.hexdigest()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()
        return False


def write_tensors(path: str, tensors: dict[str, torch.Tensor],
                  metadata: dict[str, str] | None = None) -> tuple[int, str]:
    """Write a whole dict atomically; returns (file size in bytes, sha256 hex digest)."""
    specs = [Spec(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    with TensorFileWriter(path, specs, metadata) as w:
        for k, t in tensors.items():
            w.write(k, t)
    return w.nbytes, w.sha256


# -- reading ----------------------------------------------------------------------------------
def _not_safetensors(path: str, reason: str, head: bytes) -> CheckpointError:
    hint = ""
    if head[:1] == b"\x80" or head[:2] == b"PK":
        hint = (" It looks like a pickle / torch.save file; meshspeed never unpickles checkpoint "
                "files, because unpickling can run arbitrary code.")
    return CheckpointError(f"{path} is not a valid safetensors file ({reason}).{hint}")


@dataclass(frozen=True)
class Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset of the first element in the file
    nbytes: int

    @property
    def numel(self) -> int:
        return prod(self.shape)


class TensorFile:
    """Header of one safetensors file, parsed and bounds-checked; reads by element range."""

    def __init__(self, path: str):
        self.path = path
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise _not_safetensors(path, "shorter than 8 bytes", head)
                (n,) = struct.unpack("<Q", head)
                if n > min(size - 8, _MAX_HEADER):
                    raise _not_safetensors(path, f"header length {n} exceeds the file", head)
                raw = f.read(n)
        except OSError as err:
            raise CheckpointError(describe_os_error(err, path, "read")) from err
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise _not_safetensors(path, f"header is not JSON: {err}", head) from None
        self.metadata = header.pop("__metadata__", None) or {}
        data_start = 8 + n
        self.entries: dict[str, Entry] = {}
        for name, e in header.items():
            try:
                dtype = CODE_DTYPES[e["dtype"]]
                shape = tuple(int(d) for d in e["shape"])
                begin, end = (int(x) for x in e["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise _not_safetensors(path, f"bad header entry for {name!r}", head) from None
            nbytes = prod(shape) * dtype.itemsize
            if end - begin != nbytes or data_start + end > size or begin < 0:
                raise CheckpointError(f"{path}: tensor {name!r} lies outside the file "
                                      f"(truncated or corrupted); re-save or restore the file")
            self.entries[name] = Entry(dtype, shape, data_start + begin, nbytes)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def entry(self, name: str) -> Entry:
        if name not in self.entries:
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing; the checkpoint is "
                                  "incomplete or was written by another program")
        return self.entries[name]

    def read_into(self, name: str, start: int, end: int, out: torch.Tensor) -> None:
        """Copy flat elements [start, end) of tensor `name` into `out` (end - start elements).

        Reads straight into `out` when it is a contiguous CPU tensor of the saved dtype;
        otherwise through one temporary of that size."""
        e = self.entry(name)
        if not 0 <= start <= end <= e.numel or out.numel() != end - start:
            raise ValueError(f"{self.path}:{name}: range [{start}, {end}) of {e.numel} elements "
                             f"into a tensor of {out.numel()}")
        direct = out.device.type == "cpu" and out.is_contiguous() and out.dtype == e.dtype
        buf = out if direct else torch.empty(end - start, dtype=e.dtype)
        if end > start:
            view = raw_bytes(buf)
            try:
                with open(self.path, "rb") as f:
                    f.seek(e.begin + start * e.dtype.itemsize)
                    got = f.readinto(view)
            except OSError as err:
                raise CheckpointError(describe_os_error(err, self.path, "read")) from err
            if got != len(view):
                raise CheckpointError(f"{self.path}: file ends inside tensor {name!r} "
                                      "(truncated); re-save or restore the file")
        if not direct:
            out.copy_(buf.view(out.shape))

    def read(self, name: str) -> torch.Tensor:
        e = self.entry(name)
        out = torch.empty(e.shape, dtype=e.dtype)
        self.read_into(name, 0, e.numel, out.view(-1))
        return out


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 * 2**20):
            h.update(chunk)
    return h.hexdigest()
