"""`initialize(model_parameters=...)` in every form users write it (a generator, a filtered
list, `filter(...)`, weight-decay param-group dicts; meshspeed/testing/param_forms.py) trains
exactly like the one-process reference with the same groups, at every composition that
replaces the model's parameters: tensor parallelism (split layers get new Parameters), a
pipeline stage at pp 2 x tp 2 and pp 2 x tp 2 x dp 2 (the stage is rebuilt at initialize),
zero.Init (placeholders rebuilt into units) and expert parallelism (tests/moe). The
weight-decay groups are told apart from one group: their biases and norm weights do not
decay, so dropping the groups' options changes the result."""

import pytest

from meshspeed.testing.param_forms import FORMS
from meshspeed.testing.parity import ParitySetup, check_parity

FORMS_GIVEN = [f for f in FORMS if f != "parameters"]  # the plain call is every other parity test's

COMPOSITIONS = {
    "tp2": dict(world=2, tp=2),
    "pp2 x tp2": dict(world=4, pp=2, tp=2),
    "pp2 x tp2 x dp2": dict(world=8, pp=2, tp=2, stage=1),
    "zero.Init, stage 3, dp2": dict(world=2, stage=3, zero_init=True),
}


@pytest.mark.parametrize("composition", list(COMPOSITIONS))
def test_every_form_of_model_parameters_trains_like_one_process(composition):
    check_parity([ParitySetup(steps=3, params_form=form, **COMPOSITIONS[composition]) for form in FORMS_GIVEN])


def test_weight_decay_groups_are_not_one_group():
    """The reference's two groups differ from one group with the same decay, so the test
    above would see groups collapsed into one (or their options dropped)."""
    from meshspeed.testing.parity import reference_run

    grouped = reference_run(ParitySetup(steps=3, params_form="groups"))
    single = reference_run(ParitySetup(steps=3, params_form="list"))
    assert any((grouped[1][k] - single[1][k]).abs().max() > 1e-6 for k in grouped[1])
