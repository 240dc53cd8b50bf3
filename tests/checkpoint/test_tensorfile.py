"""The safetensors reader/writer: compatible with the `safetensors` package, range reads,
and refusal of anything that is not safetensors (a pickle is never executed)."""

from __future__ import annotations

import os
import pickle
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from meshspeed.checkpoint.errors import CheckpointError
from meshspeed.checkpoint.tensorfile import (
    Spec,
    TensorFile,
    TensorFileWriter,
    sha256_file,
    write_tensors,
)


def sample() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(3, 5, generator=g),
        "bf16": torch.randn(7, generator=g).bfloat16(),
        "f16": torch.randn(2, 2, generator=g).half(),
        "i64": torch.arange(6).view(2, 3),
        "flags": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }


def test_our_files_load_with_safetensors_and_back(tmp_path):
    path = str(tmp_path / "a.safetensors")
    nbytes, digest = write_tensors(path, sample(), metadata={"format": "pt"})
    assert nbytes == os.path.getsize(path) and digest == sha256_file(path)
    theirs = load_file(path)
    ours = TensorFile(path)
    assert ours.metadata == {"format": "pt"}
    for name, t in sample().items():
        assert torch.equal(theirs[name], t) and theirs[name].dtype == t.dtype
        assert torch.equal(ours.read(name), t)


def test_reads_ranges_of_files_written_by_safetensors(tmp_path):
    path = str(tmp_path / "b.safetensors")
    save_file(sample(), path)
    f = TensorFile(path)
    out = torch.empty(4)
    f.read_into("f32", 3, 7, out)
    assert torch.equal(out, sample()["f32"].view(-1)[3:7])
    wide = torch.zeros(3, dtype=torch.float32)  # another dtype: converted through a temporary
    f.read_into("bf16", 2, 5, wide)
    assert torch.equal(wide, sample()["bf16"][2:5].float())
    with pytest.raises(ValueError):
        f.read_into("f32", 10, 20, torch.empty(10))


def test_stream_writer_checks_order_and_is_atomic(tmp_path):
    path = str(tmp_path / "c.safetensors")
    w = TensorFileWriter(path, [Spec("a", torch.float32, (2,)), Spec("b", torch.float32, (3,))])
    with pytest.raises(ValueError):
        w.write("b", torch.zeros(3))
    w.write("a", torch.zeros(2))
    assert not os.path.exists(path)  # nothing visible before close()
    w.write("b", torch.ones(3))
    w.close()
    assert torch.equal(load_file(path)["b"], torch.ones(3))
    assert os.listdir(tmp_path) == ["c.safetensors"]


def test_truncated_file_is_reported_with_its_name(tmp_path):
    path = str(tmp_path / "d.safetensors")
    write_tensors(path, {"x": torch.randn(100)})
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 10)
    with pytest.raises(CheckpointError, match="d.safetensors.*truncated"):
        TensorFile(path)
    with open(path, "r+b") as f:
        f.truncate(5)
    with pytest.raises(CheckpointError, match="d.safetensors is not a valid safetensors file"):
        TensorFile(path)


def test_garbage_header_is_refused(tmp_path):
    path = tmp_path / "e.safetensors"
    path.write_bytes(struct.pack("<Q", 6) + b"{nope}" + b"\0" * 16)
    with pytest.raises(CheckpointError, match="header is not JSON"):
        TensorFile(str(path))


class _Exploit:
    """Unpickling this would create the marker file (a stand-in for running any code)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_planted_pickle_is_refused_and_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "rank-00000.safetensors"
    path.write_bytes(pickle.dumps(_Exploit(str(marker))))
    with pytest.raises(CheckpointError, match="pickle") as err:
        TensorFile(str(path))
    assert str(path) in str(err.value) and "\n" not in str(err.value)
    zipped = tmp_path / "torch_save.safetensors"
    torch.save({"x": torch.zeros(1)}, zipped)
    with pytest.raises(CheckpointError, match="pickle"):
        TensorFile(str(zipped))
    assert not marker.exists()
