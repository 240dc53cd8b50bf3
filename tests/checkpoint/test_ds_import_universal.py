"""DeepSpeed universal checkpoints (`python -m deepspeed.checkpoint.ds_to_universal` output:
<tag>/zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt) loaded by meshspeed, and the config
key checkpoint.load_universal (Note [checkpoint.load_universal]).

fixtures/deepspeed/universal_z2_dp2/ holds DeepSpeed 0.19.8's ZeRO 2, dp 2 checkpoint
(`source/`) and ds_to_universal's conversion of it (`ckpt/`, with `latest_universal`);
expected.json has the losses DeepSpeed trains after loading `ckpt/` with load_universal
(benchmarks/ds_checkpoint_pptp.py --write-fixtures; the folder's README.md).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from meshspeed.checkpoint import CheckpointError, consolidate
from meshspeed.checkpoint.deepspeed_format.discover import find_tag
from meshspeed.checkpoint.deepspeed_format.kinds import open_tag
from meshspeed.testing.harness import run_distributed
from tests.checkpoint import ds_pptp_workers

FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed"
ROOT = FIXTURES / "universal_z2_dp2"


def _info() -> dict:
    return json.loads((ROOT / "expected.json").read_text())


def test_reads_what_the_zero_checkpoint_it_was_made_from_holds():
    uni = open_tag(find_tag(str(ROOT / "ckpt"), None))
    src = open_tag(find_tag(str(ROOT / "source"), None))
    assert type(uni).__name__ == "UniversalCheckpoint" and src.stage == 2 and src.dp_size == 2
    pairs = list(zip(uni.params(), src.params(), strict=True))
    assert [p.name for p, _ in pairs] == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
    for u, s in pairs:
        assert torch.equal(u.master, s.master), u.name
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(u.moments[k], s.moments[k]), (u.name, k)
        assert u.step == s.step == 2
    assert uni.group_options == src.group_options and uni.group_options[0]["betas"] == [0.9, 0.99]
    assert (uni.lr_scheduler, uni.counters, uni.client_state) == (src.lr_scheduler, src.counters, {"epoch": 3})


def test_consolidate_gives_the_masters():
    got = consolidate(str(ROOT / "ckpt"))
    src = {p.name: p.master for p in open_tag(find_tag(str(ROOT / "source"), None)).params()}
    assert set(got) == set(src) and all(torch.equal(got[n], src[n]) for n in src)


def test_trains_on_as_deepspeed_with_and_without_load_universal():
    want = _info()["ds_losses_after_load"]
    for world, stage, key in [(2, 2, True), (1, 3, True), (2, 0, False)]:
        out = run_distributed(ds_pptp_workers.load_and_train, world,
                              args=(str(ROOT / "ckpt"), "plain", stage, 1.0, key))
        for r in out:
            assert r["losses"] == pytest.approx(want, rel=1e-5), (world, stage, key)
            assert (r["global_steps"], r["client"], r["sched"]) == (2, {"epoch": 3}, 1)


def _load_universal(ckpt: str) -> str:
    return ds_pptp_workers.load_and_train(ckpt, "plain", 1, 1.0, True)


def test_load_universal_refuses_a_deepspeed_checkpoint_that_is_not_universal(tmp_path):
    shutil.copytree(ROOT / "source", tmp_path / "ds")
    with pytest.raises(Exception, match=r"checkpoint\.load_universal is true but .* not a universal one"):
        run_distributed(_load_universal, 1, args=(str(tmp_path / "ds"),))


def test_load_universal_reads_latest_universal(tmp_path):
    # `latest` names a tag that does not exist; load_universal must follow latest_universal
    shutil.copytree(ROOT / "ckpt", tmp_path / "uni")
    (tmp_path / "uni" / "latest").write_text("global_step999")
    out = run_distributed(_load_universal, 1, args=(str(tmp_path / "uni"),))
    assert out[0]["losses"] == pytest.approx(_info()["ds_losses_after_load"], rel=1e-5)
    (tmp_path / "uni" / "latest_universal").write_text("nope")
    with pytest.raises(Exception, match="nope"):
        run_distributed(_load_universal, 1, args=(str(tmp_path / "uni"),))
