"""The names DeepSpeed-style test harnesses read before any test runs (DeepSpeed's own
tests/unit/util.py and common.py, copied into many users' repositories): the accelerator
check, git_version_info, the op builders' skip guards, the torch-version check, and the CPU
device count from LOCAL_SIZE (Note [builders tell the truth] in compat/deepspeed/ops/op_builder)."""

from __future__ import annotations

import pytest
import torch

from meshspeed.compat.deepspeed import git_version_info, ops
from meshspeed.compat.deepspeed.accelerator import get_accelerator, is_current_accelerator_supported
from meshspeed.compat.deepspeed.ops import op_builder
from meshspeed.compat.deepspeed.utils.torch import required_torch_version
from meshspeed.process.accelerator import CpuAccelerator
from meshspeed.version import DEEPSPEED_VERSION


def test_the_accelerator_in_use_is_supported():
    assert get_accelerator().device_name() in ("cpu", "cuda")
    assert is_current_accelerator_supported() is True


@pytest.mark.parametrize(("local_size", "count"), [(None, 1), ("4", 4), ("0", 1), ("x", 1)])
def test_cpu_device_count_is_local_size(monkeypatch, local_size, count):
    if local_size is None:
        monkeypatch.delenv("LOCAL_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_SIZE", local_size)
    assert CpuAccelerator().device_count() == count


def test_git_version_info_names_the_matched_release_and_this_torch():
    assert git_version_info.version == DEEPSPEED_VERSION
    major, minor = torch.__version__.split(".")[:2]
    assert git_version_info.torch_info["version"] == f"{major}.{minor}"
    if not torch.cuda.is_available():
        assert git_version_info.torch_info["cuda_version"] == "0.0"
    assert git_version_info.compatible_ops == ops.__compatible_ops__


def test_builders_say_true_for_the_ops_meshspeed_has_and_why_not_for_the_rest():
    assert op_builder.FusedAdamBuilder().is_compatible()
    assert op_builder.CPUAdamBuilder().is_compatible()
    assert op_builder.AsyncIOBuilder().is_compatible()
    lamb = op_builder.FusedLambBuilder()
    assert not lamb.is_compatible()
    assert "Lamb" in lamb.incompatible_reason
    assert ops.__compatible_ops__[op_builder.FusedAdamBuilder.NAME] is True
    assert ops.__compatible_ops__[op_builder.QuantizerBuilder.NAME] is False
    # every op has one answer: implemented or a reason
    assert set(op_builder.IMPLEMENTED).isdisjoint(op_builder.NOT_PROVIDED)
    assert all(b.is_compatible() or b.incompatible_reason for b in op_builder.ALL_OPS.values())


def test_load_says_where_meshspeed_implements_the_op_instead_of_compiling():
    with pytest.raises(RuntimeError, match="meshspeed.optim.FusedAdam"):
        op_builder.FusedAdamBuilder().load()
    with pytest.raises(op_builder.OpNotProvidedError, match="no Lamb optimizer"):
        op_builder.FusedLambBuilder().load()


def test_required_torch_version():
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    assert required_torch_version(min_version=f"{major}.{minor}")
    assert required_torch_version(min_version=1.8, max_version=f"{major + 1}.0")
    assert not required_torch_version(min_version=f"{major + 1}.0")
    assert not required_torch_version(max_version="1.0")
    with pytest.raises(ValueError, match="min_version or max_version"):
        required_torch_version()
