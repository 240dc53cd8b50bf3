"""DeepSpeed's files are pickles: a planted payload is refused and never runs."""

from __future__ import annotations

import os
from collections import OrderedDict

import pytest
import torch

from meshspeed.checkpoint import CheckpointError, consolidate
from meshspeed.checkpoint.deepspeed_format.discover import find_tag
from meshspeed.checkpoint.deepspeed_format.read import read_tag
from meshspeed.checkpoint.deepspeed_format.unpickle import DeepSpeedRecord, load_torch_file


class _Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _model_states(extra=None) -> dict:
    module = OrderedDict(w=torch.ones(2, 3), shift=torch.zeros(3))
    return {"module": module, "buffer_names": ["shift"], "optimizer": None,
            "param_shapes": [OrderedDict(w=torch.Size([2, 3]))], "lr_scheduler": {"last_batch_iteration": 0},
            "global_steps": 1, "global_samples": 4, "skipped_steps": 0, "dp_world_size": 1,
            "ds_config": {"zero_optimization": {"stage": 1}}, "ds_version": "0.19.8", **(extra or {})}


def _optim_states(extra=None) -> dict:
    sd = {"zero_stage": 1, "loss_scaler": None, "single_partition_of_fp32_groups": [torch.ones(6)],
          "base_optimizer_state": {"state": {0: {"step": 1, "exp_avg": torch.zeros(6), "exp_avg_sq": torch.zeros(6)}},
                                   "param_groups": [{"lr": 0.1, "params": [0]}]}, **(extra or {})}
    return {"optimizer_state_dict": sd, "ds_version": "0.19.8"}


def _layer(extra=None) -> dict:
    return OrderedDict(weight=torch.ones(2), **(extra or {}))


KINDS = {
    "mp_rank_00_model_states.pt": _model_states,
    "zero_pp_rank_0_mp_rank_00_optim_states.pt": _optim_states,
    "layer_01-model_00-model_states.pt": _layer,
}


@pytest.mark.parametrize("planted", sorted(KINDS))
def test_a_planted_payload_is_refused_and_never_runs(planted, tmp_path):
    marker = tmp_path / "ran"
    tag = tmp_path / "ckpt" / "global_step1"
    tag.mkdir(parents=True)
    (tmp_path / "ckpt" / "latest").write_text("global_step1")
    for name, make in KINDS.items():
        if name.startswith("layer_") and name != planted:
            continue  # a pipeline checkpoint only when the layer file is the one planted
        extra = {"note": _Payload(str(marker))} if name == planted else None
        torch.save(make(extra), tag / name)
    target = str(tag / planted)
    with pytest.raises(CheckpointError) as err:
        load_torch_file(target)
    assert target in str(err.value) and "posix.system" in str(err.value)
    with pytest.raises(CheckpointError, match="posix.system|pipeline"):
        read_tag(find_tag(str(tmp_path / "ckpt"), None))
    with pytest.raises(CheckpointError, match="posix.system|pipeline"):
        consolidate(str(tmp_path / "ckpt"))
    assert not marker.exists()


def test_a_clean_file_reads_with_records_as_plain_data(tmp_path):
    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save(_model_states({"epoch": 4, "seen": {1, 2}, "raw": b"\x00\xff"}), path)
    state = load_torch_file(path)
    assert torch.equal(state["module"]["w"], torch.ones(2, 3))
    assert state["param_shapes"][0]["w"] == torch.Size([2, 3])
    assert (state["epoch"], state["seen"], state["raw"]) == (4, {1, 2}, b"\x00\xff")
    assert issubclass(DeepSpeedRecord, dict)


def test_other_torch_formats_are_refused(tmp_path):
    legacy = tmp_path / "legacy.pt"
    torch.save({"a": torch.ones(1)}, legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointError, match="zip format"):
        load_torch_file(legacy)
    scripted = tmp_path / "scripted.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), scripted)
    with pytest.raises(CheckpointError, match="TorchScript"):
        load_torch_file(scripted)


@pytest.mark.parametrize("planted", ["zero/0.weight/fp32.pt", "zero/optimizer_state.pt"])
def test_a_payload_in_a_universal_checkpoint_is_refused_and_never_runs(planted, tmp_path):
    import shutil
    from pathlib import Path

    fixture = Path(__file__).parent / "fixtures" / "deepspeed" / "universal_z2_dp2" / "ckpt"
    ckpt = tmp_path / "ckpt"
    shutil.copytree(fixture, ckpt)
    marker = tmp_path / "ran"
    torch.save({"note": _Payload(str(marker))}, ckpt / "global_step2" / planted)
    with pytest.raises(CheckpointError, match="posix.system"):
        consolidate(str(ckpt))
    assert not marker.exists()
