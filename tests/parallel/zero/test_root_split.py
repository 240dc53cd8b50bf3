"""The root unit split (Note [the root unit split] in meshspeed/parallel/zero/grouping.py):
the embedding and the head are stage-3 units of their own, gathered around their own use,
a tied matrix stays in the root, training matches one process, and the gradient staging
holds one vocabulary-sized matrix where it held two."""

from __future__ import annotations

import pytest

from meshspeed.planner.offload import nvme_host_buffers
from meshspeed.testing import run_distributed
from meshspeed.testing.parity import ParitySetup, assert_close_parity, reference_run
from tests.offload.workers import runs_and_cleanup

# the vocabulary's matrix (4096 x 32 = 131k) is ten blocks (13k): the outer units dominate
WIDE_VOCAB = {"vocab_size": 4096, "max_seq_len": 16, "n_layer": 2, "n_head": 2, "d_model": 32}


def _on_nvme(path: str) -> dict:
    return {"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": path},
                                  "offload_param": {"device": "nvme", "nvme_path": path}}}


@pytest.mark.parametrize("world", [1, 2])
def test_split_units_match_one_process(world, tmp_path):
    """fp32, stage 3, two micro-steps a step: untied and tied, in memory and with both
    offloads on NVMe, against one process on the concatenated batch (in memory at world 2:
    tests/parallel/zero/test_parity.py, tied and untied)."""
    setups = [ParitySetup(stage=3, world=world, gas=2, steps=3, tie=tie,
                          extra_config=_on_nvme(str(tmp_path)) if nvme else {})
              for tie in (False, True) for nvme in ((False, True) if world == 1 else (True,))]
    results = run_distributed(runs_and_cleanup, world_size=world, args=(setups,), timeout=300)[0]
    for setup, got in zip(setups, results):
        try:
            assert_close_parity(reference_run(setup), got, rtol=1e-5, atol=1e-6)
        except AssertionError as err:
            raise AssertionError(f"tie={setup.tie} {setup.extra_config}:\n{err}") from None


def _units_and_staging(tie: bool) -> dict:
    import torch

    import meshspeed
    from meshspeed.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**WIDE_VOCAB, tie_embeddings=tie))
    # bf16 parameters, fp32 reduction: each unit's reduce-scatter output comes from the pool
    # too, as the estimate counts it (fp32 throughout reduces into the gradient buffer itself)
    ds = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6, "bf16": {"enabled": True},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    units = engine.strategy.units
    seen = []  # unit states while the second block runs, each step
    model.layers[1].register_forward_pre_hook(
        lambda *_: seen.append({u.name: u.state.value for u in units}))
    tokens = torch.randint(0, WIDE_VOCAB["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
        engine.step()
    return {"units": {u.name: u.layout.numel for u in units}, "seen": seen,
            "comm_buffers": engine.memory_breakdown()["comm_buffers"]}


def _untied_and_tied() -> dict:
    return {tie: _units_and_staging(tie) for tie in (False, True)}


@pytest.fixture(scope="module")
def measured():
    return run_distributed(_untied_and_tied, world_size=1)[0]


def test_embedding_and_head_are_released_while_the_blocks_run(measured):
    vocab = WIDE_VOCAB["vocab_size"] * WIDE_VOCAB["d_model"]
    untied, tied = measured[False], measured[True]
    assert untied["units"]["tok_emb"] == untied["units"]["lm_head"] == vocab
    assert "root" not in untied["units"]
    for states in untied["seen"]:
        assert states["tok_emb"] == states["lm_head"] == "sharded"
        assert states["layers.1"] == "whole"
    # tied: one Parameter for two modules, in the root, whole for the whole pass
    assert tied["units"]["root"] == vocab
    assert "tok_emb" not in tied["units"] and "lm_head" not in tied["units"]
    assert all(states["root"] == "whole" for states in tied["seen"])


@pytest.mark.parametrize("tie", [False, True])
def test_staging_holds_one_vocabulary_matrix_as_estimated(measured, tie):
    """The staging pool (memory_breakdown's comm_buffers at stage 3 without qwZ) is the
    estimate's gradient_staging: one vocab x d_model matrix and two blocks in flight, each
    whole plus its reduced shard (the whole unit at world 1), in the fp32 reduction dtype;
    untied it held two matrices before the split."""
    want = nvme_host_buffers({**WIDE_VOCAB, "tie_embeddings": tie})["gradient_staging"]
    got = measured[tie]["comm_buffers"]
    assert 0.95 * want <= got <= 1.01 * want, (got, want)
    vocab = WIDE_VOCAB["vocab_size"] * WIDE_VOCAB["d_model"]
    assert got < 2 * vocab * 2 * 4  # below the old root's own term (embedding + head, x2, fp32)


def test_staging_pool_keeps_a_large_buffer_for_a_large_request():
    import torch

    from meshspeed.parallel.zero.staging import StagingPool

    pool = StagingPool(torch.float32, torch.device("cpu"))
    head = pool.take(1000)
    pool.give_back(head)
    block = pool.take(300)  # the head's buffer is over 1.25x this: a buffer of its own
    assert block.untyped_storage().data_ptr() != head.untyped_storage().data_ptr()
    emb = pool.take(1000)  # finds the head's buffer free
    assert emb.untyped_storage().data_ptr() == head.untyped_storage().data_ptr()
    pool.give_back(block)
    assert pool.take(250).untyped_storage().data_ptr() == block.untyped_storage().data_ptr()  # 1.2x: reused
    pool.give_back(emb)
    assert pool.take(750).numel() == 750  # the head's 1000 is 1.33x: a buffer of its own
    assert [b.numel() for b in pool.tensors()] == [1000, 300, 750]
