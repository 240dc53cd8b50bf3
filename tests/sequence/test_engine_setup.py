"""Context parallelism at initialize: the mesh's cp axis and DeepSpeed's names for it, and
one clear sentence for what cannot work (heads the all-to-all cannot split, a sequence
that cannot be cut evenly, pipeline stages with context parallelism)."""

import pytest
import torch

from meshspeed.testing import run_distributed
from meshspeed.testing.parity import ParitySetup, build_model


def _engine(setup, **kw):
    import meshspeed

    return meshspeed.initialize(model=build_model(setup, stages=setup.pp), config=setup.ds_config(), **kw)[0]


def _layout(mode):
    import torch.distributed as dist
    from meshspeed.utils import groups

    setup = ParitySetup(world=4, cp=2, cp_mode=mode, model={"n_head": 4, "d_model": 32})
    kw = {}
    if mode == "mesh_param":  # DeepSpeed's initialize(mesh_param=(dp, sp)), no config key
        setup = ParitySetup(world=4, model={"n_head": 4, "d_model": 32})
        kw["mesh_param"] = (2, 2)
    engine = _engine(setup, **kw)
    sp = engine.seq_parallel_group
    return {
        "sp_ranks": dist.get_process_group_ranks(sp),
        "same_group": sp is groups._get_sequence_parallel_group() is engine.get_sequence_parallel_group(),
        "sizes": (engine.sequence_parallel_size, engine.seq_dp_world_size, engine.dp_world_size,
                  groups._get_sequence_parallel_world_size(), groups._get_sequence_data_parallel_world_size()),
        "mode": engine.config.sequence.mode,
        "zero_group": dist.get_process_group_ranks(engine.strategy.group) if hasattr(engine.strategy, "group")
        else None,
    }


@pytest.mark.parametrize("mode", ["sp", "ring_balanced", "mesh_param"])
def test_the_sequence_axis_is_the_meshs_cp_axis(mode):
    out = run_distributed(_layout, world_size=4, args=(mode,))
    assert [o["sp_ranks"] for o in out] == [[0, 1], [0, 1], [2, 3], [2, 3]]  # cp varies fastest after tp
    assert all(o["same_group"] for o in out)
    assert {o["sizes"] for o in out} == {(2, 4, 2, 2, 4)}
    assert all(o["zero_group"] in (None, [0, 1, 2, 3]) for o in out)  # gradients over dp x cp
    assert {o["mode"] for o in out} == {"ring_balanced" if mode == "ring_balanced" else "ulysses"}


def _setup_error(kind):
    from meshspeed.config import ConfigError

    try:
        if kind == "heads":  # 2 heads, Ulysses degree 4
            _engine(ParitySetup(world=4, cp=4, cp_mode="sp", model={"n_head": 2, "d_model": 32}))
        elif kind == "mesh_param":
            _engine(ParitySetup(world=4, cp=2, cp_mode="sp"), mesh_param=(1, 4))
        elif kind == "pipeline":
            _engine(ParitySetup(world=4, cp=2, pp=2, model={"n_layer": 2}))
        elif kind == "length":  # 2 x cp = 8 chunks; 12 tokens
            s = ParitySetup(world=4, cp=4, seq=16, model={"n_head": 4, "d_model": 32})
            engine = _engine(s)
            ids = torch.zeros(1, 12, dtype=torch.long)
            engine(ids, ids)
    except (ConfigError, ValueError) as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("kind, says", [
    ("heads", "2 attention heads per rank are not divisible by Ulysses degree 4"),
    ("mesh_param", "sequence parallel size 4, the config for 2"),
    ("pipeline", "context parallelism (size 2) with a 2-stage PipelineModule"),
    ("length", "sequence length 12 is not divisible by 2 x degree = 8"),
])
def test_what_cannot_work_is_one_sentence(kind, says):
    out = run_distributed(_setup_error, world_size=4, args=(kind,))
    assert says in out[0], out[0]
