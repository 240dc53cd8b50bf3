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

import meshspeed
from meshspeed import comm
from meshspeed.models.gpt import GPT, GPTConfig
from meshspeed.models.gpt_pipe import GPTPipe
from meshspeed.testing import param_forms
from meshspeed.parallel.gather import gathered
from meshspeed.testing import run_distributed
from meshspeed.topology.shards import TPShard, shards_by_param


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
    tp: int = 1  # tensor-parallel degree; data parallel is world // tp
    sequence_parallel: bool = False
    overlap: bool = False  # tensor_parallel.tp_overlap_comm
    family: str = "gpt"  # "gpt" (meshspeed.models.gpt), "llama" or "gpt2" (transformers)
    pp: int = 1  # pipeline stages (the GPT's pipeline form, meshspeed.models.gpt_pipe)
    schedule: str = "1f1b"  # pipeline.schedule
    virtual: int = 1  # PipelineModule(virtual_stages=...), for "interleaved"
    virtual_in_config: bool = False  # say `virtual` as pipeline.virtual_stages, build the module with 1
    checkpoint_interval: int = 0  # PipelineModule(activation_checkpoint_interval=...), engine side
    cp: int = 1  # context-parallel degree (each sequence split over cp ranks)
    cp_mode: str = "ring_balanced"  # context_parallel.mode; "sp": DeepSpeed's sequence_parallel_size
    ulysses: int | None = None  # context_parallel.ulysses_size, for "hybrid"
    params_form: str = "parameters"  # how initialize gets model_parameters (testing/param_forms.py)
    zero_init: bool = False  # the engine's model is built under meshspeed.zero.Init (stage 3)

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp * self.cp)

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
        if self.tp > 1:
            cfg["tensor_parallel"] = {"autotp_size": self.tp, "sequence_parallel": self.sequence_parallel,
                                      "tp_overlap_comm": self.overlap}
        if self.pp > 1:
            cfg["pipeline"] = {"schedule": self.schedule}
            if self.virtual_in_config:
                cfg["pipeline"]["virtual_stages"] = self.virtual
        if self.cp > 1 and self.cp_mode == "sp":
            cfg["sequence_parallel_size"] = self.cp
        elif self.cp > 1:
            cfg["context_parallel"] = {"size": self.cp, "mode": self.cp_mode,
                                       **({"ulysses_size": self.ulysses} if self.ulysses else {})}
        for key, value in self.extra_config.items():
            if isinstance(value, dict) and isinstance(cfg.get(key), dict):
                cfg[key] = {**cfg[key], **value}
            else:
                cfg[key] = value
        return _files_unless_asked(cfg)


def _files_unless_asked(cfg: dict) -> dict:
    """NVMe offload blocks without `max_in_cpu` get 0: a parity run tests the swap files,
    not the residency MemAvailable would choose on the machine running it (Note [the
    residency budget] in meshspeed/offload/residency.py); tests of residency set it."""
    z = cfg.get("zero_optimization")
    for key in ("offload_param", "offload_optimizer"):
        block = z.get(key) if isinstance(z, dict) else None
        if isinstance(block, dict) and block.get("device") == "nvme" and "max_in_cpu" not in block:
            z[key] = {**block, "max_in_cpu": 0}
    return cfg


def build_model(setup: ParitySetup, seed: int = 0, stages: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    if setup.pp > 1:  # the reference is the same pipeline form in one stage
        return GPTPipe(setup.gpt_config(), num_stages=stages, base_seed=seed + 1234,
                       virtual_stages=setup.virtual if stages > 1 and not setup.virtual_in_config else 1,
                       activation_checkpoint_interval=setup.checkpoint_interval if stages > 1 else 0)
    model = GPT(setup.gpt_config()) if setup.family == "gpt" else _hf_model(setup)
    if setup.frozen:
        for p in model.layers[0].mlp.parameters():
            p.requires_grad_(False)
    return model


def _hf_model(setup: ParitySetup) -> nn.Module:
    """A small randomly initialised transformers model (built from a config, never
    downloaded), eager attention and no dropout so one process and tp ranks compute alike."""
    import transformers  # lazy: optional dependency (dev extra)

    c = setup.gpt_config()
    if setup.family == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.hidden_dim,
            num_hidden_layers=c.n_layer, num_attention_heads=c.n_head,
            num_key_value_heads=c.kv_heads, max_position_embeddings=c.max_seq_len,
            tie_word_embeddings=c.tie_embeddings, attention_dropout=0.0)
        cls = transformers.LlamaForCausalLM
    elif setup.family == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=c.vocab_size, n_embd=c.d_model, n_layer=c.n_layer, n_head=c.n_head,
            n_positions=c.max_seq_len, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            tie_word_embeddings=True)
        cls = transformers.GPT2LMHeadModel
    else:
        raise ValueError(f"unknown model family {setup.family!r}; expected gpt, llama or gpt2")
    cfg._attn_implementation = "eager"
    return cls(cfg)


def model_loss(setup: ParitySetup, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of `tokens` (B, seq + 1) under the setup's model."""
    if setup.pp > 1:  # a one-stage pipeline form
        return model.loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
    if setup.family == "gpt":
        return model(tokens[:, :-1], tokens[:, 1:])
    ids = tokens[:, :-1]  # transformers shifts the labels itself
    return model(input_ids=ids, labels=ids).loss


def make_batches(setup: ParitySetup, seed: int = 1234) -> torch.Tensor:
    """(steps, gas, dp * micro, seq + 1) token ids; data-parallel rank d takes rows
    [d*micro, (d+1)*micro) (every tp rank of it the same rows)."""
    g = torch.Generator().manual_seed(seed)
    vocab = setup.gpt_config().vocab_size
    shape = (setup.steps, setup.gas, setup.dp * setup.micro, setup.seq + 1)
    return torch.randint(0, vocab, shape, generator=g)


def reference_run(setup: ParitySetup, optimizer_cls: type | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, plain PyTorch: mean loss over the whole global batch per step.
    `optimizer_cls`: built with the engine config's optimizer params instead of torch's
    SGD / AdamW (e.g. OneBitAdam, which alone on one process is its uncompressed self)."""
    model = build_model(setup)
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer_cls is None:
        block = setup.optimizer_block()
        groups = param_forms.reference_groups(model, setup.params_form, block["params"].get("weight_decay", 0.0))
        opt = (torch.optim.SGD if block["type"] == "SGD" else torch.optim.AdamW)(groups, **block["params"])
    else:
        opt = optimizer_cls(params, **setup.ds_config()["optimizer"]["params"])
    losses = []
    for batch in make_batches(setup):
        tokens = batch.reshape(-1, setup.seq + 1)
        loss = model_loss(setup, model, tokens)
        loss.backward()
        if setup.clip > 0:
            torch.nn.utils.clip_grad_norm_(params, setup.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def engine_run(setup: ParitySetup) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Runs on every rank of an initialised world of `setup.world` ranks."""
    if setup.zero_init:
        with meshspeed.zero.Init():
            model = build_model(setup, stages=setup.pp)
    else:
        model = build_model(setup, stages=setup.pp)
    decay = setup.optimizer_block()["params"].get("weight_decay", 0.0)
    engine, *_ = meshspeed.initialize(model=model,
                                      model_parameters=param_forms.model_parameters(model, setup.params_form, decay),
                                      config=copy.deepcopy(setup.ds_config()))
    if setup.pp > 1:
        return train_batches(engine, setup), pipeline_state_dict(engine)
    return train_steps(engine, setup), full_state_dict(engine)


def counted_steps(engine, setup: ParitySetup) -> tuple[list[dict[str, int]], list[float]]:
    """One engine step per global batch on this rank's rows: per step the bytes moved by
    collective kind (CommCounter), and the losses."""
    rows = slice(comm.get_rank() * setup.micro, (comm.get_rank() + 1) * setup.micro)
    per_step, losses = [], []
    for batch in make_batches(setup):
        with comm.CommCounter() as counter:
            loss = model_loss(setup, engine, batch[0][rows])
            engine.backward(loss)
            engine.step()
        per_step.append({op: s["bytes"] for op, s in counter.summary().items()})
        losses.append(loss.item())
    return per_step, losses


def train_batches(engine, setup: ParitySetup, first: int = 0, last: int | None = None) -> list[float]:
    """`engine.train_batch` over steps [first, last) of the setup's batches, this dp rank's
    rows as (ids, targets) micro-batches; returns the loss train_batch gives every rank."""
    rank = engine.mesh.coord("dp")
    rows = slice(rank * setup.micro, (rank + 1) * setup.micro)
    losses = []
    for batch in make_batches(setup)[first:last]:
        micro = [(m[rows][:, :-1], m[rows][:, 1:]) for m in batch]
        losses.append(float(engine.train_batch(iter(micro))))
    return losses


def pipeline_state_dict(engine) -> dict[str, torch.Tensor]:
    """Every stage's whole parameters, merged over the pipeline group (a collective)."""
    merged: dict[str, torch.Tensor] = {}
    for part in comm.all_gather_object(full_state_dict(engine), group=engine.mesh.group("pp")):
        merged.update(part)
    return merged


def train_steps(engine, setup: ParitySetup, first: int = 0, last: int | None = None) -> list[float]:
    """Optimizer steps [first, last) of the setup's batches on this rank's rows; returns
    the global mean loss of each step."""
    rank = engine.mesh.coord("dp")
    rows = slice(rank * setup.micro, (rank + 1) * setup.micro)
    losses = []
    for batch in make_batches(setup)[first:last]:
        total = torch.zeros(())
        for micro in batch:
            tokens = micro[rows]
            loss = model_loss(setup, engine, tokens)
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        comm.all_reduce(total)
        losses.append(total.item() / (setup.world * setup.gas))
    return losses


def full_state_dict(engine) -> dict[str, torch.Tensor]:
    """Whole parameters (gathered under stage 3, and from the tensor-parallel pieces) as
    fp32 copies, plus buffers."""
    module = engine.module
    with gathered(list(module.parameters())):
        state = {k: v.detach().float().clone() for k, v in module.state_dict().items()}
        return logical_state(module, state, engine.mesh.group("tp"))


def logical_state(module: nn.Module, state: dict[str, torch.Tensor], tp_group) -> dict[str, torch.Tensor]:
    """`state` with every tensor-parallel piece replaced by the whole parameter (a
    collective over the tp group: every tp rank's local tensor is gathered)."""
    split = shards_by_param(module)
    if not split:
        return state
    param_of = {name: id(p) for name, p in module.named_parameters(remove_duplicate=False)}
    out = dict(state)
    for name in sorted(state):  # the same order on every tp rank
        shard = split.get(param_of.get(name, -1))
        if shard is None:
            continue
        pieces = comm.all_gather_object((state[name], shard.to_json()), group=tp_group)
        full = torch.zeros(shard.logical_shape, dtype=state[name].dtype)
        for piece, info in pieces:
            TPShard.from_json(info).logical_into(piece, full)
        out[name] = full
    return out


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
    world = setups[0].world
    assert all(s.world == world for s in setups), "one world size per call"
    results = run_distributed(engine_runs, world_size=world, args=(setups,), timeout=600)[0]
    for setup, got in zip(setups, results):
        try:
            assert_close_parity(reference_run(setup), got, rtol=rtol, atol=atol)
        except AssertionError as err:
            raise AssertionError(f"{setup}:\n{err}") from None
