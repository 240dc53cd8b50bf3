"""A 2-rank training script with `checkpoint.auto_resume`, run by test_auto_resume.py under
`meshspeed run --max-restarts 1` (rank 1 kills itself once, mid-step) and, uninterrupted,
through the test harness. It never mentions resuming: initialize does it.

Each rank appends "attempt A step S loss L" per optimizer step to log-rank<R>.txt, so
the test sees which steps each attempt ran; rank 0 writes the final parameters."""

from __future__ import annotations

import os
import signal
import sys

import torch

TOTAL, EVERY = 10, 3  # optimizer steps, checkpoint interval
SAMPLES = 24  # 12 per rank, micro-batch 1, accumulation 2: 6 steps per epoch, so the run wraps


def train(out_dir: str, kill_at: int) -> None:
    run(out_dir, kill_at, total=TOTAL, every=EVERY, samples=SAMPLES, killer=1, comms_timeout=300)


def run(out_dir: str, kill_at: int, *, total: int, every: int, samples: int, killer: int,
        comms_timeout: float, after_step=None) -> None:
    """The training loop of this script and of hosts_script.py: rank `killer` kills itself
    (SIGKILL) mid-step `kill_at` once; `after_step(engine, attempt)` runs after each step."""
    import meshspeed
    from meshspeed.data import RepeatingLoader
    from meshspeed.models.gpt import GPT
    from meshspeed.testing.engines import TINY

    meshspeed.init_distributed()
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    # the agents' number under meshspeed run's c10d rendezvous, else torchrun's counter
    attempt = os.environ.get("MESHSPEED_RDZV_ROUND", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    data = torch.utils.data.TensorDataset(
        torch.randint(0, TINY.vocab_size, (samples, TINY.max_seq_len + 1),
                      generator=torch.Generator().manual_seed(5)))
    torch.manual_seed(0)
    model = GPT(TINY)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 1}, "comms_timeout": comms_timeout,
              "checkpoint": {"auto_resume": True, "dir": os.path.join(out_dir, "ckpt")}}
    engine, _, loader, _ = meshspeed.initialize(model=model, model_parameters=model.parameters(),
                                                config=config, training_data=data)
    batches = iter(RepeatingLoader(loader))
    log = open(os.path.join(out_dir, f"log-rank{rank}.txt"), "a")  # noqa: SIM115 - one per process
    while engine.global_steps < total:
        step = engine.global_steps
        for micro in range(engine.gradient_accumulation_steps()):
            (tokens,) = next(batches)
            loss = engine(tokens[:, :-1], tokens[:, 1:])
            marker = os.path.join(out_dir, "killed")
            if rank == killer and step == kill_at and micro == 1 and not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)  # mid-step: the others wait in a collective
            engine.backward(loss)
            engine.step()
        log.write(f"attempt {attempt} step {step} loss {loss.item()!r}\n")
        log.flush()
        if engine.global_steps % every == 0:
            engine.save_checkpoint(os.path.join(out_dir, "ckpt"))
        if after_step is not None:
            after_step(engine, attempt)
    if rank == 0:
        torch.save({k: v.clone() for k, v in engine.module.state_dict().items()},
                   os.path.join(out_dir, "final.pt"))
    log.close()


if __name__ == "__main__":
    train(sys.argv[1], int(sys.argv[2]))
