"""The DeepSpeedExamples pipeline example's config (optimizer "type": "Adam" with lr, betas
and eps only, no weight_decay, no gradient_clipping) on 2 ranks with accumulation trains
exactly as one process of plain torch.optim.Adam on the whole global batch, unclipped
(benchmarks/pipeline_example_drift.py runs the example itself).

Two defaults are pinned here. No weight_decay means 0, as in DeepSpeed (before the fix
meshspeed built torch's AdamW with torch's default 0.01; Note [no weight_decay means 0] in
meshspeed/optim/builder.py). No gradient_clipping means no clipping: DeepSpeed up to 0.19.2
did the same, DeepSpeed 0.19.3 and later clip at 1.0 when the key is missing (its PR #8068);
a config that wants DeepSpeed 0.19.8's behaviour says "gradient_clipping": 1.0, the third case.
The gradients' global norm is about 7 here, so clipping at 1.0 would change every step.
"""

import pytest
import torch
from torch import nn

import meshspeed
from meshspeed.testing import run_distributed

WORLD, MICRO, GAS, STEPS = 2, 4, 2, 4
ADAM = {"type": "Adam", "params": {"lr": 0.05, "betas": [0.9, 0.999], "eps": 1e-8}}
CASES = [  # (ZeRO stage, gradient_clipping in the config: None = no key)
    (0, None), (2, None), (0, 1.0)]


def _model():
    torch.manual_seed(1138)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS, GAS, WORLD * MICRO, 8, generator=g)
    return x, 10 * x.sum(-1, keepdim=True).sin()  # global gradient norm ~7 at the first step


def _engine_runs(cases):
    from meshspeed import comm

    x, y = _data()
    rows = slice(comm.get_rank() * MICRO, (comm.get_rank() + 1) * MICRO)
    out = []
    for stage, clipping in cases:
        model = _model()
        config = {"train_batch_size": WORLD * MICRO * GAS, "train_micro_batch_size_per_gpu": MICRO,
                  "optimizer": ADAM, "zero_optimization": {"stage": stage}, "steps_per_print": 1000}
        if clipping is not None:
            config["gradient_clipping"] = clipping
        engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        for step in range(STEPS):
            for m in range(GAS):
                loss = nn.functional.mse_loss(engine(x[step, m, rows]), y[step, m, rows])
                engine.backward(loss)
                engine.step()
        out.append({k: v.clone() for k, v in engine.state_dict().items()})
    return out


def _reference(clipping):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.05, betas=(0.9, 0.999), eps=1e-8)
    x, y = _data()
    for step in range(STEPS):
        loss = nn.functional.mse_loss(model(x[step].flatten(0, 1)), y[step].flatten(0, 1))
        loss.backward()
        if clipping:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clipping)
        opt.step()
        opt.zero_grad()
    return model.state_dict()


@pytest.fixture(scope="module")
def engine_states():
    return run_distributed(_engine_runs, world_size=WORLD, args=(CASES,), timeout=300)[0]


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"stage{s}-clip{c}" for s, c in CASES])
def test_example_config_matches_one_process_torch_adam(engine_states, case):
    stage, clipping = CASES[case]
    ref = _reference(clipping)
    for name, value in ref.items():
        torch.testing.assert_close(engine_states[case][name], value, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"stage {stage}, clipping {clipping}, {n}: {m}")


def test_clipping_matters_here(engine_states):
    """The unclipped and the clipped runs part: the first two cases do pin "no clipping"."""
    unclipped, clipped = engine_states[0], engine_states[2]
    assert max((unclipped[k] - clipped[k]).abs().max().item() for k in unclipped) > 1e-2
