"""The frameworks `zero.py` compares, behind one small trainer protocol.

A trainer has `forward(x, y) -> loss`, `backward(loss)`, `optimizer_step()` and
`state_bytes()`
(see Note [what counts as model state] in zero.py). All of them train the same GPT from
the same seed on the same data, in fp32 with AdamW (lr 3e-4, weight decay 0.01, torch's
fused kernel: meshspeed picks it by default, torch only on request, and the comparison is
about sharding, not optimizer kernels).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

MESHSPEED = [f"meshspeed-{s}" for s in range(4)]
DEEPSPEED = [f"deepspeed-{s}" for s in (1, 2, 3)]
DEFAULT = ["ddp", *MESHSPEED, "fsdp2", *DEEPSPEED]
# Not run by default: stage 3 with stage3_param_persistence_threshold 1e5 (DeepSpeed's
# default), which keeps every parameter of at most 1e5 elements whole on every rank; in this
# model that is every attention matrix (256 x 256), the embedding and the head.
ALL = [*DEFAULT, "meshspeed-3-t1e5"]


@dataclass(frozen=True)
class Setup:
    """Everything that must be equal across frameworks for the comparison to mean anything."""

    vocab_size: int = 256  # byte-level tokens
    d_model: int = 256  # residual width
    n_layer: int = 6  # transformer blocks (= FSDP2 / stage-3 units)
    n_head: int = 8
    seq_len: int = 128
    micro_batch: int = 8  # sequences per rank per step
    lr: float = 3e-4
    weight_decay: float = 0.01  # torch's AdamW default, and meshspeed's
    fused: bool = True  # torch's fused AdamW kernel everywhere: compare sharding, not kernels
    seed: int = 1234
    warmup: int = 5  # untimed steps first
    steps: int = 30  # timed steps


def make_batches(setup: Setup, world: int, rank: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` (x, y) micro-batches for this rank: byte windows of the Python standard library
    at offsets drawn from one seeded generator, so every framework sees the same data."""
    from meshspeed.data.corpus import stdlib_corpus

    data = torch.frombuffer(bytearray(stdlib_corpus(max_bytes=1_000_000)), dtype=torch.uint8)
    gen = torch.Generator().manual_seed(setup.seed)
    starts = torch.randint(0, len(data) - setup.seq_len - 1, (count, world, setup.micro_batch), generator=gen)
    out = []
    for step in range(count):
        rows = torch.stack([data[s : s + setup.seq_len + 1] for s in starts[step, rank].tolist()]).long()
        out.append((rows[:, :-1].contiguous(), rows[:, 1:].contiguous()))  # (B, T) each
    return out


def build_model(setup: Setup):
    from meshspeed.models.gpt import GPT, GPTConfig

    torch.manual_seed(setup.seed)  # identical initial weights on every rank and framework
    cfg = GPTConfig(vocab_size=setup.vocab_size, max_seq_len=setup.seq_len, n_layer=setup.n_layer,
                    n_head=setup.n_head, d_model=setup.d_model)
    return GPT(cfg)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # DTensor -> this rank's shard


def torch_state_bytes(model, optimizer) -> dict[str, int]:
    from meshspeed.engine.memory import count_bytes, optimizer_state_tensors

    params = list(model.parameters())
    counted = count_bytes({
        "params": [_local(p.detach()) for p in params],
        "grads": [_local(p.grad) for p in params if p.grad is not None],
        "optimizer_state": [_local(t) for t in optimizer_state_tensors(optimizer)],
    })
    return {k: counted[k] for k in ("params", "grads", "optimizer_state")}


class TorchTrainer:
    """DDP or FSDP2: `wrapped` runs forward, the optimizer sees `model`'s parameters."""

    def __init__(self, model, wrapped, setup: Setup):
        self.model, self.wrapped = model, wrapped
        self.opt = torch.optim.AdamW(model.parameters(), lr=setup.lr, weight_decay=setup.weight_decay,
                                     fused=setup.fused)

    def forward(self, x, y):
        return self.wrapped(x, y)

    def backward(self, loss):
        loss.backward()

    def optimizer_step(self):
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def state_bytes(self):
        return torch_state_bytes(self.model, self.opt)


class EngineTrainer:
    """meshspeed, or DeepSpeed through the same `initialize` call and config."""

    def __init__(self, model, setup: Setup, stage: int, library: str = "meshspeed",
                 persistence_threshold: int | None = None):
        zero = {"stage": stage}
        if persistence_threshold is not None:
            zero["stage3_param_persistence_threshold"] = persistence_threshold
        config = {
            "train_micro_batch_size_per_gpu": setup.micro_batch,
            "optimizer": {"type": "AdamW", "params": {"lr": setup.lr, "weight_decay": setup.weight_decay,
                                                      "fused": setup.fused}},
            "zero_optimization": zero,
            "steps_per_print": 10**9,
        }
        lib = importlib.import_module(library)
        self.engine, *_ = lib.initialize(model=model, model_parameters=model.parameters(), config=config)
        self.library = library

    def forward(self, x, y):
        return self.engine(x, y)

    def backward(self, loss):
        self.engine.backward(loss)

    def optimizer_step(self):
        self.engine.step()

    def peak_gathered_bytes(self) -> int:
        """Most stage-3 full-parameter bytes resident at once (meshspeed's own count)."""
        return self.engine.peak_gathered_bytes() if self.library == "meshspeed" else -1

    def state_bytes(self):
        if self.library != "meshspeed":
            # DeepSpeed flattens and partitions into its own buffers; we have no tensor-level
            # accounting for it that we have checked, so only its RSS is reported.
            return {"params": -1, "grads": -1, "optimizer_state": -1}
        b = self.engine.memory_breakdown()  # gathered stage-3 params are released by now
        return {"params": b["params"] + b["master_params"], "grads": b["grads"],
                "optimizer_state": b["optimizer_state"]}


def make_trainer(name: str, setup: Setup, world: int):
    model = build_model(setup)
    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return TorchTrainer(model, DDP(model), setup)
    if name == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return TorchTrainer(model, model, setup)
    library, stage, *variant = name.split("-")
    return EngineTrainer(model, setup, int(stage), library,
                         persistence_threshold=int(float(variant[0][1:])) if variant else None)
