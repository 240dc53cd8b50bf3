"""meshspeed.zero.Init: a model built partitioned trains like the same weights built whole,
and no rank ever holds more than its slices plus one unit while building."""

import os

import pytest
import torch

import meshspeed
from meshspeed import comm
from meshspeed.models.gpt import GPT, GPTConfig
from meshspeed.testing import run_distributed
from meshspeed.testing.parity import full_state_dict

CFG = GPTConfig(vocab_size=64, max_seq_len=16, n_layer=3, n_head=2, d_model=32, tie_embeddings=True)


def _config(stage):
    return {"train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 40}}


def _train(engine, steps=5):
    rank, world = comm.get_rank(), comm.get_world_size()
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(steps):
        batch = torch.randint(0, 64, (2 * world, 17), generator=g)[rank * 2:(rank + 1) * 2]
        loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        comm.all_reduce(total, op="avg")
        losses.append(total.item())
    return losses


def _init_vs_whole(stage):
    with meshspeed.zero.Init() as ctx:
        model = GPT(CFG)
    sharded_bytes = sum(p.untyped_storage().nbytes() for p in model.parameters())
    engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(stage))
    start = full_state_dict(engine)
    # the same weights, built whole, trained by a second engine
    twin = GPT(CFG)
    twin.load_state_dict(start)
    engine2, *_ = meshspeed.initialize(model=twin, model_parameters=twin.parameters(), config=_config(stage))
    return _train(engine), _train(engine2), full_state_dict(engine), full_state_dict(engine2), \
        sharded_bytes, ctx.peak_materialized_bytes


@pytest.mark.parametrize("stage", [3, 2, 0])
def test_init_built_model_trains_like_whole_model(stage):
    for losses, twin_losses, state, twin_state, sharded_bytes, peak in run_distributed(
            _init_vs_whole, world_size=2, args=(stage,)):
        assert sharded_bytes == 0  # nothing whole after Init: slices wait for initialize
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(twin_losses), rtol=1e-6, atol=0)
        for name in state:
            torch.testing.assert_close(state[name], twin_state[name], rtol=1e-6, atol=1e-7)
        largest_unit = max(4 * sum(p.numel() for p in GPT(CFG).layers[0].parameters()),
                           4 * (CFG.vocab_size * CFG.d_model + CFG.d_model))
        assert peak <= largest_unit + 4096  # one unit (+ rotary buffers) at a time


def _rss_growth_building(cfg_kwargs):
    import gc

    with meshspeed.zero.Init():  # warm up: first use of init kernels costs tens of MB once
        GPT(GPTConfig(**{**cfg_kwargs, "n_layer": 1, "d_model": 64, "n_head": 2}))
    gc.collect()
    before = _rss()
    with meshspeed.zero.Init():
        model = GPT(GPTConfig(**cfg_kwargs))
    after = _rss()
    full = 4 * sum(p.ds_numel for p in model.parameters())  # (the parameters are placeholders)
    return after - before, full


def _rss():
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_building_a_large_model_costs_a_slice_not_the_model():
    # ~50M parameters (200 MB fp32) in 16 blocks of ~12.6 MB. Each of 2 ranks keeps half the
    # model as slices; the allocator may keep a freed unit or two cached, hence the slack.
    cfg = {"vocab_size": 256, "max_seq_len": 64, "n_layer": 16, "n_head": 8, "d_model": 512}
    unit = 4 * sum(p.numel() for p in GPT(GPTConfig(**{**cfg, "n_layer": 1})).layers[0].parameters())
    for growth, full in run_distributed(_rss_growth_building, world_size=2, args=(cfg,), timeout=300):
        bound = full / 2 + 2 * unit + 32e6
        assert growth < bound < 0.8 * full, (
            f"RSS grew {growth / 1e6:.0f} MB for a {full / 1e6:.0f} MB model (bound {bound / 1e6:.0f} MB)")


# -- remote_device="nvme": Note [building straight to NVMe] in init_spill.py -----------------

def _spilled_vs_in_memory(nvme_path):
    import gc

    cfg = {"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": nvme_path}}}
    torch.manual_seed(0)
    with meshspeed.zero.Init():
        plain = GPT(CFG)
    torch.manual_seed(0)
    with meshspeed.zero.Init(remote_device="nvme", config_dict_or_path=cfg):
        spilled = GPT(CFG)
    chunk_bytes = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in plain.parameters())
    dirs = [d for d in os.listdir(nvme_path) if d.startswith(f"meshspeed-init-rank{comm.get_rank()}-")]
    on_disk = sum(os.path.getsize(os.path.join(nvme_path, d, "chunks.bin")) for d in dirs)
    # the ds_tensor of a spilled parameter is read from the file: the same values
    same_chunks = all(torch.equal(a.ds_tensor, b.ds_tensor)
                      for a, b in zip(plain.parameters(), spilled.parameters()))
    engines = [meshspeed.initialize(model=m, model_parameters=m.parameters(), config=_config(3))[0]
               for m in (plain, spilled)]
    losses = [_train(e) for e in engines]
    states = [full_state_dict(e) for e in engines]
    del engines, plain, spilled
    gc.collect()
    left = [d for d in os.listdir(nvme_path) if d.startswith(f"meshspeed-init-rank{comm.get_rank()}-")]
    return chunk_bytes, on_disk, len(dirs), same_chunks, losses, states, left


def test_init_with_remote_device_nvme_writes_chunks_to_a_file_and_trains_the_same(tmp_path):
    for chunk_bytes, on_disk, ndirs, same_chunks, losses, states, left in run_distributed(
            _spilled_vs_in_memory, world_size=2, args=(str(tmp_path),)):
        assert ndirs == 1 and on_disk == chunk_bytes > 0  # every chunk in this rank's file
        assert same_chunks
        assert losses[0] == losses[1]
        for name in states[0]:
            assert torch.equal(states[0][name], states[1][name]), name
        assert left == []  # the file goes once initialize has taken every chunk


def test_init_remote_device_errors_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="remote_device 'gpu'"):
        meshspeed.zero.Init(remote_device="gpu")
    with pytest.raises(ValueError, match="needs config_dict_or_path"):
        meshspeed.zero.Init(remote_device="nvme")
    with pytest.raises(ValueError, match="offload_param.nvme_path"):
        meshspeed.zero.Init(remote_device="nvme", config_dict_or_path={"zero_optimization": {}})
    with pytest.raises(ValueError, match="is not a directory"):
        meshspeed.zero.Init(remote_device="nvme", config_dict_or_path={
            "zero_optimization": {"offload_param": {"nvme_path": str(tmp_path / "missing")}}})
