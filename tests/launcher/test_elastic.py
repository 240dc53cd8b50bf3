"""`meshspeed run --nnodes MIN:MAX`: the documented form becomes torchrun's c10d rendezvous,
with no variable to set (Note [the bootstrap store of a joining host]). Pure."""

from __future__ import annotations

import pytest

from meshspeed.launcher import launch
from meshspeed.launcher.ds_launcher import LaunchError
from meshspeed.launcher.elastic import local_form, nnodes_range, take_option
from tests.launcher.test_launch import parse

SHARE: dict[str, str] = {}  # the agents need no variable: rounds.py fixes what TORCH_DISABLE_SHARE_RDZV_TCP_STORE would


def plan(argv):
    return launch.launch_plan(parse(argv), device_count=0, environ={})


def test_take_option_and_ranges():
    assert take_option(["--nnodes=1:2", "-x", "--nnodes", "3", "y"], ("--nnodes",)) == ("3", ["-x", "y"])
    assert nnodes_range("1:2") == (1, 2) and nnodes_range("2") == (2, 2) and nnodes_range(None) is None
    for bad in ("a", "2:1", "0:2"):
        with pytest.raises(LaunchError, match="--nnodes"):
            nnodes_range(bad)


def test_the_documented_form_uses_c10d_at_the_master():
    result = plan(["--nnodes", "1:2", "--nproc-per-node", "2", "--master_addr", "node0", "train.py"])
    assert result.argv == ["--nproc-per-node", "2", "--nnodes", "1:2", "--rdzv-backend", "c10d",
                           "--rdzv-endpoint", "node0:29500", "--rdzv-id", "meshspeed", "train.py"]
    assert result.env == SHARE
    result = plan(["--nnodes=1:2", "--master_addr", "node0", "--master_port", "1234", "--rdzv-id", "job9",
                   "--max-restarts", "3", "train.py"])
    assert result.argv == ["--nproc-per-node", "1", "--nnodes=1:2", "--rdzv-id", "job9", "--max-restarts", "3",
                           "--rdzv-backend", "c10d", "--rdzv-endpoint", "node0:1234", "train.py"]
    # DeepSpeed's names for the range
    result = plan(["--min_elastic_nodes", "1", "--max_elastic_nodes", "3", "--master_addr", "n0", "t.py"])
    assert result.argv[2:4] == ["--nnodes", "1:3"] and result.env == SHARE


def test_a_chosen_rendezvous_is_kept_and_fixed_sizes_are_untouched():
    tokens = ["--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1"]
    assert local_form(tokens, None, None) == tokens
    assert local_form(["--nnodes", "1:2", "--standalone"], None, None) == ["--nnodes", "1:2", "--standalone"]
    assert local_form(["--nnodes", "2"], "h", None) == ["--nnodes", "2"]
    assert plan(["--nnodes", "2", "--node_rank", "0", "--master_addr", "h", "t.py"]).env == {}


@pytest.mark.parametrize(("argv", "message"), [
    (["--nnodes", "1:2", "t.py"], "needs where the nodes meet: --master_addr"),
    (["--nnodes", "1:2", "--rdzv-backend", "static", "--master_addr", "h", "t.py"], "waits for all 2 nodes"),
    (["--nnodes", "1:2", "--min_elastic_nodes", "1", "--max_elastic_nodes", "2", "t.py"], "give one"),
    (["--min_elastic_nodes", "1", "t.py"], "needs --max_elastic_nodes too"),
])
def test_elastic_forms_that_cannot_meet_are_refused(argv, message):
    with pytest.raises(LaunchError, match=message):
        plan(argv)
