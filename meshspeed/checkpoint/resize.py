"""What a checkpoint's step counters mean when it is loaded at another size.

Note [accumulation across a resize]
With `train_batch_size` fixed, an elastic job that resumes at another data-parallel size
runs another number of accumulation steps per optimizer step (micro * accumulation * dp =
train_batch_size; meshspeed/config/batch.py derives it). The engine finds the
accumulation boundary from its count of micro-steps ((micro_steps + 1) % accumulation ==
0), so the saved count, a multiple of the OLD accumulation, would put the first boundary
after the resume part-way through a step: 3 steps at accumulation 2 are 6 micro-steps,
and at accumulation 4 the next boundary would come after 2 micro-batches, not 4. Loading
therefore moves the count up to the next multiple of the new accumulation: the first
step after the resume accumulates a whole train_batch_size, as every later one does. The
count stays a count that never goes back (it is no longer exactly the backward passes
run, by fewer than one step's worth). A checkpoint saved between boundaries loses its
partial accumulation at any size (gradients are not saved).
"""

from __future__ import annotations

from typing import Any


def micro_steps_at(saved: int, data: dict[str, Any], accumulation: int) -> int:
    """The engine's micro-step count after loading a checkpoint that saved `saved`, with
    its "data" block `data`, into a run of `accumulation` steps per optimizer step."""
    before = data.get("gradient_accumulation_steps")
    if before is None or before == accumulation or accumulation < 1:
        return saved
    return saved + (-saved) % accumulation
