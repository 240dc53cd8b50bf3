"""initialize again on a model an earlier engine holds (Note [a second engine on one model]
in meshspeed/engine/build.py): at every stage the new engine starts from the parameters the
first trained, continues exactly as the first would have, and the first refuses to train."""

import pytest
import torch

from meshspeed.testing import run_distributed


def _two_engines(tmp, stage):
    import meshspeed
    from meshspeed.models.gpt import GPT
    from meshspeed.testing.engines import TINY, train_step

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(TINY)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    tokens = torch.tensor([[1, 2, 3, 4]])
    first, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    train_step(first, tokens)
    first.empty_partition_cache()
    first.save_checkpoint(tmp, tag="a")
    reference = train_step(first, tokens).item()  # what a continued first engine computes

    second, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    second.load_checkpoint(tmp, tag="a")
    resumed = train_step(second, tokens).item()
    second.save_checkpoint(tmp, tag="b")
    try:
        train_step(first, tokens)
        refused = None
    except RuntimeError as err:
        refused = str(err)
    return reference, resumed, refused


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_second_engine_on_the_same_model_resumes_and_the_first_refuses(tmp_path, stage):
    for reference, resumed, refused in run_distributed(_two_engines, world_size=2,
                                                       args=(str(tmp_path), stage), timeout=120):
        assert resumed == pytest.approx(reference, rel=1e-6)
        assert refused is not None and "passed to a later initialize" in refused
