"""`"checkpoint": {"format": "deepspeed"}`: save_checkpoint also writes DeepSpeed's files, as
DeepSpeed's own unit test test_save_exclude_frozen_weights reads them."""

from __future__ import annotations

import os
from collections import OrderedDict

import pytest
import torch

from meshspeed.testing import run_distributed
from tests.checkpoint.ds_golden import load


class Frozen(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linears = torch.nn.ModuleList([torch.nn.Linear(10, 10) for _ in range(2)])
        self.linears[0].weight.requires_grad = False
        self.linears[0].bias.requires_grad = False

    def custom_state_dict(self, *args, **kwargs):
        return OrderedDict((k, v) for k, v in super().state_dict(*args, **kwargs).items()
                           if "linears.0.weight" not in k)

    def forward(self, x):
        for lin in self.linears:
            x = lin(x)
        return x.pow(2).mean()


def _save(stage: int, root: str) -> dict:
    import meshspeed

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Frozen()
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam"},
           "zero_optimization": {"stage": stage}, "checkpoint": {"format": "deepspeed"}}
    engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    engine.save_checkpoint(os.path.join(root, "all"))
    engine.save_checkpoint(os.path.join(root, "trainable"), exclude_frozen_parameters=True)
    model.state_dict = model.custom_state_dict
    engine.save_checkpoint(os.path.join(root, "custom"), exclude_frozen_parameters=True)
    path, _ = engine.load_checkpoint(os.path.join(root, "all"))  # meshspeed still loads its own files
    return {"loaded": path}


@pytest.mark.parametrize("stage", [1, 2])
def test_save_exclude_frozen_weights_with_switch(stage, tmp_path):
    run_distributed(_save, 1, args=(stage, str(tmp_path)))
    file = "global_step0/mp_rank_00_model_states.pt"
    everything = load(str(tmp_path / "all" / file))["module"]
    names = {n for n, _ in Frozen().named_parameters()}
    trainable = {"linears.1.weight", "linears.1.bias"}
    assert set(everything) == names
    assert set(load(str(tmp_path / "trainable" / file))["module"]) == trainable
    assert os.path.getsize(tmp_path / "all" / file) > os.path.getsize(tmp_path / "trainable" / file)
    assert set(load(str(tmp_path / "custom" / file))["module"]) == trainable
    assert os.path.exists(tmp_path / "all" / "global_step0" / "meta.json")
    assert (tmp_path / "all" / "latest").read_text() == "global_step0"
    opt = load(str(tmp_path / "all" / "global_step0" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    assert opt["optimizer_state_dict"]["partition_count"] == [1]


def test_unknown_format_is_refused():
    from meshspeed.config.checkpoint import CheckpointConfig

    assert CheckpointConfig().format == "meshspeed"
    with pytest.raises(ValueError, match="'meshspeed' or 'deepspeed'"):
        CheckpointConfig(format="torch")
