"""An engine built without an optimizer (Note [an engine without an optimizer]): forward
and evaluation equal the model's own at stages 0 and 3 on 2 ranks, `initialize` returns
None in the optimizer's place (DeepSpeed's tuple), and a training step is refused on every
rank with what to pass instead."""

import pytest
import torch

import meshspeed
from meshspeed.compat.api import MissingModelError
from meshspeed.compat.api import initialize as ds_initialize
from meshspeed.models.gpt import GPT, GPTConfig
from meshspeed.optim.no_optimizer import NoOptimizerError
from meshspeed.testing import run_distributed
from tests.compat.models import one_thread

CFG = GPTConfig(vocab_size=64, max_seq_len=16, n_layer=2, n_head=2, d_model=32)


@one_thread()
def _eval_then_step(stage):
    torch.manual_seed(0)
    reference = GPT(CFG)
    torch.manual_seed(0)
    model = GPT(CFG)
    engine, optimizer, _, _ = ds_initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10_000,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}})
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(meshspeed.comm.get_rank()))
    with torch.no_grad():
        got = engine(tokens[:, :-1], tokens[:, 1:]).item()
        want = reference(tokens[:, :-1], tokens[:, 1:]).item()
    engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
    try:
        engine.step()
        refused = None
    except NoOptimizerError as err:
        refused = str(err)
    return {"optimizer": optimizer, "got": got, "want": want, "refused": refused}


@pytest.mark.parametrize("stage", [0, 3])
def test_forward_works_and_a_step_is_refused_on_every_rank(stage):
    for rank in run_distributed(_eval_then_step, 2, args=(stage,)):
        assert rank["optimizer"] is None
        assert rank["got"] == pytest.approx(rank["want"], rel=1e-6)
        assert rank["refused"] is not None and "initialize(optimizer=...)" in rank["refused"]


def test_no_model_is_the_error_deepspeed_callers_catch():
    with pytest.raises(AssertionError, match="needs model="):
        ds_initialize(model=None, config={})
    assert issubclass(MissingModelError, ValueError)
