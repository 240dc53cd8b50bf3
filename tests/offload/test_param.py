"""Stage-3 parameter shards in host memory or swap files (meshspeed/offload/param.py).

The stores are tested on stand-in units in one process, then end to end on 2 ranks."""

from types import SimpleNamespace

import pytest
import torch

from meshspeed.offload.aio import SwapEngine
from meshspeed.offload.param import HostShardStore, NvmeShardStore
from meshspeed.testing import run_distributed
from tests.offload.workers import breakdown, exact_adamw, offload, runs_and_cleanup, setup


def _units(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [SimpleNamespace(shard=torch.randn(n, generator=g).to(dtype), device=torch.device("cpu"))
            for n in (1000, 37, 4096, 512)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("buffers", [1, 2, 3])
def test_nvme_store_fetch_write_and_prefetch(tmp_path, dtype, buffers):
    units = _units(dtype)
    want = [u.shard.clone() for u in units]
    store = NvmeShardStore(units, str(tmp_path), SwapEngine(), buffer_count=buffers,
                           buffer_numel=4096, pin=False)
    assert all(u.shard.numel() == 0 for u in units)  # only on disk now
    for _ in range(3):  # forward order, then backward order, twice: prefetch follows it
        for i in [0, 1, 2, 3, 3, 2, 1, 0]:
            assert torch.equal(store.fetch(units[i]), want[i])
            store.done(units[i])
    assert buffers < 2 or store._pending  # the next unit's read is already in flight
    new = torch.randn(4096).to(dtype)
    store.write(units[2], new.float())  # values arrive in fp32 (masters) and are cast
    assert torch.equal(store.fetch(units[2]), new)
    store.done(units[2])
    held = [store.fetch(u) for u in units]  # four gathers in flight, at most 3 buffers
    assert all(torch.equal(h, w) for h, w in zip(held, [want[0], want[1], new, want[3]]))
    for u in units:
        store.done(u)
    assert store.nvme_bytes() == sum(-(-w.numel() * w.element_size() // 4096) * 4096 for w in want)
    store.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvme_store_reads_and_writes_a_shard_larger_than_a_buffer_in_pieces(tmp_path, dtype):
    """Note [shards larger than a staging buffer]: a 4096-element shard through 1024-element
    buffers (it raised a ConfigError before); the pool is sized by the buffer."""
    units = _units(dtype)
    want = [u.shard.clone() for u in units]
    store = NvmeShardStore(units, str(tmp_path), SwapEngine(), buffer_count=2, buffer_numel=1024,
                           pin=False)
    with pytest.raises(ValueError, match="into"):
        store.fetch(units[2])
    for _ in range(2):
        for i in [0, 1, 2, 3, 3, 2, 1, 0]:
            into = torch.empty(want[i].numel(), dtype=dtype)
            got = store.fetch(units[i], into=into)
            assert torch.equal(got, want[i])
            assert (got is into) == (i == 2)  # only the big one is read in place
            store.done(units[i])
    new = torch.randn(4096).to(dtype)
    store.write(units[2], new.float())
    assert torch.equal(store.fetch(units[2], into=torch.empty(4096, dtype=dtype)), new)
    store.done(units[2])
    es = want[0].element_size()
    assert all(b.numel() * 4 <= -(-1024 * es // 4096) * 4096 + 4096 for b in store.pool.tensors())
    store.close()


def test_host_store_on_cpu_serves_the_shard_itself():
    units = _units()
    store = HostShardStore(units, pin=False)
    assert store.fetch(units[0]) is not None and torch.equal(store.fetch(units[0]), units[0].shard)
    store.write(units[1], torch.zeros(37))
    assert units[1].shard.abs().sum() == 0



def test_param_offload_matches_stage3(tmp_path):
    zero_nvme = {"offload_param": {"device": "nvme", "nvme_path": str(tmp_path),
                                   "buffer_count": 2}, **offload("cpu")}
    zero_cpu = {"offload_param": {"device": "cpu"}, **offload("cpu")}
    setups = [setup(3, extra_config=exact_adamw()),
              setup(3, zero_cpu, extra_config=exact_adamw()),
              setup(3, zero_nvme, extra_config=exact_adamw()),
              setup(3, zero_nvme, precision="bf16", extra_config=exact_adamw()),
              setup(3, precision="bf16", extra_config=exact_adamw())]
    base, cpu, nvme, nvme16, base16 = run_distributed(runs_and_cleanup, world_size=2,
                                                      args=(setups,), timeout=300)[0]
    for got, want in ((cpu, base), (nvme, base), (nvme16, base16)):
        assert got[0] == want[0]
        for name in want[1]:
            assert torch.equal(got[1][name], want[1][name]), name
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_shards_larger_than_buffer_size_train_like_stage3(tmp_path, precision):
    """Everything on nvme with `offload_param.buffer_size` (1024 elements) far below the
    shards (the root unit's and the blocks'; a ConfigError before): the shards stream in
    pieces (Note [shards larger than a staging buffer]) and the run is bit for bit the
    run without offload (reference kernel)."""
    zero = {**offload("nvme", str(tmp_path), buffer_count=6), "sub_group_size": 3000,
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path),
                              "buffer_count": 2, "buffer_size": 1024}}
    setups = [setup(3, precision=precision, extra_config=exact_adamw()),
              setup(3, zero, precision=precision, extra_config=exact_adamw())]
    base, nvme = run_distributed(runs_and_cleanup, world_size=2, args=(setups,), timeout=300)[0]
    assert nvme[0] == base[0]
    for name in base[1]:
        assert torch.equal(nvme[1][name], base[1][name]), name


def test_param_nvme_bytes_match_the_files(tmp_path):
    zero = {"offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
            **offload("nvme", str(tmp_path))}
    r = run_distributed(breakdown, world_size=2, args=(setup(3, zero),))[0]
    mem = r["mem"]
    assert mem["tiers"]["nvme"] == r["files"]
    assert mem["params"] >= 4 * r["owned"]  # the shards, now counted from their files
    # fp32 on CPU between steps: only the gradient staging buffers stay on the device; the
    # reduced gradient shards went to their files (Note [gradients in their NVMe slot]). The
    # host buffers their landing reuses (Note [landing without fresh pages] in
    # grad_files.py) are communication buffers too, on the host tier
    assert r["grad_staging"] > 0
    assert mem["tiers"]["device"] == mem["comm_buffers"] - r["grad_staging"]
    assert mem["grads"] >= 4 * r["owned"]  # counted from the gradient files
