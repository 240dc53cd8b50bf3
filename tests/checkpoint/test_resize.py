"""A checkpoint loaded at another data-parallel size: the micro-step count puts the next
accumulation boundary after a whole step (Note [accumulation across a resize]), and the
run continues as the uninterrupted one (with the loader's global position, Note [the data
order across a resize] in meshspeed/data/loader.py)."""

import torch
import torch.distributed as dist

import meshspeed
from meshspeed.checkpoint.resize import micro_steps_at
from meshspeed.data import RepeatingLoader
from meshspeed.models.gpt import GPT
from meshspeed.testing.engines import TINY
from meshspeed.testing.harness import run_distributed


def _boundaries(micro_steps: int, accumulation: int, n: int) -> list[int]:
    """Which of the next n micro-batches end an optimizer step (the engine's rule)."""
    return [k for k in range(n) if (micro_steps + k + 1) % accumulation == 0]


def test_the_same_accumulation_keeps_the_count():
    assert micro_steps_at(6, {"gradient_accumulation_steps": 2}, 2) == 6
    assert micro_steps_at(7, {}, 4) == 7  # a checkpoint that does not say


def test_another_accumulation_starts_a_whole_step():
    # 3 steps at accumulation 2 (dp 4), resumed at accumulation 4 (dp 2): without the move
    # the first step would end after 2 micro-batches
    assert _boundaries(6, 4, 8) == [1, 5]
    moved = micro_steps_at(6, {"gradient_accumulation_steps": 2}, 4)
    assert moved == 8 and _boundaries(moved, 4, 8) == [3, 7]
    # growing: 3 steps at accumulation 4 resumed at 2 are already on a boundary
    assert micro_steps_at(12, {"gradient_accumulation_steps": 4}, 2) == 12
    assert micro_steps_at(9, {"gradient_accumulation_steps": 3}, 2) == 10


def _train(ckpt_dir: str, until: int) -> tuple[dict[int, float], dict]:
    """Train (auto_resume from ckpt_dir) at train_batch_size 8, micro-batch 1, ZeRO-2, up
    to optimizer step `until`, then save: ({step: the global batch's mean loss}, params)."""
    data = torch.utils.data.TensorDataset(
        torch.randint(0, TINY.vocab_size, (24, TINY.max_seq_len + 1),
                      generator=torch.Generator().manual_seed(5)))
    torch.manual_seed(0)
    model = GPT(TINY)
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 2}, "checkpoint": {"auto_resume": True, "dir": ckpt_dir}}
    engine, _, loader, _ = meshspeed.initialize(model=model, model_parameters=model.parameters(),
                                                config=config, training_data=data)
    batches, losses = iter(RepeatingLoader(loader)), {}
    while engine.global_steps < until:
        step, total = engine.global_steps, torch.zeros(())
        for _ in range(engine.gradient_accumulation_steps()):
            (tokens,) = next(batches)
            loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        dist.all_reduce(total)
        losses[step] = (total / 8).item()
    engine.save_checkpoint(ckpt_dir)
    return losses, engine.state_dict()


def test_a_checkpoint_resumes_at_another_size_as_the_uninterrupted_run(tmp_path):
    """Saved at 2 ranks (accumulation 4) after 2 steps, resumed at 1 rank (accumulation 8):
    the same samples per step, whole steps, and the uninterrupted 2-rank run's losses and
    parameters to 1e-5 (Note [elastic parity is to 1e-5, not bitwise] in
    tests/integration/test_elastic.py). 24 samples: 3 steps per epoch, so it crosses one."""
    run_distributed(_train, 2, args=(str(tmp_path / "resized"), 2))
    resumed, params = run_distributed(_train, 1, args=(str(tmp_path / "resized"), 5))[0]
    reference, want = run_distributed(_train, 2, args=(str(tmp_path / "reference"), 5))[0]
    assert sorted(resumed) == [2, 3, 4]
    for step, loss in resumed.items():
        assert abs(loss - reference[step]) <= 1e-5 * reference[step], (step, loss, reference[step])
    for name, value in want.items():
        assert (params[name] - value).abs().max().item() <= 1e-5, name
