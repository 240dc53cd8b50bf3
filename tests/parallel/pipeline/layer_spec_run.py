"""A DeepSpeed-style pipeline script in small, and the one-process run it must equal.

The script is what DeepSpeed users write: `PipelineModule(layers=[LayerSpec...],
num_stages=2)` from `meshspeed.pipe` (DeepSpeed's `deepspeed.pipe`), the parameters listed
before `initialize` in one of the forms of meshspeed/testing/param_forms.py, tensor
parallelism from the config's AutoTP block (`partition_config` with DeepSpeed's
`layer_specs`), the schedule from the config's `pipeline` block. Layers are seeded by
their index (`seed_layers`), so the one-process reference (the same layers, in order,
plain PyTorch AdamW on the whole global batch) starts from the same values.

Used by tests/engine/test_pipeline_tp_params.py and
tests/parallel/pipeline/test_interleaved_config.py.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from meshspeed.pipe import LayerSpec, PipelineModule
from torch import nn

import meshspeed
from meshspeed.testing.parity import pipeline_state_dict

WIDTH, FEATURES, CLASSES, SEED = 64, 16, 4, 1234
LR, DECAY, EPS = 1e-3, 0.1, 1e-6


class Block(nn.Module):
    """A residual MLP block: `up` is split by columns and `down` by rows under AutoTP."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, width)
        self.down = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, width) -> (B, width)
        return x + self.down(torch.relu(self.up(self.norm(x))))


PARTITION = {"layer_specs": [{"patterns": [r".*\.up\.weight$"], "partition_type": "column"},
                             {"patterns": [r".*\.down\.weight$"], "partition_type": "row"}]}


@dataclass
class Script:
    """One run of the script: how the parameters are listed, and the degrees."""

    form: str = "list"  # meshspeed/testing/param_forms.py, or "down": the blocks' down projections
    tp: int = 1
    pp: int = 2
    blocks: int = 4
    steps: int = 3
    gas: int = 4
    micro: int = 2
    pipeline: dict = field(default_factory=dict)  # the config's pipeline block
    virtual_stages: int = 1  # PipelineModule(virtual_stages=...)
    stage: int = 0  # zero_optimization.stage
    clip: float = 1.0  # gradient_clipping
    frozen: tuple[int, ...] = ()  # layers whose parameters the script freezes before initialize
    default_specs: bool | None = False  # partition_config.use_default_specs (None: not given)

    def layers(self) -> list:
        return ([LayerSpec(nn.Linear, FEATURES, WIDTH)] + [LayerSpec(Block, WIDTH) for _ in range(self.blocks)]
                + [LayerSpec(nn.Linear, WIDTH, CLASSES)])

    def config(self) -> dict:
        cfg = {"train_micro_batch_size_per_gpu": self.micro, "gradient_accumulation_steps": self.gas,
               "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": DECAY, "eps": EPS}},
               "gradient_clipping": self.clip, "zero_optimization": {"stage": self.stage},
               "steps_per_print": 10_000}
        if self.tp > 1:
            partition = copy.deepcopy(PARTITION)
            if self.default_specs is not None:
                partition["use_default_specs"] = self.default_specs
            cfg["tensor_parallel"] = {"autotp_size": self.tp, "partition_config": partition}
        if self.pipeline:
            cfg["pipeline"] = dict(self.pipeline)
        return cfg

    def batches(self, dp: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """Per step, per accumulation step: (x, y) of all dp ranks' rows (dp * micro)."""
        g = torch.Generator().manual_seed(7)
        rows = dp * self.micro
        return [[(torch.randn(rows, FEATURES, generator=g), torch.randint(0, CLASSES, (rows,), generator=g))
                 for _ in range(self.gas)] for _ in range(self.steps)]


def listed(params: list[tuple[str, nn.Parameter]], form: str):
    """`model_parameters` as a script writes it, from (name, parameter) in model order."""
    trainable = [p for _, p in params if p.requires_grad]
    if form == "parameters":
        return iter([p for _, p in params])
    if form == "generator":
        return (p for p in trainable)
    if form == "list":
        return trainable
    if form == "filter":
        return filter(lambda p: p.requires_grad, [p for _, p in params])
    if form == "groups":  # Hugging Face's and DeepSpeed-Chat's weight-decay split, by name
        no_decay = ("bias", "norm.weight")
        return [{"params": [p for n, p in params if p.requires_grad and not n.endswith(no_decay)],
                 "weight_decay": DECAY},
                {"params": [p for n, p in params if p.requires_grad and n.endswith(no_decay)],
                 "weight_decay": 0.0}]
    if form == "down":  # fine-tune the blocks' down projections alone; nothing is frozen, the
        # other layers are just not given to the optimizer
        return [p for n, p in params if ".down." in n]
    raise ValueError(f"unknown form {form!r}")


def engine_run(script: Script) -> tuple[list[float], dict[str, torch.Tensor], dict[str, tuple]]:
    """On every rank: the script; then its losses, every stage's whole parameters, and the
    shapes of this rank's own pieces."""
    torch.set_num_threads(1)
    net = PipelineModule(layers=script.layers(), num_stages=script.pp, loss_fn=nn.CrossEntropyLoss(),
                         partition_method="uniform", seed_layers=True, base_seed=SEED,
                         virtual_stages=script.virtual_stages)
    for name, p in net.named_parameters():
        p.requires_grad_(int(name.split(".")[0]) not in script.frozen)
    engine, _, _, _ = meshspeed.initialize(model=net, config=script.config(),
                                           model_parameters=listed(list(net.named_parameters()), script.form))
    dp, rank = engine.mesh.size("dp"), engine.mesh.coord("dp")
    rows = slice(rank * script.micro, (rank + 1) * script.micro)
    losses = [float(engine.train_batch(iter([(x[rows], y[rows]) for x, y in step])))
              for step in script.batches(dp)]
    local = {n: tuple(p.shape) for n, p in engine.module.named_parameters()}
    return losses, pipeline_state_dict(engine), local


def reference_run(script: Script, dp: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process: the same layers, seeded alike, plain AdamW on each global batch."""
    layers = []
    for index, spec in enumerate(script.layers()):
        torch.manual_seed(SEED + index)
        layers.append(spec.build())
    model = nn.ModuleDict({str(i): layer for i, layer in enumerate(layers)})
    params = list(model.named_parameters())
    for name, p in params:
        p.requires_grad_(int(name.split(".")[0]) not in script.frozen)
    groups = list(listed(params, script.form))
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    groups = [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in groups]
    opt = torch.optim.AdamW(groups, lr=LR, weight_decay=DECAY, eps=EPS)
    trained = [p for g in groups for p in g["params"]]
    losses = []
    for step in script.batches(dp):
        x = torch.cat([x for x, _ in step])
        y = torch.cat([y for _, y in step])
        for layer in layers:
            x = layer(x)
        loss = nn.functional.cross_entropy(x, y)
        loss.backward()
        if script.clip > 0:
            torch.nn.utils.clip_grad_norm_(trained, script.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in params}


def assert_equal_runs(got, ref, what: str) -> None:
    """Losses and parameters (`engine_run`'s first two) within fp32 rounding (rtol 1e-5)."""
    losses, state = got[:2]
    ref_losses, ref_state = ref
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"{what}: losses {losses}, one process {ref_losses}\n{m}")
    assert state.keys() == ref_state.keys(), f"{what}: parameters {sorted(state)} vs {sorted(ref_state)}"
    for name in ref_state:
        torch.testing.assert_close(state[name], ref_state[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"{what}: parameter {n}\n{m}")


def split_shapes(results: list) -> dict[str, tuple]:
    """The local shapes of the blocks' projections on every rank (`engine_run` results of
    all ranks): under tp 2, `up` keeps half its rows and `down` half its columns."""
    return {(rank, n): shape for rank, r in enumerate(results) for n, shape in r[2].items()
            if n.endswith((".up.weight", ".down.weight"))}
