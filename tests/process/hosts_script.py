"""A 4-rank training script with `checkpoint.auto_resume` and a short `comms_timeout`,
started on 2 namespaced hosts by test_hosts.py (and, uninterrupted, through the test
harness). Each step sleeps a little so a test can kill or cut a host mid-run.

Rank 0 appends "attempt A step S loss L" per optimizer step to log-rank0.txt, and writes
the final parameters to final.pt."""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

TOTAL, EVERY = 12, 3  # optimizer steps, checkpoint interval
SAMPLES = 32
PAUSE_S = 0.4  # per step, so that a host can be killed mid-run
PAUSE_ALONE_S = 4.0  # per step while 2 ranks start alone: the other host joins meanwhile
COMMS_TIMEOUT_S = 20


def train(out_dir: str, pause: float = PAUSE_S, kill_at: int = -1) -> None:
    """`kill_at` >= 0: rank 3 kills itself (SIGKILL) mid-step `kill_at`, once."""
    import meshspeed
    from meshspeed.data import RepeatingLoader
    from meshspeed.models.gpt import GPT
    from meshspeed.testing.engines import TINY

    meshspeed.init_distributed()
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    attempt = os.environ.get("MESHSPEED_RDZV_ROUND", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    data = torch.utils.data.TensorDataset(
        torch.randint(0, TINY.vocab_size, (SAMPLES, TINY.max_seq_len + 1),
                      generator=torch.Generator().manual_seed(5)))
    torch.manual_seed(0)
    model = GPT(TINY)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 1}, "comms_timeout": COMMS_TIMEOUT_S,
              "checkpoint": {"auto_resume": True, "dir": os.path.join(out_dir, "ckpt")}}
    engine, _, loader, _ = meshspeed.initialize(model=model, model_parameters=model.parameters(),
                                                config=config, training_data=data)
    batches = iter(RepeatingLoader(loader))
    log = open(os.path.join(out_dir, f"log-rank{rank}.txt"), "a")  # noqa: SIM115 - one per process
    while engine.global_steps < TOTAL:
        step = engine.global_steps
        for micro in range(engine.gradient_accumulation_steps()):
            (tokens,) = next(batches)
            loss = engine(tokens[:, :-1], tokens[:, 1:])
            marker = os.path.join(out_dir, "killed")
            if rank == 3 and step == kill_at and micro == 1 and not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)  # mid-step: the others wait in a collective
            engine.backward(loss)
            engine.step()
        log.write(f"attempt {attempt} step {step} loss {loss.item()!r}\n")
        log.flush()
        if engine.global_steps % EVERY == 0:
            engine.save_checkpoint(os.path.join(out_dir, "ckpt"))
        alone = torch.distributed.get_world_size() == 2 and attempt == "0"
        time.sleep(PAUSE_ALONE_S if alone and pause else pause)
    if rank == 0:
        torch.save({k: v.clone() for k, v in engine.module.state_dict().items()},
                   os.path.join(out_dir, "final.pt"))
    log.close()


if __name__ == "__main__":
    train(sys.argv[1], PAUSE_S, int(sys.argv[2]) if len(sys.argv) > 2 else -1)
