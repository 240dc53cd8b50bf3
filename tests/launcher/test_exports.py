"""What every host gets in its environment: .deepspeed_env and the launching shell's."""

from __future__ import annotations

import pytest

from meshspeed.launcher.exports import EnvFileError, env_file_paths, exports, parse_env_file


def test_env_file_format():
    text = "# comment\nNCCL_IB_DISABLE=1\n\nWEIRD=a=b c\n"
    assert parse_env_file(text, "f") == {"NCCL_IB_DISABLE": "1", "WEIRD": "a=b c"}
    with pytest.raises(EnvFileError, match="f:1: expected NAME=value"):
        parse_env_file("just words", "f")


def test_home_then_cwd_then_shell(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    cwd.mkdir()
    (home / ".deepspeed_env").write_text("A=home\nB=home\n")
    (cwd / ".deepspeed_env").write_text("B=cwd\n")
    environ = {"HOME": str(home), "PYTHONPATH": "/src", "NCCL_DEBUG": "INFO", "MESHSPEED_X": "1",
               "PATH": "/usr/bin", "OTHER": "no"}
    assert exports(environ, str(cwd)) == {"A": "home", "B": "cwd", "MESHSPEED_X": "1",
                                          "NCCL_DEBUG": "INFO", "PYTHONPATH": "/src"}
    # DS_ENV_FILE names the file (an absolute path too)
    (tmp_path / "my.env").write_text("C=1\n")
    assert env_file_paths({"HOME": str(home), "DS_ENV_FILE": str(tmp_path / "my.env")}, str(cwd)) == \
        [str(tmp_path / "my.env")]
    assert exports({"HOME": str(home), "DS_ENV_FILE": str(tmp_path / "my.env")}, str(cwd)) == {"C": "1"}
