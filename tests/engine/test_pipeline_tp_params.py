"""Issue 34, item 1: a DeepSpeed pipeline script with AutoTP lists its parameters before
`initialize` (`model_parameters=[q for q in net.parameters() if q.requires_grad]`, a
generator, `filter(...)`, weight-decay groups), and tensor parallelism then replaces the
split layers' Parameters with their shards. Every form must name the shards it meant
(Note [model_parameters by name] in meshspeed/optim/builder.py) and train as one process
does, at pp 2 x tp 2 and pp 2 x tp 2 x dp 2. The script is tests/parallel/pipeline/layer_spec_run.py:
`PipelineModule(layers=[LayerSpec...], num_stages=2)` and
`"tensor_parallel": {"autotp_size": 2, "partition_config": {"layer_specs": [...]}}`.
"""

import pytest

from meshspeed.testing import run_distributed
from tests.parallel.pipeline.layer_spec_run import (
    WIDTH,
    Script,
    assert_equal_runs,
    engine_run,
    reference_run,
    split_shapes,
)

FORMS = ("generator", "list", "filter", "groups")


def runs(scripts):
    return [engine_run(s) for s in scripts]


def _check(world, scripts):
    per_rank = run_distributed(runs, world, args=(scripts,), timeout=300)
    for i, script in enumerate(scripts):
        results = [rank[i] for rank in per_rank]
        shapes = split_shapes(results)
        assert len(shapes) == 2 * script.blocks * world // 2, shapes  # every block on one stage of each pp pair
        for (rank, name), shape in shapes.items():
            want = (WIDTH // 2, WIDTH) if name.endswith(".up.weight") else (WIDTH, WIDTH // 2)
            assert shape == want, f"rank {rank} {name}: {shape}, split over tp 2 it is {want}"
        dp = world // (script.pp * script.tp)
        assert_equal_runs(results[0], reference_run(script, dp), f"{script.form} at world {world}")


@pytest.mark.parametrize("world,stage", [(4, 0), (8, 1)], ids=["pp2 x tp2", "pp2 x tp2 x dp2 (ZeRO-1)"])
def test_every_form_maps_onto_the_split_parameters(world, stage):
    _check(world, [Script(form=form, tp=2, stage=stage, steps=2) for form in FORMS])


def test_layer_specs_without_a_preset_split_the_listed_layers():
    """DeepSpeed's default `use_default_specs: true` merges a preset only when the model
    has one; a PipelineModule of the user's own layers has none, and the listed layers
    are the plan (it was refused: "no tensor-parallel plan for PipelineModule")."""
    _check(4, [Script(form="list", tp=2, steps=2, default_specs=None)])
