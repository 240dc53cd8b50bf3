"""DeepSpeed tensor-parallel checkpoints (AutoTP: mp_rank_<TT>_model_states.pt and
zero_pp_rank_<d>_mp_rank_<TT>_optim_states.pt per tp rank) loaded by meshspeed at the same
and another tp size (Note [how AutoTP pieces join] in deepspeed_format/tp.py).

fixtures/deepspeed/autotp_tp2_z1/ was saved by DeepSpeed 0.19.8 (CPU, gloo) training a
1-layer Llama with `"tensor_parallel": {"autotp_size": 2}`, ZeRO 1, fp32
(benchmarks/ds_checkpoint_pptp.py --write-fixtures; the folder's README.md); expected.json
holds the losses DeepSpeed trains after loading it.
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
from meshspeed.checkpoint.deepspeed_format.unpickle import load_torch_file
from meshspeed.testing.harness import run_distributed
from tests.checkpoint import ds_pptp_workers

ROOT = Path(__file__).parent / "fixtures" / "deepspeed" / "autotp_tp2_z1"
TAG = ROOT / "ckpt" / "global_step2"


def _module(tp_rank: int) -> dict:
    return load_torch_file(str(TAG / f"mp_rank_{tp_rank:02d}_model_states.pt"))["module"]


def test_pieces_join_along_deepspeeds_split_dims():
    ds = open_tag(find_tag(str(ROOT / "ckpt"), None))
    got = {p.name: p for p in ds.params()}
    a, b = _module(0), _module(1)
    q, o = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight"
    assert got[q].master.shape == (16, 16) and torch.equal(got[q].master, torch.cat([a[q], b[q]], 0))
    assert torch.equal(got[o].master, torch.cat([a[o], b[o]], 1))  # row-parallel: dim 1
    down = "model.layers.0.mlp.down_proj.weight"
    assert got[down].master.shape == (16, 32)
    emb = "model.embed_tokens.weight"  # replicated: one copy, not two
    assert got[emb].master.shape == (32, 16) and torch.equal(got[emb].master, a[emb])
    assert got["lm_head.weight"].master.shape == (32, 16)  # vocabulary, joined on dim 0
    for p in got.values():
        assert p.step == 2 and p.moments["exp_avg"].shape == p.master.shape
    # the moments join like the weights (tp rank 1's half is its own optimizer file's)
    assert not torch.equal(got[q].moments["exp_avg"][:8], got[q].moments["exp_avg"][8:])
    assert "universal_checkpoint_info" not in ds.client_state and ds.client_state == {"epoch": 3}


def test_consolidate_gives_whole_weights():
    got = consolidate(str(ROOT / "ckpt"))
    assert got["model.layers.0.mlp.gate_proj.weight"].shape == (32, 16)
    assert torch.equal(got["model.norm.weight"], _module(1)["model.norm.weight"])


@pytest.mark.parametrize("tp", [2, 1])
def test_trains_on_as_deepspeed_at_tp(tp):
    want = json.loads((ROOT / "expected.json").read_text())["ds_losses_after_load"]
    for r in run_distributed(ds_pptp_workers.load_and_train_tp, tp, args=(str(ROOT / "ckpt"),)):
        assert r["losses"] == pytest.approx(want, rel=1e-5)
        assert (r["global_steps"], r["client"]) == (2 + 3, {"epoch": 3})  # loaded 2, trained 3


def test_a_missing_tp_rank_is_named(tmp_path):
    shutil.copytree(ROOT / "ckpt", tmp_path / "ds")
    (tmp_path / "ds" / "global_step2" / "zero_pp_rank_0_mp_rank_01_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"zero_pp_rank_0_mp_rank_01_optim_states\.pt"):
        list(open_tag(find_tag(str(tmp_path / "ds"), None)).params())
