"""initialize names what is wrong with a parallel layout, in one sentence, before training
(world 2, gloo)."""

from __future__ import annotations

import pytest

from meshspeed.testing import run_distributed


def _errors():
    import torch

    import meshspeed
    from meshspeed.config import ConfigError
    from meshspeed.testing.parity import ParitySetup, build_model

    out = {}
    cases = {
        "indivisible": ({"tensor_parallel": {"autotp_size": 3}}, {}),
        "sp_without_tp": ({"tensor_parallel": {"sequence_parallel": True}}, {}),
        "heads": ({"tensor_parallel": {"autotp_size": 2}}, {"n_head": 1}),
        "alias": ({"tensor_parallel": {"tp_size": 2}}, {}),
    }
    cases["tp_model_init"] = ({}, {}, 2)  # DeepSpeed's older call, no tensor_parallel block
    cases["tp_model_init_mismatch"] = ({"tensor_parallel": {"autotp_size": 2}}, {}, 1)
    for name, (extra, model, *request) in cases.items():
        setup = ParitySetup(world=2, model=model, extra_config=extra)
        net = build_model(setup)
        if request:
            meshspeed.set_autotp_mode(training=True)
            net = meshspeed.tp_model_init(net, tp_size=request[0], dtype=torch.float32)
        try:
            engine, *_ = meshspeed.initialize(model=net, config=setup.ds_config())
            out[name] = f"ok tp={engine.mesh.size('tp')} dp={engine.dp_world_size}"
        except ConfigError as err:
            out[name] = str(err)
    return out


@pytest.mark.timeout(300)
def test_layout_errors_name_the_key_and_numbers():
    got = run_distributed(_errors, 2, timeout=200)[0]
    assert "tensor_parallel.autotp_size: 3 does not divide the world size 2" in got["indivisible"]
    assert got["indivisible"].endswith("launch a multiple of 3 processes (now 2)"), got["indivisible"]
    assert "need tensor_parallel.autotp_size > 1" in got["sp_without_tp"]
    assert "layers.0.attn.wq: 1 heads" in got["heads"] and "tp=2" in got["heads"], got["heads"]
    assert got["alias"] == "ok tp=2 dp=1"
    assert got["tp_model_init"] == "ok tp=2 dp=1"
    assert "tp_model_init asked for tp_size 1" in got["tp_model_init_mismatch"]
