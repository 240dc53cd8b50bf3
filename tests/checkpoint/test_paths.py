"""Finding what to load: one-line errors that name the path and what to do."""

from __future__ import annotations

import pytest

from meshspeed.checkpoint.errors import CheckpointError
from meshspeed.checkpoint.paths import check_tag, list_tags, resolve


def make_ckpt(root, tag):
    d = root / tag
    d.mkdir(parents=True)
    (d / "meta.json").write_text("{}")
    return d


def one_line(err) -> str:
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def test_latest_and_explicit_tags(tmp_path):
    make_ckpt(tmp_path, "global_step1")
    b = make_ckpt(tmp_path, "global_step2")
    (tmp_path / "latest").write_text("global_step2\n")
    assert resolve(tmp_path, None) == str(b)
    assert resolve(tmp_path, "global_step1").endswith("global_step1")
    assert resolve(b, None) == str(b)  # a tag directory itself
    (tmp_path / "global_step3.tmp-abcd").mkdir()  # an interrupted save is not a checkpoint
    assert list_tags(str(tmp_path)) == ["global_step1", "global_step2"]


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError) as err:
        resolve(tmp_path / "nope", None)
    assert f"{tmp_path / 'nope'} does not exist" in one_line(err)


def test_missing_tag_lists_the_available_ones(tmp_path):
    make_ckpt(tmp_path, "global_step1")
    with pytest.raises(CheckpointError) as err:
        resolve(tmp_path, "global_step9")
    msg = one_line(err)
    assert "'global_step9'" in msg and str(tmp_path) in msg and "global_step1" in msg


def test_latest_pointing_at_nothing(tmp_path):
    make_ckpt(tmp_path, "global_step1")
    (tmp_path / "latest").write_text("global_step5")
    with pytest.raises(CheckpointError) as err:
        resolve(tmp_path, None)
    msg = one_line(err)
    assert "latest names 'global_step5'" in msg and "tag=" in msg and "global_step1" in msg


def test_no_latest_and_no_tag(tmp_path):
    with pytest.raises(CheckpointError) as err:
        resolve(tmp_path, None)
    assert "no 'latest' file" in one_line(err) and "no complete checkpoint" in one_line(err)


def test_incomplete_directory_and_interrupted_replacement(tmp_path):
    (tmp_path / "t").mkdir()
    with pytest.raises(CheckpointError, match="has no meta.json"):
        resolve(tmp_path, "t")
    make_ckpt(tmp_path, "u.old-1a2b3c")
    with pytest.raises(CheckpointError, match=r"previous copy was left at .*u\.old-1a2b3c"):
        resolve(tmp_path, "u")


@pytest.mark.parametrize("tag", ["", "a/b", "latest", ".hidden", "x.tmp-1"])
def test_bad_tags(tag):
    with pytest.raises(CheckpointError, match="invalid checkpoint tag"):
        check_tag(tag)


@pytest.mark.parametrize("target", ["../other/global_step2", "/abs/global_step2", "..", "."])
def test_load_refuses_latest_pointing_outside(tmp_path, target):
    """Issue 9 case 6: load follows `latest` only to a tag inside the directory, as save does."""
    other = tmp_path / "other"
    make_ckpt(other, "global_step2")  # a real checkpoint the pointer could reach
    run = tmp_path / "run"
    make_ckpt(run, "global_step1")
    (run / "latest").write_text(target + "\n")
    with pytest.raises(CheckpointError) as err:
        resolve(run, None)
    msg = one_line(err)
    assert f"names {target!r}, which is not a checkpoint inside {run}" in msg
    assert "global_step1" in msg  # the available tags


@pytest.mark.parametrize("tag", ["..", "../other/global_step2", "/abs/x"])
def test_load_refuses_path_tags(tmp_path, tag):
    make_ckpt(tmp_path / "other", "global_step2")
    run = tmp_path / "run"
    make_ckpt(run, "global_step1")
    with pytest.raises(CheckpointError) as err:
        resolve(run, tag)
    assert "invalid checkpoint tag" in one_line(err)
