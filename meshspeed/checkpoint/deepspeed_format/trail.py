"""`"checkpoint": {"format": "deepspeed"}`: every meshspeed save also writes DeepSpeed's files.

Note [a DeepSpeed trail in a meshspeed save]
Rank 0 writes all of DeepSpeed's files, for the run's own dp size and ZeRO stage, into
the save's temporary directory once every rank's meshspeed file is durable and meta.json
is written, just before the directory is renamed into place (writer.py `publish`). So the
tag appears with both formats complete, and `latest` is still replaced last: a crash
leaves no tag that DeepSpeed or meshspeed would half-read. Rank 0 writes them all rather
than each rank its own zero_pp_rank_<r> file because only rank 0 knows when the meshspeed
tag is complete, and asynchronous saves publish from a background thread that must not
call collectives; the cost is that rank 0 reads the checkpoint back (just written, mostly
from the page cache), holding one DeepSpeed file's tensors at a time. meshspeed's loader
ignores the .pt files (it never unpickles anything).

Note [the trail is asked for, not assumed]
A Hugging Face Trainer running on meshspeed (through the alias) saves `checkpoint-<N>/`
with `save_checkpoint`, so the same switch gives its folders DeepSpeed's files, and the
user asks for it in the ds_config JSON the Trainer is given (`"checkpoint": {"format":
"deepspeed"}`; DeepSpeed 0.19 ignores the key, so the one config serves both sides). It is
not turned on by detecting the Trainer: the trail doubles every checkpoint's size and
makes rank 0 read the whole checkpoint back at each save, a cost a run that stays on
meshspeed should not pay unasked, and a folder saved without it can still be converted
afterwards (`meshspeed convert --to deepspeed`).
"""

from __future__ import annotations

from meshspeed.checkpoint.deepspeed_format.write import target_for, write_files
from meshspeed.checkpoint.reshard import SavedTensors


def write_trail(tmp: str, meta: dict) -> list[str]:
    """DeepSpeed's .pt files of the checkpoint being published from `tmp` (rank 0)."""
    return write_files(SavedTensors(tmp, meta), tmp, target_for(meta, None, None))
