"""The tiny model, batches and config of benchmarks/ds_checkpoint_import.py (which made the
DeepSpeed fixtures under fixtures/deepspeed/), for loading those fixtures into meshspeed
without DeepSpeed. Keep in step with that script."""

from __future__ import annotations

import torch
from torch import nn

import meshspeed
from meshspeed import comm

GLOBAL_ROWS, SAVE_AT, MORE = 4, 2, 3


class TinyMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 10)
        self.fc2 = nn.Linear(10, 3)
        self.register_buffer("shift", torch.linspace(-0.5, 0.5, 3))

    def forward(self, x, y):
        h = torch.tanh(self.fc1(x.to(self.fc1.weight.dtype)))
        out = self.fc2(h).float() + self.shift.float()
        return torch.nn.functional.mse_loss(out, y.float())


def config(stage: int, dp: int, precision: str) -> dict:
    cfg = {
        "train_batch_size": GLOBAL_ROWS, "train_micro_batch_size_per_gpu": GLOBAL_ROWS // dp,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "betas": [0.9, 0.99], "eps": 1e-6}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                     "warmup_num_steps": 10}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "gradient_clipping": 1.0, "steps_per_print": 10_000,
    }
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    if precision == "fp16":  # as benchmarks/ds_checkpoint_import.py's DeepSpeed run
        cfg["fp16"].update({"initial_scale_power": 17, "loss_scale_window": 2, "hysteresis": 2})
    return cfg


def batches() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    steps = SAVE_AT + MORE
    return torch.randn(steps, GLOBAL_ROWS, 6, generator=g), torch.randn(steps, GLOBAL_ROWS, 3, generator=g)


def load_and_train(ckpt: str, stage: int, precision: str, save_to: str | None = None) -> dict:
    """On every rank: a fresh engine (other initial weights) loads the DeepSpeed checkpoint
    and trains the 3 steps after it; the global mean losses and what was restored."""
    torch.set_num_threads(1)
    dp = comm.get_world_size()
    torch.manual_seed(7)
    model = TinyMLP()
    engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config(stage, dp, precision))
    path, client = engine.load_checkpoint(ckpt)
    restored = {"path": path, "global_steps": engine.global_steps, "global_samples": engine.global_samples,
                "lr": engine.optimizer.param_groups[0]["lr"], "client": {k: (v.tolist() if torch.is_tensor(v) else v)
                                                                      for k, v in client.items()},
                "sched": engine.lr_scheduler.state_dict()["last_batch_iteration"],
                "scaler": engine.loss_scaler.state_dict()}
    if save_to is not None:  # the loaded state, saved by meshspeed (to export it again)
        engine.save_checkpoint(save_to)
    xs, ys = batches()
    micro = GLOBAL_ROWS // dp
    rows = slice(comm.get_rank() * micro, (comm.get_rank() + 1) * micro)
    losses, scales = [], []
    for step in range(SAVE_AT, SAVE_AT + MORE):
        loss = engine(xs[step][rows], ys[step][rows])
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().reshape(1).clone()
        comm.all_reduce(total)
        losses.append(total.item() / dp)
        scales.append(engine.loss_scaler.scale)
    return {"losses": losses, "scales": scales, **restored}
