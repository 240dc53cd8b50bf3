"""Corrupted, truncated or replaced files are caught before use and named; a full disk
during a save fails it cleanly on every rank and leaves `latest` as it was."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest

from meshspeed.checkpoint import CheckpointError, consolidate
from meshspeed.checkpoint.paths import read_latest
from meshspeed.checkpoint.tensorfile import sha256_file
from meshspeed.testing.harness import run_distributed
from tests.checkpoint import workers
from tests.checkpoint.test_tensorfile import _Exploit


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("integrity"))
    return run_distributed(workers.save_after, 2, args=(2, [2], root, 1, 2))[0][0]


@pytest.fixture
def ckpt(saved, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(saved, copy)
    return copy


def shard(ckpt, rank: int):
    return ckpt / "global_step1" / f"rank-{rank:05d}.safetensors"


def assert_one_line(msg: str, *parts: str) -> None:
    assert "\n" not in msg, msg
    for p in parts:
        assert p in msg, msg


def test_flipped_byte_is_caught_with_the_file_name(ckpt):
    path = shard(ckpt, 1)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as err:
        consolidate(ckpt)
    assert_one_line(str(err.value), str(path), "SHA-256")
    errors = run_distributed(workers.load_error, 2, args=(str(ckpt),))
    assert errors[0] == errors[1]  # every rank fails, with the same message
    assert_one_line(errors[0], str(path), "SHA-256")


def test_truncated_file_is_caught(ckpt):
    path = shard(ckpt, 0)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(CheckpointError) as err:
        consolidate(ckpt)
    assert_one_line(str(err.value), str(path), "truncated")


def test_missing_file_is_caught(ckpt):
    os.remove(shard(ckpt, 1))
    with pytest.raises(CheckpointError) as err:
        consolidate(ckpt)
    assert_one_line(str(err.value), str(shard(ckpt, 1)), "missing")


def test_planted_pickle_is_refused_even_with_forged_metadata(ckpt, tmp_path):
    marker = tmp_path / "pwned"
    path = shard(ckpt, 1)
    path.write_bytes(pickle.dumps(_Exploit(str(marker))))
    with pytest.raises(CheckpointError) as err:
        consolidate(ckpt)
    assert_one_line(str(err.value), str(path), "pickle")
    # an attacker who also rewrites meta.json gets past the checksum, not past the parser
    meta_path = ckpt / "global_step1" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["files"][path.name] = {"bytes": os.path.getsize(path), "sha256": sha256_file(str(path))}
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError) as err:
        consolidate(ckpt)
    assert_one_line(str(err.value), str(path), "not a valid safetensors file", "pickle")
    errors = run_distributed(workers.load_error, 2, args=(str(ckpt),))
    assert errors[0] and "pickle" in errors[0]
    assert not marker.exists()


def test_corrupted_metadata_is_reported(ckpt):
    meta_path = ckpt / "global_step1" / "meta.json"
    meta_path.write_text(meta_path.read_text()[:100])
    with pytest.raises(CheckpointError) as err:
        consolidate(ckpt)
    assert_one_line(str(err.value), str(meta_path), "not valid JSON")


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_disk_full_fails_cleanly_on_every_rank(tmp_path, async_save):
    save_dir = tmp_path / "ckpt"
    out = run_distributed(workers.save_with_full_disk, 2, args=(str(save_dir), 1, async_save))
    key = "pending" if async_save else "save"
    for r in (0, 1):
        assert_one_line(out[r][key], "no space left on device")
    assert "rank-00001.safetensors" in out[1][key]
    if not async_save:
        assert out[0][key] == out[1][key]
    # the failed tag never appeared, nothing half-written is left, later saves work
    assert sorted(os.listdir(save_dir)) == ["global_step1", "global_step3", "latest"]
    assert read_latest(str(save_dir)) == "global_step3" and out[0]["steps"] == 3


def test_write_with_publishes_whole_files_or_nothing(tmp_path):
    """zero_to_fp32's outputs go through write_with: a failed write leaves the old file and
    no temporary behind; a finished one replaces it."""
    from meshspeed.checkpoint.atomic import write_with

    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(b"old")

    def failing(tmp):
        with open(tmp, "wb") as f:
            f.write(b"half")
        raise RuntimeError("disk went away")

    with pytest.raises(RuntimeError, match="disk went away"):
        write_with(str(path), failing)
    assert path.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    write_with(str(path), lambda tmp: open(tmp, "wb").write(b"new"))
    assert path.read_bytes() == b"new" and sorted(p.name for p in tmp_path.iterdir()) == [path.name]
