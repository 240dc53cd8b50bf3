import pytest
import torch

from meshspeed.data import ByteWindows


def test_windows_shift_by_one_and_do_not_overlap():
    data = bytes(range(21))
    ds = ByteWindows(data, seq_len=4)
    assert len(ds) == 5  # windows start at 0,4,8,12,16; each reads 5 bytes
    x, y = ds[1]
    assert x.dtype == torch.long and x.tolist() == [4, 5, 6, 7]
    assert y.tolist() == [5, 6, 7, 8]
    assert ds[-1][1].tolist() == [17, 18, 19, 20]
    with pytest.raises(IndexError):
        ds[5]


def test_stride_and_tensor_input():
    data = torch.arange(10, dtype=torch.uint8)
    ds = ByteWindows(data, seq_len=3, stride=1)
    assert len(ds) == 7
    assert ds[6][0].tolist() == [6, 7, 8]
    assert len(ByteWindows(b"abc", seq_len=3)) == 0
    assert len(ByteWindows(b"", seq_len=3)) == 0
    with pytest.raises(TypeError):
        ByteWindows(torch.arange(10), seq_len=3)


def test_split_cuts_the_bytes():
    ds = ByteWindows(bytes(range(100)), seq_len=9)
    train, val = ds.split(0.8)
    assert len(train.data) == 80 and len(val.data) == 20
    assert train[0][0][0].item() == 0 and val[0][0][0].item() == 80
    assert (train.seq_len, val.stride) == (9, 9)
    with pytest.raises(ValueError):
        ds.split(1.0)
