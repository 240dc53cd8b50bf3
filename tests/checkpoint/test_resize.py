"""Note [accumulation across a resize]: the micro-step count after loading at another
accumulation puts the next boundary after a whole step."""

from meshspeed.checkpoint.resize import micro_steps_at


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
