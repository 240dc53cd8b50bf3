"""initialize builds one mesh and takes every group from it (world 4, gloo).

The groups come from a Megatron-style mpu here (tp 2 x dp 2, the model a replica on each
tp rank, as the user's own model-parallel code would leave replicated parameters): ZeRO
shards over the dp axis only, the batch triad uses dp, the loader gives both ranks of a tp
group the same samples, and training matches a one-process reference over the dp batch.
Tensor-parallel layers themselves are tested in tests/tensor_parallel/.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from meshspeed.testing import run_distributed
from meshspeed.testing.parity import (ParitySetup, assert_close_parity, build_model, full_state_dict,
                                      reference_run, train_steps)


class _Mpu:
    """tp groups [0, 1], [2, 3]; dp groups [0, 2], [1, 3] (Megatron's order: tp fastest)."""

    def __init__(self, tp: int = 2):
        world, rank = dist.get_world_size(), dist.get_rank()
        for start in range(0, world, tp):
            g = dist.new_group(list(range(start, start + tp)))
            if rank in range(start, start + tp):
                self.tp = g
        for first in range(tp):
            g = dist.new_group(list(range(first, world, tp)))
            if rank % tp == first:
                self.dp = g

    def get_model_parallel_group(self):
        return self.tp

    def get_data_parallel_group(self):
        return self.dp

    def get_model_parallel_world_size(self):
        return dist.get_world_size(self.tp)

    def get_data_parallel_world_size(self):
        return dist.get_world_size(self.dp)


def _mpu_runs(setups):
    import meshspeed

    mpu = _Mpu()
    out = []
    for setup in setups:
        cfg = setup.ds_config()
        cfg.pop("tensor_parallel")  # the mpu supplies the layout; the model is replicated
        model = build_model(setup)
        engine, *_ = meshspeed.initialize(model=model, config=copy.deepcopy(cfg), mpu=mpu)
        facts = {"dp": engine.dp_world_size, "tp": engine.mesh.size("tp"),
                 "train_batch_size": engine.train_batch_size(),
                 "dp_coord": engine.mesh.coord("dp"), "source": engine.mesh.source,
                 "master_numel": sum(m.numel() for m in engine.strategy.masters()),
                 "model_numel": setup.gpt_config().num_params()}
        out.append((facts, (train_steps(engine, setup), full_state_dict(engine))))
    return out


@pytest.mark.timeout(600)
def test_groups_from_an_mpu_shard_over_dp_only_and_match_the_reference():
    setups = [ParitySetup(world=4, tp=2, stage=s, steps=4, gas=g) for s, g in ((0, 1), (2, 2), (3, 1))]
    results = run_distributed(_mpu_runs, 4, args=(setups,), timeout=500)
    for rank, per_setup in enumerate(results):
        for setup, (facts, got) in zip(setups, per_setup):
            assert facts["dp"] == 2 and facts["tp"] == 2 and facts["source"] == "mpu"
            assert facts["dp_coord"] == rank // 2
            assert facts["train_batch_size"] == setup.micro * setup.gas * 2  # dp, not world
            if setup.stage >= 1:  # sharded over the 2 dp ranks, not over the 4 of the world
                assert facts["master_numel"] <= -(-facts["model_numel"] // 2) + 64
                assert facts["master_numel"] >= facts["model_numel"] // 2 - 64
            assert_close_parity(reference_run(setup), got)


def _loader_samples():
    import meshspeed
    from meshspeed.testing.parity import ParitySetup, build_model

    setup = ParitySetup(world=4, tp=2)
    cfg = setup.ds_config()
    cfg.pop("tensor_parallel")
    data = torch.arange(64).reshape(32, 2)
    engine, _, loader, _ = meshspeed.initialize(model=build_model(setup), config=cfg, mpu=_Mpu(),
                                                training_data=torch.utils.data.TensorDataset(data))
    return [batch[0].tolist() for batch in loader]


def _bad_mpu():
    import meshspeed
    from meshspeed.testing.parity import ParitySetup, build_model

    class Half(_Mpu):
        def get_data_parallel_group(self):
            return self.tp  # 2 x 2 ranks named for a world of 4, but dp is really tp

    setup = ParitySetup(world=4)
    try:
        meshspeed.initialize(model=build_model(setup), config=setup.ds_config(), mpu=Half())
    except ValueError as err:
        return str(err)
    return "accepted"


@pytest.mark.timeout(300)
def test_loader_gives_one_tp_group_the_same_samples_and_a_bad_mpu_is_named():
    samples = run_distributed(_loader_samples, 4, timeout=200)
    assert samples[0] == samples[1] and samples[2] == samples[3]  # one tp group, one dp rank
    assert not set(map(tuple, sum(samples[0], []))) & set(map(tuple, sum(samples[2], [])))
    assert all(len(s) > 0 for s in samples)
    errors = run_distributed(_bad_mpu, 4, timeout=200)
    assert all("initialize(mpu=...)" in e and "share ranks" in e for e in errors), errors[0]
