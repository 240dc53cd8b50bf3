"""`meshspeed estimate` with everything on NVMe: the shape assumed from a parameter count,
rows that add up, a footer of what is really left out, and the buffer setting that fits the
host's memory (meshspeed/planner/fit.py, Note [the knob that fits]). Pure arithmetic."""

from __future__ import annotations

import json

import pytest

from meshspeed.cli import main as cli_main
from meshspeed.planner import ModelShape, param_count
from meshspeed.planner.estimate import estimate_memory
from meshspeed.planner.fit import INTERPRETER, KNOBS, fit, format_fit
from meshspeed.planner.hardware import available_memory
from meshspeed.planner.offload import assumed_shape, nvme_host_buffers

GB = 10**9
INFINITY = ["--offload-optimizer", "nvme", "--offload-param", "nvme"]
# DeepSpeed's buffer settings, given: without them the estimate chooses the unset ones as
# initialize does (tests/planner/test_nvme_defaults.py)
DS_KNOBS = ["--sub-group-size", "1e9", "--optimizer-buffer-count", "4", "--param-buffer-count", "5",
            "--param-buffer-size", "1e8", "--max-live-parameters", "1e9", "--prefetch-bucket-size", "5e7"]
# docs/infinity.md's 2B model: the reference GPT, d_model 2048, 37 blocks, vocab 32768
TWO_B = ModelShape(n_layer=37, d_model=2048, n_head=16, vocab_size=32768)


@pytest.mark.parametrize("count", [1.25e8, 1.3e9, 2e9, 7e9, 70e9, 1e12])
def test_assumed_shape_has_the_count(count):
    s = assumed_shape(count)
    assert abs(param_count(s) - count) / count < 0.03, (s, param_count(s))
    assert s.d_model % s.n_head == 0 and s.d_model // s.n_head == 128


def test_two_billion_is_the_documented_model():
    assert assumed_shape(2e9) == TWO_B


def test_params_alone_itemise_the_buffers_and_say_which_shape(capsys):
    est = estimate_memory(2e9, 1, 3, offload_optimizer="nvme", offload_param="nvme")
    assert est["assumed_shape"]["n_layer"] == 37 and est["assumed_shape"]["d_model"] == 2048
    assert est["detail"]["offload_buffers"] == nvme_host_buffers(TWO_B)
    assert est["activations"] == 0  # no sequence length: not estimated, and said so

    assert cli_main(["estimate", "--params", "2e9", "--dp", "1", *INFINITY, *DS_KNOBS,
                     "--host-memory", "1TB", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "in memory with everything on NVMe (stage 3): 21.2" in out
    assert ("assumed shape from the parameter count: d_model 2048, 37 layers, 16 heads, "
            "vocab 32768") in out
    assert "--layers/--d-model/--heads/--vocab/--seq-len" in out
    # a given shape replaces the assumption, and the statement goes
    assert cli_main(["estimate", "--dp", "1", *INFINITY, "--layers", "37", "--d-model", "2048",
                     "--heads", "16", "--vocab", "32768", "--seq-len", "128", "--micro-batch",
                     "2", "--host-memory", "1TB", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "assumed shape" not in out and "in memory with everything on NVMe" in out


@pytest.mark.parametrize("shape", [None, TWO_B])
@pytest.mark.parametrize("offload", [(None, None), ("cpu", None), ("nvme", None),
                                     ("cpu", "cpu"), ("nvme", "nvme"), ("nvme", "cpu")])
@pytest.mark.parametrize("dp", [1, 4])
def test_rows_add_up(shape, offload, dp):
    opt, param = offload
    for stage in (3,) if param else (1, 2, 3):
        est = estimate_memory(2e9, dp, stage, offload_optimizer=opt, offload_param=param,
                              model_shape=shape, micro_batch_size=2, seq_len=128)
        parts = est["model_states"] + est["activations"] + est["comm_buffers"] + est["offload_buffers"]
        assert est["total"] == parts == sum(est["tiers"].values())
        buffers = est["detail"].get("offload_buffers")
        if opt == param == "nvme":  # the itemised buffers are the comm and offload rows
            assert buffers["total"] == est["comm_buffers"] + est["offload_buffers"]
            assert est["tiers"]["host"] == est["offload_buffers"]  # every state is on NVMe
        elif opt == "nvme":
            assert buffers["total"] == est["offload_buffers"]
        else:
            assert est["offload_buffers"] == 0


def test_footer_lists_only_what_is_left_out(capsys):
    assert cli_main(["estimate", "--params", "2e9", "--dp", "1", *INFINITY,
                     "--host-memory", "1TB", "--device", "cpu"]) == 0
    footer = capsys.readouterr().out.split("Not counted: ")[1]
    assert "staging" not in footer and "swap buffers" not in footer
    assert "interpreter" in footer
    # the NVMe optimizer alone: its swap buffers are not itemised, and the footer says so
    assert cli_main(["estimate", "--params", "2e9", "--dp", "1", "--stage", "3", "--tp", "2",
                     "--offload-optimizer", "nvme", "--host-memory", "1TB", "--device", "cpu"]) == 0
    assert "the NVMe optimizer's swap buffers" in capsys.readouterr().out.split("Not counted: ")[1]
    assert cli_main(["estimate", "--params", "7.5e9", "--dp", "64"]) == 0
    footer = capsys.readouterr().out.split("Not counted: ")[1]
    assert "swap" not in footer and "interpreter" not in footer


def test_short_memory_names_the_knob_and_the_value_that_fits(capsys):
    assert cli_main(["estimate", "--params", "2e9", "--dp", "1", *INFINITY, *DS_KNOBS, "--device",
                     "cpu", "--host-memory", "20e9", "--json"]) == 0
    (est,) = json.loads(capsys.readouterr().out)
    verdict = est["host_memory"]
    assert not verdict["fits"] and verdict["changes"] == {"sub_group_size": 500_000_000}
    assert verdict["need_after"] <= 20e9 < verdict["need"]

    assert cli_main(["estimate", "--params", "2e9", "--dp", "1", *INFINITY, *DS_KNOBS, "--device",
                     "cpu", "--host-memory", "20e9"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("host memory: does not fit, 21.5 GB")
    assert "with sub_group_size 1e9 (the default) the optimizer swap buffers need 16 GB" in line
    assert line.endswith("sub_group_size 5e8 fits in 13.5 GB (--sub-group-size 5e8).")


def test_ample_memory_gives_no_knob(capsys):
    assert cli_main(["estimate", "--params", "2e9", "--dp", "1", *INFINITY, *DS_KNOBS, "--device",
                     "cpu", "--host-memory", "64GiB"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("host memory: fits, 21.5 GB")
    assert "sub_group_size" not in line and "--" not in line.replace("--host-memory", "")


def _fit(available, **kwargs):
    """The 2B model of docs/infinity.md, everything on NVMe, micro batch 2 x 128 tokens."""
    args = {"offload_optimizer": "nvme", "offload_param": "nvme", "model_shape": TWO_B,
            "micro_batch_size": 2, "seq_len": 128} | kwargs
    return fit(param_count(TWO_B), 1, 3, available, **args)


def test_the_suggested_value_is_the_largest_round_one_that_fits():
    for available in (20 * GB, 12 * GB, 9 * GB):
        f = _fit(available)
        assert not f.fits and f.fits_after and f.need_after <= available
        settings = {k.arg: f.changes.get(k.key, k.default) for k in KNOBS}
        # the next round value up for each lowered setting does not fit
        for knob in KNOBS:
            if knob.key in f.changes:
                value = f.changes[knob.key]
                up = value + 1 if knob.count else next(
                    v for v in sorted(m * 10**e for e in range(13) for m in (1, 2, 5)) if v > value)
                if up < knob.default:
                    assert _fit(available, **(settings | {knob.arg: up})).need > available


def test_what_counts_is_the_estimates_ram():
    on_cpu, on_gpu = _fit(10**12), _fit(10**12, on_cpu=False)
    est = estimate_memory(param_count(TWO_B), 1, 3, offload_optimizer="nvme", offload_param="nvme",
                          model_shape=TWO_B, micro_batch_size=2, seq_len=128)
    assert on_cpu.fits and on_cpu.need == round(est["tiers"]["device"] + est["tiers"]["host"] + INTERPRETER)
    assert on_gpu.need == round(est["tiers"]["host"] + INTERPRETER)
    assert est["tiers"]["device"] == est["activations"] + est["comm_buffers"]
    assert _fit(10**12, ranks=2).need == 2 * on_cpu.need


def test_too_little_memory_says_what_is_left():
    f = _fit(3 * GB)
    assert not f.fits_after and f.need_after > 3 * GB
    text = format_fit(f, "--host-memory")
    assert "where the buffers stop shrinking" in text and "more memory" in text
    # the floors: one parameter slice per sub-group, 4 optimizer buffers (Adam, everything swapped)
    assert f.changes["sub_group_size"] >= 2048 * 32768
    assert f.changes.get("offload_optimizer.buffer_count", 4) == 4


def test_a_host_optimizer_that_does_not_fit_is_pointed_to_nvme(capsys):
    assert cli_main(["estimate", "--params", "2e9", "--dp", "1", "--stage", "2",
                     "--offload-optimizer", "cpu", "--device", "cpu", "--host-memory", "20e9"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "no buffer setting makes it fit" in line
    assert line.endswith('offload_optimizer.device "nvme" with sub_group_size 5e8 fits in 15.2 GB '
                         "(--offload-optimizer nvme --sub-group-size 5e8).")


def test_the_nvme_optimizer_alone_itemises_its_buffers(capsys):
    est = estimate_memory(2e9, 1, 2, offload_optimizer="nvme")
    buffers = est["detail"]["offload_buffers"]
    assert set(buffers) == {"optimizer_swap_buffers", "unit_gradient", "writes_in_flight", "total"}
    assert buffers["total"] == est["offload_buffers"] == est["tiers"]["host"]
    assert buffers["optimizer_swap_buffers"] == nvme_host_buffers(TWO_B)["optimizer_swap_buffers"]
    # tp splits the slices the buffers are sized by: not itemised, and the footer says so
    tp = estimate_memory(2e9, 1, 2, offload_optimizer="nvme", tp=2)
    assert tp["offload_buffers"] == 0 and any("swap buffers" in x for x in tp["not_counted"])


def test_memavailable_is_the_default_budget(capsys):
    avail = available_memory()
    if avail is None:
        pytest.skip("no /proc/meminfo here")
    assert 0 < avail
    assert cli_main(["estimate", "--params", "2e9", "--dp", "1", *INFINITY, "--device", "cpu",
                     "--json"]) == 0
    (est,) = json.loads(capsys.readouterr().out)
    assert est["host_memory"]["source"] == "MemAvailable"
    assert cli_main(["estimate", "--params", "2e9", "--dp", "1", *INFINITY, "--device", "cpu",
                     "--ranks-per-host", "0"]) == 2
    assert "--ranks-per-host must be >= 1" in capsys.readouterr().err
