"""`check_host_memory` at initialize: the host bytes offload needs, from the config's bounds."""

from types import SimpleNamespace

import pytest

from meshspeed.config.errors import ConfigError
from meshspeed.offload import setup as offload_setup
from meshspeed.planner.offload import WRITES_IN_FLIGHT


def _strategy(units):
    return SimpleNamespace(units=[SimpleNamespace(shard_numel=sum(spans), spans=[SimpleNamespace(numel=n) for n in spans])
                                  for spans in units])


def _cfg(device, sub_group_size=1000, buffer_count=4):
    z = SimpleNamespace(stage=3, sub_group_size=sub_group_size,
                        offload_optimizer=SimpleNamespace(device=device, buffer_count=buffer_count),
                        offload_param=SimpleNamespace(device="nvme", buffer_count=5, buffer_size=100))
    return SimpleNamespace(zero_optimization=z)


def test_nvme_needs_the_bounded_buffers_not_the_model():
    units = [[3000, 500], [10_000_000]] + [[400, 400]] * 100  # a big embedding, many blocks
    need = offload_setup._nvme_buffers(_strategy(units), _cfg("nvme"))
    # 4 buffers of the largest sub-group (the 10M-element parameter: never split), the
    # writes in flight, the largest unit's 16-bit shard + fp32 copy, the param staging pool
    assert need == 4 * 10_000_000 * 4 + WRITES_IN_FLIGHT + 6 * 10_000_000 + 5 * 100 * 2
    more_blocks = offload_setup._nvme_buffers(_strategy(units + [[400, 400]] * 1000), _cfg("nvme"))
    assert more_blocks == need


@pytest.mark.parametrize("device,advice", [("cpu", "use device \"nvme\""), ("nvme", "lower zero_optimization.sub_group_size")])
def test_too_little_host_memory_is_a_config_error_with_the_fix(monkeypatch, device, advice):
    monkeypatch.setattr(offload_setup, "available_host_bytes", lambda: 1 << 20)
    monkeypatch.setattr(offload_setup, "local_world_size", lambda: 1)
    with pytest.raises(ConfigError, match=advice):
        offload_setup.check_host_memory(_strategy([[10_000_000]]), _cfg(device))
