"""`checkpoint.auto_resume`: a restarted job continues from its newest complete checkpoint.

Note [what auto_resume loads]
Checkpoints are published atomically (Note [publishing a checkpoint], writer.py): a tag
directory appears only once complete, and `latest` is replaced after it, so the newest
complete checkpoint is the one `latest` names; a save killed halfway left only a `.tmp-`
folder, which nothing reads. When `latest` is missing or names a tag that is gone (deleted
by hand, or saves with save_latest=False), the complete tag with the most optimizer steps
is taken, and rank 0 says so. A directory that does not exist yet, or holds no complete
checkpoint, is a first run: nothing is loaded, and `load_checkpoint` returns
`(None, None)` as DeepSpeed's does when it finds no `latest`.
"""

from __future__ import annotations

import json
import logging
import os

from meshspeed import comm
from meshspeed.checkpoint.agree import everywhere, same_everywhere
from meshspeed.checkpoint.errors import CheckpointError
from meshspeed.checkpoint.paths import META, check_tag, is_checkpoint, list_tags, read_latest

log = logging.getLogger("meshspeed")


def _global_steps(save_dir: str, tag: str) -> int:
    try:
        with open(os.path.join(save_dir, tag, META), encoding="utf-8") as f:
            return int(json.load(f)["counters"]["global_steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1  # unreadable: the last choice (load will name what is wrong with it)


def newest_complete(save_dir: str | os.PathLike) -> tuple[str | None, str]:
    """(the tag to resume from or None, why): Note [what auto_resume loads]. No collectives."""
    save_dir = os.fspath(save_dir)
    if not os.path.isdir(save_dir):
        return None, f"{save_dir} does not exist yet"
    latest = read_latest(save_dir)
    if latest:
        try:
            if is_checkpoint(os.path.join(save_dir, check_tag(latest))):
                return latest, "latest"
        except CheckpointError:
            pass  # `latest` names something that is not a tag here: fall back to the tags
    tags = list_tags(save_dir)  # complete ones only, oldest first
    if not tags:
        return None, f"{save_dir} holds no complete checkpoint"
    best = max(enumerate(tags), key=lambda it: (_global_steps(save_dir, it[1]), it[0]))[1]
    said = f"'latest' names {latest!r}, which is not a complete checkpoint" if latest else "no 'latest'"
    return best, f"{said}; the complete checkpoint with the most steps"


def _complete_tags(save_dir: str) -> dict[str, int]:
    """Complete tags in `save_dir` -> their optimizer steps. No collectives."""
    if not os.path.isdir(save_dir):
        return {}
    return {t: _global_steps(save_dir, t) for t in list_tags(save_dir)}


# Note [auto_resume on node-local disks]
# With checkpoint.use_node_local_storage every host reads its own disk, and the disks may
# disagree: a save that failed while one host was renaming, a host that was replaced. Every
# rank then resumes from the newest checkpoint that is complete on every host; where the
# hosts have none in common, every rank raises, naming the ranks that lack the newest one.
def _agree_across_hosts(load_dir: str, tag: str | None, why: str) -> tuple[str | None, str]:
    views = comm.all_gather_object((tag, everywhere(_complete_tags, load_dir)))
    if len({t for t, _ in views}) == 1:
        return tag, why
    common = set.intersection(*(set(tags) for _, tags in views))
    if common:
        steps = views[0][1]
        best = max(common, key=lambda t: (steps[t], t))
        return best, (f"the hosts' disks disagree on the newest checkpoint "
                      f"({sorted({t for t, _ in views if t})}); the newest complete on every host")
    newest = max((t for t, _ in views if t), key=lambda t: next(s[t] for _, s in views if t in s))
    lacking = [r for r, (_, tags) in enumerate(views) if newest not in tags]
    raise CheckpointError(
        f"auto_resume: ranks {lacking} do not hold checkpoint {newest!r} in {load_dir} on their "
        "node-local disks and the hosts hold no complete checkpoint in common: gather it with "
        f"`meshspeed gather-checkpoint --hostfile HOSTFILE --tag {newest} {load_dir} --to DIR` "
        "and copy DIR to every host at this path")


def resume_tag(load_dir: str | os.PathLike, node_local: bool = False) -> str | None:
    """Collective: the tag every rank will resume from, or None on a first run. Ranks that
    see different directories raise on every rank (they would resume different states),
    unless `node_local` (Note [auto_resume on node-local disks])."""
    tag, why = everywhere(newest_complete, load_dir)
    if node_local:
        tag, why = _agree_across_hosts(os.fspath(load_dir), tag, why)
    same_everywhere("checkpoint to resume from", f"{os.path.abspath(load_dir)}: {tag}")
    if comm.get_rank() == 0:
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        attempt = f" (launcher restart {restart})" if restart not in (None, "0") else ""
        if tag is None:
            log.info("auto_resume: %s; starting from the beginning%s", why, attempt)
        elif why == "latest":
            log.info("auto_resume: resuming from %s%s", os.path.join(load_dir, tag), attempt)
        else:
            log.warning("auto_resume: %s; resuming from %s%s", why, os.path.join(load_dir, tag), attempt)
    return tag

