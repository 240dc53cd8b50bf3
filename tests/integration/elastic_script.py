"""An elastic training script: a fixed global batch at whatever size the rendezvous gives.

Run by test_elastic.py and test_elastic_hosts.py under `meshspeed run --nnodes 1:2` with
the c10d rendezvous, and uninterrupted through the test harness as the reference.
`train_batch_size` is fixed and the micro-batch is 1, so the accumulation steps follow the
world size (8 / dp). With `checkpoint.auto_resume`, every start resumes by itself from the
newest complete checkpoint, resharded to the size of that start.

argv: OUT_DIR CKPT_DIR EVENT [ZERO_STAGE, default 2]. EVENT says what the test does to the job after optimizer
step PAUSE (the checkpoint before it is at step 3, so steps 3 and 4 are read twice):
- "shrink": at the biggest size the ranks of the host that will die (ELASTIC_VICTIM=1 in
  their agent's environment) write `victim-<rank>` (their pid and their agent's) and wait
  to be killed; the others go on into the next step and find them gone.
- "grow": at the smallest size every rank writes `paused-<rank>` and waits; the test
  starts another agent, whose arrival makes the launcher stop these ranks and restart the
  job at the bigger size.
- "none": nothing happens (the reference run).
Rank 0 appends (and prints) "world W step S loss L" per optimizer step to log.txt (L: the
loss of the whole global batch, every rank's micro-batches averaged) and writes final.pt."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

import meshspeed
from meshspeed.data import RepeatingLoader
from meshspeed.models.gpt import GPT
from meshspeed.testing.engines import TINY

GLOBAL = 8  # train_batch_size: samples per optimizer step, at every size
SAMPLES = 40  # 5 steps per epoch, so the run crosses an epoch end after the resize
TOTAL, EVERY, PAUSE = 9, 3, 5  # optimizer steps, checkpoint interval, the event's step
WAIT_S = 150  # a paused rank gives up (and fails the job) if nothing happens by then


def _hold(out_dir: str, name: str, rank: int) -> None:
    """Post that this rank has paused, then wait (bounded) for the test's event."""
    with open(os.path.join(out_dir, f"{name}-{rank}.tmp"), "w") as f:
        f.write(f"{os.getpid()} {os.getppid()}\n")
    os.replace(os.path.join(out_dir, f"{name}-{rank}.tmp"), os.path.join(out_dir, f"{name}-{rank}"))
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        time.sleep(0.2)
    sys.exit(f"elastic_script: rank {rank} paused for {name!r} after step {PAUSE}, and in "
             f"{WAIT_S} s the test neither killed it nor made the job restart")


def train(out_dir: str, ckpt_dir: str, event: str, stage: int = 2) -> None:
    torch.set_num_threads(1)
    meshspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    data = torch.utils.data.TensorDataset(
        torch.randint(0, TINY.vocab_size, (SAMPLES, TINY.max_seq_len + 1),
                      generator=torch.Generator().manual_seed(5)))
    torch.manual_seed(0)
    model = GPT(TINY)  # no dropout: a rank's RNG state does not matter
    config = {"train_batch_size": GLOBAL, "train_micro_batch_size_per_gpu": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage}, "comms_timeout": 120,
              "checkpoint": {"auto_resume": True, "dir": ckpt_dir}}
    engine, _, loader, _ = meshspeed.initialize(model=model, model_parameters=model.parameters(),
                                                config=config, training_data=data)
    batches = iter(RepeatingLoader(loader))
    log = open(os.path.join(out_dir, "log.txt"), "a") if rank == 0 else None  # noqa: SIM115
    _say(log, f"start world {world} at step {engine.global_steps} accumulation "
              f"{engine.gradient_accumulation_steps()}")
    while engine.global_steps < TOTAL:
        step = engine.global_steps
        if step == PAUSE:
            _event(out_dir, event, rank, world)
        total = torch.zeros(())
        for _ in range(engine.gradient_accumulation_steps()):
            (tokens,) = next(batches)
            loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        dist.all_reduce(total)  # the global batch's mean loss: every micro-batch is 1 sample
        _say(log, f"world {world} step {step} loss {(total / GLOBAL).item()!r}")
        if engine.global_steps % EVERY == 0:
            engine.save_checkpoint(ckpt_dir)
    params = engine.state_dict()  # whole tensors (under ZeRO-3 a collective)
    if rank == 0:
        torch.save(params, os.path.join(out_dir, "final.pt"))
        log.close()


def _say(log, line: str) -> None:
    """Rank 0: a line in log.txt (the test reads it) and on stdout (the agent's output)."""
    if log is not None:
        log.write(line + "\n")
        log.flush()
        print(line, flush=True)


def _event(out_dir: str, event: str, rank: int, world: int) -> None:
    """The test's event after step PAUSE: a shrink happens once at the bigger size, a grow
    once at the smaller; after it the job runs at the other size, so it is not repeated."""
    several_hosts = world > int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if event == "shrink" and several_hosts and os.environ.get("ELASTIC_VICTIM") == "1":
        _hold(out_dir, "victim", rank)
    elif event == "grow" and not several_hosts:
        _hold(out_dir, "paused", rank)


if __name__ == "__main__":
    train(sys.argv[1], sys.argv[2], sys.argv[3], *(int(a) for a in sys.argv[4:5]))
