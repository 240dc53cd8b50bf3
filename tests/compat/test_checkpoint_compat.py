"""DeepSpeed's checkpoint names over meshspeed (issue 35, unit/checkpoint): the file-name
helpers, the torch.save checkpoint engine, the optimizer-wrapper class names, and the
engine's load_checkpoint / empty_partition_cache with DeepSpeed's meaning."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from meshspeed.compat.deepspeed.checkpoint.utils import (
    get_layer_ckpt_name_for_rank,
    get_model_ckpt_name_for_rank,
    get_zero_ckpt_name_for_rank,
)
from meshspeed.compat.deepspeed.runtime.checkpoint_engine import (
    CheckpointCommitInfo,
    TorchCheckpointEngine,
)
from meshspeed.compat.deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
from meshspeed.compat.deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from meshspeed.compat.deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from meshspeed.compat.deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from meshspeed.testing import run_distributed
from meshspeed.testing.engines import small_engine, train_step

WRAPPERS = (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3, FP16_Optimizer, FP16_UnfusedOptimizer)


def test_deepspeed_file_names():
    assert get_model_ckpt_name_for_rank(os.path.join("ck", "global_step3"), "01") == \
        os.path.join("ck", "global_step3", "mp_rank_01_model_states.pt")
    assert get_zero_ckpt_name_for_rank("ck/t", 3, 1) == \
        os.path.join("ck/t", "zero_pp_rank_3_mp_rank_01_optim_states.pt")
    assert get_layer_ckpt_name_for_rank("ck/t", "layer_02", 0) == \
        os.path.join("ck/t", "layer_02-model_00_model_states.pt")


def test_torch_checkpoint_engine_round_trip(tmp_path):
    engine = TorchCheckpointEngine()
    state = {"w": torch.arange(6.0).reshape(2, 3), "nested": [torch.tensor([1, 2]), {"step": 7}]}
    info = CheckpointCommitInfo(tag="t1", save_dir=str(tmp_path), save_latest=True)
    engine.create(info)
    engine.makedirs(str(tmp_path / "t1"), exist_ok=True)
    engine.save(state, str(tmp_path / "t1" / "state.pt"))
    assert engine.commit(info) is True
    back = engine.load(str(tmp_path / "t1" / "state.pt"), map_location="cpu")
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["nested"][0], torch.tensor([1, 2]))
    assert back["nested"][1] == {"step": 7}
    assert engine.name == "TorchCheckpointEngine" and engine.zipfile_serialization is False
    # a DeepSpeed config object's checkpoint section chooses the zip format (default on)
    assert TorchCheckpointEngine(SimpleNamespace(checkpoint_config={})).zipfile_serialization is True
    off = SimpleNamespace(checkpoint_config={"checkpoint_serialization": False})
    assert TorchCheckpointEngine(off).zipfile_serialization is False


@pytest.mark.parametrize("cls", WRAPPERS)
def test_wrapper_names_refuse_to_be_built(cls):
    with pytest.raises(TypeError, match=f"no {cls.__name__} to build"):
        cls(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))


def _optim_state(engine) -> list[dict[str, torch.Tensor]]:
    return [{k: v.clone() for k, v in s.items() if torch.is_tensor(v)}
            for s in engine.optimizer.state.values()]


def _params(engine) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.module.parameters()]


def _zero2_load(save_dir: str) -> dict:
    """ZeRO-2 on 2 ranks: a trained engine saves; a differently trained one loads it with
    and without its optimizer state; an empty directory loads nothing, while a directory
    with checkpoints but no `latest`, or none at all, is an error."""
    from meshspeed import comm
    from meshspeed.checkpoint import CheckpointError

    x = torch.randint(0, 16, (1, 4), generator=torch.Generator().manual_seed(comm.get_rank()))
    saved = small_engine(2, seed=0)
    for _ in range(2):
        train_step(saved, x)
    saved.save_checkpoint(save_dir, tag="t")
    no_latest = os.path.join(save_dir, "no_latest")
    saved.save_checkpoint(no_latest, tag="x", save_latest=False)
    fresh = small_engine(2, seed=1)
    train_step(fresh, x.flip(1))
    fresh_state = _optim_state(fresh)
    before = _params(fresh)
    empty = os.path.join(save_dir, "empty") if comm.get_rank() == 0 else None
    if empty is not None:
        os.makedirs(empty, exist_ok=True)
    comm.barrier()
    nothing = fresh.load_checkpoint(os.path.join(save_dir, "empty"))
    refused = []
    for where in (no_latest, os.path.join(save_dir, "missing")):  # checkpoints there / a wrong path
        try:
            fresh.load_checkpoint(where)
        except CheckpointError as err:
            refused.append(str(err))
    unchanged = all(torch.equal(a, b) for a, b in zip(before, _params(fresh)))
    path, _ = fresh.load_checkpoint(save_dir, tag="t", load_optimizer_states=False)
    weights_only = {"params": _params(fresh), "state": _optim_state(fresh)}
    fresh.load_checkpoint(save_dir, tag="t", load_optimizer_states=True)
    return {
        "nothing": nothing, "refused": refused, "unchanged": unchanged, "path": path,
        "saved_params": _params(saved), "saved_state": _optim_state(saved), "fresh_state": fresh_state,
        "weights_only": weights_only, "full_state": _optim_state(fresh),
        "optim_file": fresh._get_optimizer_ckpt_name(save_dir, "t", 0),
        "is_wrapper": [isinstance(saved.optimizer, cls) for cls in WRAPPERS],
        "sparse": fresh.sparse_tensor_module_names,
    }


def _same(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b))


def test_zero2_load_with_and_without_optimizer_states(tmp_path):
    for rank, got in enumerate(run_distributed(_zero2_load, world_size=2, args=(str(tmp_path),))):
        assert got["nothing"] == (None, None) and got["unchanged"]
        assert len(got["refused"]) == 2
        assert "available tags: x" in got["refused"][0] and "does not exist" in got["refused"][1]
        assert got["path"] == os.path.join(str(tmp_path), "t")
        for a, b in zip(got["weights_only"]["params"], got["saved_params"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert got["fresh_state"] and not _same(got["fresh_state"], got["saved_state"])
        assert _same(got["weights_only"]["state"], got["fresh_state"])  # the fresh optimizer's, kept
        assert _same(got["full_state"], got["saved_state"])
        assert got["optim_file"] == os.path.join(str(tmp_path), "t", f"rank-{rank:05d}.safetensors")
        assert os.path.isfile(got["optim_file"])
        assert got["is_wrapper"] == [False] * len(WRAPPERS)
        assert got["sparse"] == set()


def _partition_cache(empty_cache: bool) -> dict:
    from dataclasses import replace

    from meshspeed.zero import ZeroParamStatus

    from meshspeed.testing.engines import TINY

    # tied: the shared matrix stays in the root unit, whole from the forward to the backward
    # (Note [the root unit split] in meshspeed/parallel/zero/grouping.py); untied, the
    # embedding and the head are released after their own forward and nothing stays whole
    engine = small_engine(3, cfg=replace(TINY, tie_embeddings=True))
    x = torch.randint(0, 16, (1, 4))
    loss = engine(x, x)
    whole_after_forward = sum(p.ds_status == ZeroParamStatus.AVAILABLE for p in engine.module.parameters())
    if empty_cache:
        engine.empty_partition_cache()
    whole = sum(p.ds_status == ZeroParamStatus.AVAILABLE for p in engine.module.parameters())
    engine.backward(loss)
    engine.step()
    train_step(engine, x)
    return {"after_forward": whole_after_forward, "whole": whole,
            "masters": [m.detach().clone() for m in engine.optimizer.param_groups[0]["params"]]}


def test_empty_partition_cache_shards_what_a_forward_left_whole():
    kept = run_distributed(_partition_cache, world_size=2, args=(False,))
    emptied = run_distributed(_partition_cache, world_size=2, args=(True,))
    for a, b in zip(kept, emptied):
        assert a["after_forward"] > 0 and a["whole"] == a["after_forward"]
        assert b["whole"] == 0
        for x, y in zip(a["masters"], b["masters"]):  # the backward gathered them again
            assert torch.equal(x, y)


def _exclude_frozen(save_dir: str, stage: int) -> dict:
    """A model whose MLP is frozen saves without it (DeepSpeed's exclude_frozen_parameters);
    another engine loads that non-strictly and keeps its own MLP values."""
    import meshspeed
    from meshspeed.models.gpt import GPT
    from meshspeed.testing.engines import TINY

    def build(seed: int):
        torch.manual_seed(seed)
        model = GPT(TINY)
        for name, p in model.named_parameters():
            p.requires_grad = ".mlp." not in name
        engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(), config={
            "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
        return engine

    x = torch.randint(0, 16, (1, 4))
    saved = build(0)
    train_step(saved, x)
    saved.save_checkpoint(save_dir, tag="t", exclude_frozen_parameters=True)
    other = build(3)
    mine = {n: p.detach().clone() for n, p in other.module.named_parameters()}
    other.load_checkpoint(save_dir, tag="t", load_module_strict=False)
    return {"saved": {n: p.detach().clone() for n, p in saved.module.named_parameters()},
            "mine": mine, "loaded": {n: p.detach().clone() for n, p in other.module.named_parameters()}}


@pytest.mark.parametrize("stage", [1, 2])
def test_save_leaving_out_frozen_parameters(tmp_path, stage):
    from meshspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    got = run_distributed(_exclude_frozen, world_size=2, args=(str(tmp_path), stage))[0]
    state = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="t")
    frozen = {n for n in got["saved"] if ".mlp." in n}
    assert frozen and not frozen & set(state)  # left out of the checkpoint
    assert set(state) >= set(got["saved"]) - frozen
    for name, value in got["loaded"].items():
        expected = got["mine"][name] if name in frozen else got["saved"][name]
        assert torch.equal(value, expected), name
