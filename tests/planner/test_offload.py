"""The ZeRO-Infinity estimate (meshspeed/planner/offload.py, Note [what an
everything-on-NVMe rank holds]) against an engine with everything on NVMe: the files on
disk and each bounded buffer it names."""

from __future__ import annotations

import pytest

from meshspeed.planner.estimate import estimate_memory
from meshspeed.testing import run_distributed

SHAPE = {"vocab_size": 512, "max_seq_len": 16, "n_layer": 4, "n_head": 2, "d_model": 64}
CONFIG = {"sub_group_size": 20_000, "buffer_count": 6, "param_buffer_count": 3,
          "param_buffer_size": 8192, "max_live": 30_000, "prefetch": 10_000}


def _engine_figures(nvme_path: str) -> dict:
    import torch

    import meshspeed
    from meshspeed.models.gpt import GPT, GPTConfig
    from meshspeed.offload import close

    torch.manual_seed(0)
    cfg = GPTConfig(**SHAPE)
    with meshspeed.zero.Init(dtype=torch.bfloat16):
        model = GPT(cfg)
    c = CONFIG
    ds = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6, "bf16": {"enabled": True},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {
              "stage": 3, "sub_group_size": c["sub_group_size"],
              "stage3_param_persistence_threshold": 0,
              "stage3_max_live_parameters": c["max_live"], "stage3_prefetch_bucket_size": c["prefetch"],
              "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path, "buffer_count": c["buffer_count"],
                                    "max_in_cpu": 0},  # every state in its file (no residency)
              "offload_param": {"device": "nvme", "nvme_path": nvme_path, "buffer_count": c["param_buffer_count"],
                                "buffer_size": c["param_buffer_size"], "max_in_cpu": 0}}}
    engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
        engine.step()
    mem = engine.memory_breakdown()
    placement = engine.strategy.placement
    out = {"nvme": mem["tiers"]["nvme"],
           "optimizer_swap_buffers": sum(t.nbytes for t in engine.optimizer.store.pool.tensors()),
           "param_swap_buffers": sum(t.nbytes for t in placement.shard_store.pool.tensors()),
           "gradient_staging": sum(t.nbytes for t in engine.strategy.pool.tensors()),
           "params": sum(p.ds_numel for p in model.parameters())}
    close(engine)
    return out


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    return run_distributed(_engine_figures, world_size=1,
                           args=(str(tmp_path_factory.mktemp("swap")),), timeout=300)[0]


def test_files_on_disk_are_the_estimated_nvme_tier(measured):
    est = _estimate_for(measured["params"])
    # 16 bytes a parameter (16-bit shard, fp32 masters, two fp32 moments, 16-bit gradient),
    # each file rounded up to the 4 KiB that O_DIRECT needs
    assert est["tiers"]["nvme"] == 16 * measured["params"]
    assert est["tiers"]["nvme"] <= measured["nvme"] <= est["tiers"]["nvme"] * 1.05 + 64 * 4096


@pytest.mark.parametrize("item", ["optimizer_swap_buffers", "param_swap_buffers", "gradient_staging"])
def test_each_buffer_is_the_estimate(measured, item):
    want = _estimate_for(measured["params"])["detail"]["offload_buffers"][item]
    got = measured[item]
    # the swap pools are exact up to the 4 KiB alignment of each buffer; the staging pool
    # holds what the units in flight took (padded to the shard alignment: a few elements
    # per unit), at most the estimate and not much less
    if item == "gradient_staging":
        assert 0.75 * want <= got <= want * 1.01, (got, want)
    else:
        assert want <= got <= want + CONFIG["buffer_count"] * 4096, (got, want)


def _estimate_for(params: int):
    c = CONFIG
    return estimate_memory(
        params, 1, 3, offload_optimizer="nvme", offload_param="nvme", model_shape=SHAPE,
        micro_batch_size=2, seq_len=8, sub_group_size=c["sub_group_size"],
        optimizer_buffer_count=c["buffer_count"], param_buffer_count=c["param_buffer_count"],
        param_buffer_size=c["param_buffer_size"], max_live_parameters=c["max_live"],
        prefetch_bucket_size=c["prefetch"], comm_dtype_bytes=4)
