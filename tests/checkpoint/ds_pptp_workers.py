"""The model, micro-batches and config of benchmarks/ds_checkpoint_pptp.py (which made the
pipe_* and universal_* fixtures under fixtures/deepspeed/), for loading those fixtures into
meshspeed without DeepSpeed. Keep in step with that script."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import meshspeed
from meshspeed import comm
from meshspeed.pipe import LayerSpec, PipelineModule

MICRO, GAS, SAVE_AT, MORE = 2, 2, 2, 3


def layer_list() -> list:
    return [LayerSpec(nn.Linear, 6, 10), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 10, 8), LayerSpec(nn.Tanh),
            LayerSpec(nn.Linear, 8, 3)]


def sequential() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 8), nn.Tanh(), nn.Linear(8, 3))


def micro_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    n = (SAVE_AT + MORE) * GAS
    return [(torch.randn(MICRO, 6, generator=g), torch.randn(MICRO, 3, generator=g)) for _ in range(n)]


def config(stage: int, dp: int, clip: float, universal: bool = False) -> dict:
    cfg = {"train_batch_size": MICRO * GAS, "train_micro_batch_size_per_gpu": MICRO,
           "gradient_accumulation_steps": GAS // dp,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "betas": [0.9, 0.99], "eps": 1e-6}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                        "warmup_num_steps": 10}},
           "zero_optimization": {"stage": stage}, "gradient_clipping": clip, "steps_per_print": 10_000}
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def load_and_train(ckpt: str, target: str, stage: int, clip: float, universal: bool = False) -> dict:
    """On every rank: a fresh engine (other initial weights) loads `ckpt` into a meshspeed
    PipelineModule over all ranks (`target` "pipe") or a plain nn.Sequential at dp = world
    ("plain") and trains the 3 batches after it; the batch losses and what came back."""
    torch.set_num_threads(1)
    world, rank = comm.get_world_size(), comm.get_rank()
    torch.manual_seed(7)
    data = micro_batches()
    if target == "pipe":
        net = PipelineModule(layers=layer_list(), num_stages=world, loss_fn=nn.MSELoss(), partition_method="uniform")
        engine, *_ = meshspeed.initialize(model=net, model_parameters=[p for p in net.parameters()],
                                          config=config(stage, 1, clip, universal))
    else:
        model = sequential()
        engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=config(stage, world, clip, universal))
    path, client = engine.load_checkpoint(ckpt)
    restored = {"global_steps": engine.global_steps, "client": dict(client),
                "sched": engine.lr_scheduler.state_dict()["last_batch_iteration"]}
    losses = []
    for b in range(SAVE_AT, SAVE_AT + MORE):
        if target == "pipe":
            losses.append(float(engine.train_batch(iter(data[b * GAS:(b + 1) * GAS]))))
            continue
        total = torch.zeros(1)
        for i in range(GAS // world):
            x, y = data[b * GAS + i * world + rank]
            loss = F.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        comm.all_reduce(total)
        losses.append(total.item() / GAS)
    return {"losses": losses, **restored}


def tiny_llama() -> nn.Module:
    """benchmarks/ds_checkpoint_pptp.py's 1-layer Llama, which DeepSpeed's AutoTP split."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2))


def load_and_train_tp(ckpt: str) -> dict:
    """On every rank: a fresh tiny Llama at tp = world (AutoTP config) loads `ckpt` and
    trains the 3 steps after it on the same token batches."""
    torch.set_num_threads(1)
    tp = comm.get_world_size()
    torch.manual_seed(7)
    model = tiny_llama()
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "betas": [0.9, 0.99], "eps": 1e-6}},
           "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0, "steps_per_print": 10_000,
           **({"tensor_parallel": {"autotp_size": tp}} if tp > 1 else {})}
    engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    _, client = engine.load_checkpoint(ckpt)
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 32, (2, 8), generator=g) for _ in range(SAVE_AT + MORE)]
    losses = []
    for b in range(SAVE_AT, SAVE_AT + MORE):
        loss = engine(input_ids=ids[b], labels=ids[b]).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return {"losses": losses, "global_steps": engine.global_steps, "client": dict(client)}
