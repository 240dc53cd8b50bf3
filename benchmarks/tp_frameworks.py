"""The tensor-parallel implementations `tensor_parallel.py` compares, behind one trainer.

A trainer has `step(x) -> loss` (forward, backward and the optimizer step on one batch)
and `blocked_timer()`: a context manager whose `seconds` is, on exit, the time this process
spent blocked in collectives inside it (meshspeed's `comm.BlockedTimer`), or None where the
implementation has no way to tell. Every trainer trains the same
randomly initialised `transformers` Llama (the parent builds it once and hands every
variant its state dict, Note [one init, one batch file] in tensor_parallel.py) with AdamW
(torch's fused kernel everywhere), no gradient clipping, on the same token batches; TP has
no data-parallel axis here, so both ranks see the whole batch.

The loss is HF's causal-LM loss everywhere: logits at positions 0..T-2 against the tokens
at 1..T-1, mean over the B(T-1) targets (`labels=x` for the HF forward, which shifts).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# name -> (implementation, sequence parallel, loss parallel / overlap)
TORCH = ["torch-tp", "torch-tp-sp", "torch-tp-sp-lp"]
DEEPSPEED = ["deepspeed-autotp"]
MESHSPEED = ["meshspeed-tp", "meshspeed-tp-overlap", "meshspeed-tp-sp", "meshspeed-tp-sp-overlap"]
REFERENCE = "single"  # one process, no TP: the losses' ground truth, and what TP buys
ALL = [REFERENCE, *TORCH, *DEEPSPEED, *MESHSPEED]


@dataclass(frozen=True)
class Setup:
    """Everything that must be equal across implementations for the comparison to mean anything."""

    vocab_size: int = 4096  # pairs of 6-bit-folded bytes of the stdlib corpus (make_batches)
    hidden_size: int = 384
    intermediate_size: int = 1024  # SwiGLU width
    num_layers: int = 4
    num_heads: int = 6  # head_dim 64
    num_kv_heads: int = 2  # GQA: 3 query heads share a key/value head; one kv head per tp rank
    seq_len: int = 256
    micro_batch: int = 2  # sequences per step (the tp group's one batch)
    lr: float = 3e-4
    weight_decay: float = 0.01
    seed: int = 1234
    warmup: int = 5  # untimed steps first
    steps: int = 20  # timed steps

    def llama_config(self):
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
            max_position_embeddings=self.seq_len, tie_word_embeddings=False,
            attn_implementation="sdpa")


def build_model(setup: Setup, state_dict: dict | None = None):
    """The Llama of `setup`, with `state_dict`'s weights when given (the parent's init)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(setup.seed)
    model = LlamaForCausalLM(setup.llama_config())
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model.train()


def make_batches(setup: Setup, count: int) -> torch.Tensor:
    """(count, B, T) token ids from the Python standard library's source, at offsets drawn
    from one seeded generator. A token is two bytes folded to 6 bits each (b0 % 64 * 64 +
    b1 % 64): a 4096-word vocabulary that still has the text's structure to learn."""
    from meshspeed.data.corpus import stdlib_corpus

    assert setup.vocab_size == 4096, "the folding below makes 4096 tokens"
    data = torch.frombuffer(bytearray(stdlib_corpus(max_bytes=2_000_000)), dtype=torch.uint8).long()
    tokens = (data[0::2][: len(data) // 2] % 64) * 64 + data[1::2][: len(data) // 2] % 64
    gen = torch.Generator().manual_seed(setup.seed)
    starts = torch.randint(0, len(tokens) - setup.seq_len, (count, setup.micro_batch), generator=gen)
    return torch.stack([torch.stack([tokens[s : s + setup.seq_len] for s in row.tolist()]) for row in starts])


def positions(x: torch.Tensor) -> torch.Tensor:
    """Explicit position ids: under sequence parallelism HF's LlamaModel would otherwise
    count positions from the embedding's output, which holds only this rank's T/tp tokens."""
    return torch.arange(x.shape[1]).unsqueeze(0).expand_as(x)


def _adamw(params, setup: Setup):
    return torch.optim.AdamW(params, lr=setup.lr, weight_decay=setup.weight_decay, fused=True)


class SingleTrainer:
    """One process, no TP: the reference every TP run is checked against."""

    def __init__(self, model, setup: Setup):
        self.model, self.opt = model, _adamw(model.parameters(), setup)

    def step(self, x):
        loss = self.model(input_ids=x, position_ids=positions(x), labels=x).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss

    def blocked_timer(self):
        return NoTimer()


# -- torch's own TP, applied as torchtitan applies it to Llama -----------------------------------


def apply_torch_tp(model, mesh, sequence_parallel: bool, loss_parallel: bool):
    """torchtitan's `apply_tp` (models/llama3/infra/parallelize.py), on HF module names.

    q/k/v and gate/up are column-parallel, o and down row-parallel, the embedding is
    row-parallel (vocabulary-sharded) and the head column-parallel. With sequence
    parallelism the residual stream between blocks is sharded on the sequence (Shard(1)):
    the norms run on T/tp tokens, o/down reduce-scatter instead of all-reduce, and the
    attention and MLP inputs are all-gathered. With loss parallelism the head's output stays
    vocabulary-sharded and the cross-entropy runs inside `loss_parallel()`."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    stream = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout
    top = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        "lm_head": ColwiseParallel(input_layouts=stream,
                                   output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                   use_local_output=not loss_parallel),
    }
    if sequence_parallel:
        top["model.norm"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    for layer in model.model.layers:
        plan = {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=stream),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=stream),
        }
        if sequence_parallel:
            plan.update({
                "input_layernorm": SequenceParallel(),
                "post_attention_layernorm": SequenceParallel(),
                # HF passes the attention's input by keyword, the MLP's by position
                "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                desired_input_kwarg_layouts={"hidden_states": Replicate()}),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            })
        parallelize_module(layer, mesh, plan)
    return model


class TorchTPTrainer:
    """torch TP. Parameters left out of the plan (the norms without sequence parallelism)
    stay plain tensors; torch's AdamW cannot step DTensors and tensors in one call, so each
    kind gets its own optimizer (same hyperparameters, same fused kernel)."""

    def __init__(self, model, setup: Setup, world: int, sequence_parallel: bool, loss_parallel: bool):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor

        self.model = apply_torch_tp(model, init_device_mesh("cpu", (world,)), sequence_parallel, loss_parallel)
        self.loss_parallel = loss_parallel
        params = list(self.model.parameters())
        kinds = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
        self.opts = [_adamw(ps, setup) for ps in kinds if ps]

    def step(self, x):
        from contextlib import nullcontext

        from torch.distributed.tensor.parallel import loss_parallel

        hidden = self.model.model(input_ids=x, position_ids=positions(x)).last_hidden_state
        logits = self.model.lm_head(hidden)  # (B, T, V): vocabulary-sharded DTensor with loss parallel
        with loss_parallel() if self.loss_parallel else nullcontext():
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
        for opt in self.opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss.full_tensor() if hasattr(loss, "full_tensor") else loss

    def blocked_timer(self):
        return NoTimer()


# -- DeepSpeed AutoTP and meshspeed: the same initialize call and config -------------------------


def engine_config(setup: Setup, tp: int, sequence_parallel: bool = False, overlap: bool = False,
                  library: str = "meshspeed") -> dict:
    tensor_parallel: dict = {"autotp_size": tp}
    if library == "meshspeed":
        tensor_parallel.update(tp_overlap_comm=overlap, sequence_parallel=sequence_parallel)
    return {
        "train_micro_batch_size_per_gpu": setup.micro_batch,
        # torch_adam: DeepSpeed uses torch.optim.AdamW (no JIT-built op); meshspeed ignores it
        "optimizer": {"type": "AdamW", "params": {"lr": setup.lr, "weight_decay": setup.weight_decay,
                                                  "fused": True, "torch_adam": True}},
        "gradient_clipping": 0.0,  # meshspeed's default; DeepSpeed's is 1.0
        "zero_optimization": {"stage": 0},
        "tensor_parallel": tensor_parallel,
        "steps_per_print": 10**9,
    }


class EngineTrainer:
    """meshspeed or DeepSpeed: `initialize` with a `tensor_parallel` block, then HF's loss."""

    def __init__(self, model, setup: Setup, world: int, library: str, sequence_parallel=False, overlap=False):
        lib = importlib.import_module(library)
        config = engine_config(setup, world, sequence_parallel, overlap, library)
        self.engine, *_ = lib.initialize(model=model, model_parameters=model.parameters(), config=config)
        self.library = library
        ms_per_mb = float(os.environ.get("MESHSPEED_BENCH_SLOW_LINK", "0") or 0)
        if library == "meshspeed" and ms_per_mb > 0:  # Note [a link that does not take the CPU]
            from meshspeed.testing.slow_comm import SlowLink

            self._link = SlowLink(latency=1e-4, seconds_per_mb=ms_per_mb / 1e3).__enter__()

    def step(self, x):
        loss = self.engine(input_ids=x, position_ids=positions(x), labels=x).loss
        self.engine.backward(loss)
        self.engine.step()
        return loss

    def blocked_timer(self):
        if self.library != "meshspeed":
            return NoTimer()
        from meshspeed import comm

        return comm.BlockedTimer()  # host time inside sync collectives and async waits


class NoTimer:
    """A blocked-time timer that measures nothing (`seconds` is None)."""

    seconds = None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return False


def make_trainer(name: str, setup: Setup, world: int, state_dict: dict):
    model = build_model(setup, state_dict)
    if name == REFERENCE:
        return SingleTrainer(model, setup)
    if name in TORCH:
        return TorchTPTrainer(model, setup, world, sequence_parallel="-sp" in name, loss_parallel=name.endswith("-lp"))
    if name in DEEPSPEED:
        return EngineTrainer(model, setup, world, "deepspeed")
    if name in MESHSPEED:
        return EngineTrainer(model, setup, world, "meshspeed", sequence_parallel="-sp" in name,
                             overlap=name.endswith("-overlap"))
    raise ValueError(f"unknown implementation {name!r}; choose from {ALL}")
