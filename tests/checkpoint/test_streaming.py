"""Deferred tensors in a snapshot (Note [streaming swapped state] in snapshot.py): the
writer reads each one only when it writes it, and the file is the one the values give."""

import torch

from meshspeed.checkpoint.snapshot import _range_values
from meshspeed.checkpoint.tensorfile import TensorFile, write_tensors
from meshspeed.checkpoint.writer import stream_tensors
from meshspeed.parallel.slices import Deferred, OwnedSlice
from meshspeed.topology.shards import TPShard


def test_each_deferred_is_read_when_written(tmp_path):
    values = {"a": torch.arange(6.0), "b": torch.ones(2, 3, dtype=torch.bfloat16), "c": torch.arange(4)}
    reads = []

    def reader(name):
        def read():
            reads.append(name)
            return values[name].clone()
        return read

    mixed = {"a": Deferred(torch.float32, (6,), reader("a")), "b": values["b"],
             "c": Deferred(torch.int64, (4,), reader("c"))}
    assert reads == []  # building the snapshot reads nothing
    streamed = stream_tensors(str(tmp_path / "s.safetensors"), mixed)
    assert reads == ["a", "c"]  # once each, in file order
    assert streamed == write_tensors(str(tmp_path / "w.safetensors"), values)  # same bytes, same sha
    f = TensorFile(str(tmp_path / "s.safetensors"))
    assert all(torch.equal(f.read(k), v) for k, v in values.items())


def test_deferred_range_drops_tensor_parallel_padding_like_a_tensor():
    # a (5, 3) parameter split in 2 along dim 0: this rank holds logical rows 3..4 in a
    # local piece of 3 rows, the last one padding; its owned range is local elements [2, 8)
    shard = TPShard(0, (5, 3), ((0, 3, 2),), 3, 1, 2)
    master = torch.arange(6.0)
    s = OwnedSlice("w", (3, 3), torch.float32, 2, 8, master, torch.nn.Parameter(master), True, True,
                   tp=shard)
    direct = _range_values(master, s)
    deferred = _range_values(Deferred(torch.float32, (6,), master.clone), s)
    assert deferred.shape == tuple(direct.shape) == (4,)
    assert torch.equal(deferred.read(), direct)
