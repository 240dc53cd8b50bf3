"""Ranks that pass different checkpoint directories (issue 34, item 4): every rank uses rank
0's, one complete checkpoint is there, rank 0 says so once naming each rank's path, and a
load from different directories resumes the run bit-exactly (Note [ranks that name
different checkpoint directories], meshspeed/checkpoint/agree.py)."""

import datetime
import logging
import os
import random
import string

import torch

from meshspeed.testing import run_distributed
from meshspeed.testing.engines import small_engine, train_step


class _Said(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _tokens(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, 16, (1, 4), generator=torch.Generator().manual_seed(1000 * step + rank))


def _save_apart_then_resume(root, stage):
    from meshspeed import comm

    torch.set_num_threads(1)
    rank = comm.get_rank()
    said = _Said()
    logging.getLogger("meshspeed").addHandler(said)
    mine = os.path.join(root, f"rank{rank}")
    engine = small_engine(stage)
    for step in range(2):
        train_step(engine, _tokens(step, rank))
    engine.save_checkpoint(mine)
    engine.save_checkpoint(mine, tag="again")  # the same disagreement: not said twice
    reference = [train_step(engine, _tokens(step, rank)).item() for step in range(2, 5)]

    fresh = small_engine(stage, seed=7)  # other weights: the load must bring them back
    path, _ = fresh.load_checkpoint(os.path.join(root, f"load{rank}"), tag="global_step2")
    resumed = [train_step(fresh, _tokens(step, rank)).item() for step in range(2, 5)]
    logging.getLogger("meshspeed").removeHandler(said)
    return {"reference": reference, "resumed": resumed, "path": path, "steps": fresh.global_steps,
            "said": [line for line in said.lines if "ranks disagree on the checkpoint" in line]}


def _check_one_checkpoint_under_rank0(root):
    saved = root / "rank0" / "global_step2"
    assert sorted(p.name for p in saved.iterdir() if p.name.startswith("rank-")) == [
        "rank-00000.safetensors", "rank-00001.safetensors"]
    assert (saved / "meta.json").is_file() and (root / "rank0" / "again" / "meta.json").is_file()
    assert (root / "rank0" / "latest").read_text().strip() == "again"
    assert not (root / "rank1").exists()  # rank 1's directory is never created


def test_ranks_with_their_own_directories_save_one_checkpoint_and_resume_exactly(tmp_path):
    # rank 1 loads from a directory of its own too: the load takes rank 0's, load0 (a link)
    (tmp_path / "load0").symlink_to(tmp_path / "rank0")
    out = run_distributed(_save_apart_then_resume, world_size=2, args=(str(tmp_path), 2), timeout=60)
    _check_one_checkpoint_under_rank0(tmp_path)
    for rank, o in enumerate(out):
        assert o["resumed"] == o["reference"], f"rank {rank}"
        assert o["path"] == os.path.join(tmp_path, "load0", "global_step2")
        assert o["steps"] == 5
    said = out[0]["said"]
    assert len(said) == 2, said  # once for the save directory, once for the load directory
    assert said[0].startswith("ranks disagree on the checkpoint save directory (")
    assert said[1].startswith("ranks disagree on the checkpoint load directory (")
    assert f"every rank uses rank 0's, {tmp_path}/rank0," in said[0]
    assert f"rank 0: {tmp_path}/rank0; rank 1: {tmp_path}/rank1" in said[0]
    assert f"rank 0: {tmp_path}/load0; rank 1: {tmp_path}/load1" in said[1]
    assert out[1]["said"] == []  # rank 0 says it, once


def _hello_deepspeed(root, steps, save_every, resume_from):
    """HelloDeepSpeed's `train_bert_ds.py` in miniature: the experiment directory is named
    from the clock and a random suffix on every rank, before any seeding, and only rank 0
    creates it; the loop saves every `save_every` steps with the step in the client state."""
    from meshspeed import comm
    from meshspeed.compat.alias import install, uninstall

    torch.set_num_threads(1)
    install()  # the script's `import deepspeed`, as under meshspeed run --deepspeed-compat
    try:
        return _train_bert(root, steps, save_every, resume_from, comm)
    finally:
        uninstall()


def _train_bert(root, steps, save_every, resume_from, comm):
    import deepspeed  # meshspeed, through the alias the caller installed

    from meshspeed.models.gpt import GPT
    from meshspeed.testing.engines import TINY

    if resume_from is None:
        now = datetime.datetime.now()
        suffix = "".join(random.SystemRandom().choices(string.ascii_lowercase + string.digits, k=8))
        exp_dir = os.path.join(root, f"bert_pretrain.{now:%Y.%m.%d.%H.%M.%S}.{suffix}")
        if comm.get_rank() == 0:
            os.mkdir(exp_dir)
    else:  # the script's resume: the directory rank 0 printed, given on the command line
        exp_dir = resume_from
    torch.manual_seed(42)
    model = GPT(TINY)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
              "bf16": {"enabled": True},
              "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    start = 1
    if resume_from is not None:
        _, client_state = engine.load_checkpoint(load_dir=resume_from, tag=f"global_step{save_every}")
        start = client_state["checkpoint_step"] + 1
    losses = {}
    for step in range(start, steps + 1):
        losses[step] = train_step(engine, _tokens(step, comm.get_rank())).item()
        if step % save_every == 0:
            engine.save_checkpoint(save_dir=exp_dir, client_state={"checkpoint_step": step})
    return exp_dir, losses


def test_hello_deepspeed_saves_and_resumes_unchanged(tmp_path):
    first = run_distributed(_hello_deepspeed, world_size=2, args=(str(tmp_path), 6, 3, None), timeout=60)
    (dir0, _), (dir1, _) = first
    assert dir0 != dir1  # the ranks named different directories
    assert os.path.isfile(os.path.join(dir0, "global_step3", "meta.json"))
    assert not os.path.exists(dir1)
    again = run_distributed(_hello_deepspeed, world_size=2, args=(str(tmp_path), 6, 3, dir0), timeout=60)
    for rank in range(2):
        resumed = again[rank][1]
        assert sorted(resumed) == [4, 5, 6]
        assert resumed == {s: first[rank][1][s] for s in (4, 5, 6)}, f"rank {rank}"
