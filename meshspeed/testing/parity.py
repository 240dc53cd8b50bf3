"""Parity helpers: train the same model with the engine on N ranks and in one process.

The reference sees, at every optimizer step, the concatenation of all ranks' micro-batches
of all accumulation steps, and takes one plain PyTorch step on their mean loss; the engine
run on N ranks must reproduce its losses and final parameters.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from meshspeed.models.gpt import GPT, GPTConfig


@dataclass
class ParitySetup:
    steps: int = 10
    world: int = 2
    gas: int = 1
    micro: int = 2
    seq: int = 16
    stage: int = 0
    optimizer: str = "AdamW"  # or "SGD" (momentum, no clipping: sensitive to gradient scale)
    clip: float = 1.0
    tie: bool = False
    frozen: bool = False  # freeze layers[0].mlp (a frozen sub-module, like LoRA's base)
    precision: str = "fp32"
    lr: float = 1e-3
    model: dict = field(default_factory=dict)
    extra_config: dict = field(default_factory=dict)

    def gpt_config(self) -> GPTConfig:
        base = {"vocab_size": 64, "max_seq_len": self.seq, "n_layer": 2, "n_head": 2,
                "d_model": 32, "tie_embeddings": self.tie}
        return GPTConfig(**{**base, **self.model})

    def optimizer_block(self) -> dict:
        if self.optimizer == "SGD":
            return {"type": "SGD", "params": {"lr": self.lr, "momentum": 0.9}}
        # eps 1e-6 (not 1e-8): Adam turns a gradient element at rounding level (~1e-9), whose
        # sign depends on summation order, into a full-size +-lr update; a larger eps keeps
        # the comparison about the gradients rather than about that amplified noise.
        return {"type": "AdamW", "params": {"lr": self.lr, "weight_decay": 0.1, "eps": 1e-6}}

    def ds_config(self) -> dict:
        cfg = {
            "train_micro_batch_size_per_gpu": self.micro,
            "gradient_accumulation_steps": self.gas,
            "optimizer": self.optimizer_block(),
            "gradient_clipping": self.clip,
            "zero_optimization": {"stage": self.stage, "stage3_param_persistence_threshold": 0},
            "steps_per_print": 10_000,
        }
        if self.precision in ("bf16", "fp16"):
            cfg[self.precision] = {"enabled": True}
        for key, value in self.extra_config.items():
            if isinstance(value, dict) and isinstance(cfg.get(key), dict):
                cfg[key] = {**cfg[key], **value}
            else:
                cfg[key] = value
        return cfg


def build_model(setup: ParitySetup, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = GPT(setup.gpt_config())
    if setup.frozen:
        for p in model.layers[0].mlp.parameters():
            p.requires_grad_(False)
    return model


def make_batches(setup: ParitySetup, seed: int = 1234) -> torch.Tensor:
    """(steps, gas, world * micro, seq + 1) token ids; rank r takes rows [r*micro, (r+1)*micro)."""
    g = torch.Generator().manual_seed(seed)
    vocab = setup.gpt_config().vocab_size
    shape = (setup.steps, setup.gas, setup.world * setup.micro, setup.seq + 1)
    return torch.randint(0, vocab, shape, generator=g)


def reference_run(setup: ParitySetup) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, plain PyTorch: mean loss over the whole global batch per step."""
    model = build_model(setup)
    params = [p for p in model.parameters() if p.requires_grad]
    block = setup.optimizer_block()
    cls = torch.optim.SGD if block["type"] == "SGD" else torch.optim.AdamW
    opt = cls(params, **block["params"])
    losses = []
    for batch in make_batches(setup):
        tokens = batch.reshape(-1, setup.seq + 1)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        if setup.clip > 0:
            torch.nn.utils.clip_grad_norm_(params, setup.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def engine_run(setup: ParitySetup) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Runs on every rank of an initialised world of `setup.world` ranks."""
    import meshspeed
    model = build_model(setup)
    engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=copy.deepcopy(setup.ds_config()))
    return train_steps(engine, setup), full_state_dict(engine)


def train_steps(engine, setup: ParitySetup, first: int = 0, last: int | None = None) -> list[float]:
    """Optimizer steps [first, last) of the setup's batches on this rank's rows; returns
    the global mean loss of each step."""
    from meshspeed import comm

    rank = comm.get_rank()
    rows = slice(rank * setup.micro, (rank + 1) * setup.micro)
    losses = []
    for batch in make_batches(setup)[first:last]:
        total = torch.zeros(())
        for micro in batch:
            tokens = micro[rows]
            loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        comm.all_reduce(total)
        losses.append(total.item() / (setup.world * setup.gas))
    return losses


def full_state_dict(engine) -> dict[str, torch.Tensor]:
    """Whole parameters (gathered under stage 3) as fp32 copies, plus buffers."""
    from meshspeed.zero import GatheredParameters

    module = engine.module
    with GatheredParameters(list(module.parameters())):
        return {k: v.detach().float().clone() for k, v in module.state_dict().items()}


def assert_close_parity(ref, got, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    ref_losses, ref_state = ref
    losses, state = got
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=atol,
                               msg=lambda m: f"losses differ:\n{m}\nref {ref_losses}\ngot {losses}")
    assert ref_state.keys() == state.keys()
    for name in ref_state:
        torch.testing.assert_close(state[name], ref_state[name].float(), rtol=rtol, atol=atol,
                                   msg=lambda m, n=name: f"parameter {n}: {m}")


def engine_runs(setups: list[ParitySetup]) -> list[tuple[list[float], dict[str, torch.Tensor]]]:
    """Several engine runs in one distributed call (saves a round trip per setup)."""
    return [engine_run(s) for s in setups]


def check_parity(setups: list[ParitySetup], rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Run `setups` (all with the same world size) on the harness and compare each with
    its one-process reference; raises AssertionError naming the failing setup."""
    from meshspeed.testing import run_distributed

    world = setups[0].world
    assert all(s.world == world for s in setups), "one world size per call"
    results = run_distributed(engine_runs, world_size=world, args=(setups,), timeout=600)[0]
    for setup, got in zip(setups, results):
        try:
            assert_close_parity(reference_run(setup), got, rtol=rtol, atol=atol)
        except AssertionError as err:
            raise AssertionError(f"{setup}:\n{err}") from None
