"""Issue 34, item 2: the interleaved schedule from the config alone. A DeepSpeed-style
`PipelineModule(layers=[LayerSpec...], num_stages=2)` with `"pipeline": {"schedule":
"interleaved", "virtual_stages": 2}` is cut again into stages x chunks at initialize
(Note [the mesh binds the stage]) and trains as one process does (fp32, rtol 1e-5), as
does the module argument `virtual_stages=2`. A rebind moves layers to stages whose ranks
never listed them: the parameters the user listed on their first stage keep their group
(weight-decay groups) and their selection (a fine-tune of some layers) there (Note
[model_parameters by name]). The script is tests/parallel/pipeline/layer_spec_run.py.
"""

import pytest

from meshspeed.testing import DistributedTestError, run_distributed
from tests.parallel.pipeline.layer_spec_run import (
    Script,
    assert_equal_runs,
    engine_run,
    reference_run,
)

INTERLEAVED = {"schedule": "interleaved", "virtual_stages": 2}


def runs(scripts):
    return [engine_run(s) for s in scripts]


def _check(world, scripts):
    got = run_distributed(runs, world, args=(scripts,), timeout=300)[0]
    for script, result in zip(scripts, got):
        dp = world // (script.pp * script.tp)
        assert_equal_runs(result, reference_run(script, dp), f"{script}")


def test_interleaved_from_the_config_equals_one_process():
    """pp 2: the forms of model_parameters, a frozen layer, and the module argument
    instead of the key. Six layers: the constructor puts 0-2 on stage 0 and 3-5 on stage 1;
    with two chunks stage 0 holds 0 and 2-3, stage 1 holds 1 and 4-5, so layers 1 and 3
    change stage (layer 1 is the frozen one)."""
    _check(2, [Script(form="list", pipeline=INTERLEAVED),
               Script(form="groups", pipeline=INTERLEAVED),
               Script(form="down", pipeline=INTERLEAVED, clip=0.0),
               Script(form="list", pipeline=INTERLEAVED, frozen=(1,)),
               Script(form="generator", pipeline={"schedule": "interleaved"}, virtual_stages=2)])


def test_interleaved_from_the_config_with_tensor_and_data_parallel():
    """pp 2 x tp 2, and pp 2 x dp 2 under ZeRO-1, weight-decay groups."""
    _check(4, [Script(form="groups", tp=2, pipeline=INTERLEAVED, steps=2),
               Script(form="filter", stage=1, pipeline=INTERLEAVED, steps=2)])


def _too_few_layers():
    engine_run(Script(blocks=1, pipeline={"schedule": "interleaved", "virtual_stages": 3}))


def test_too_few_layers_for_the_chunks_names_the_config_key():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_too_few_layers, 2, timeout=120)
    text = str(info.value)
    assert "pipeline.virtual_stages" in text and "3 layers" in text, text
