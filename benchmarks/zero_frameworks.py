"""The frameworks `zero.py` compares, behind one small trainer protocol.

A trainer has `forward(x, y) -> loss`, `backward(loss)`, `optimizer_step()` and
`state_bytes()`
(see Note [what counts as model state] in zero.py). All of them train the same GPT from
the same seed on the same data with AdamW (lr 3e-4, weight decay 0.01, torch's fused
kernel: meshspeed picks it by default, torch only on request, DeepSpeed with
`"torch_adam": true`, and the comparison is about sharding, not optimizer kernels), and no
gradient clipping (DeepSpeed's default is 1.0, so the config says 0 explicitly).

Note [bf16 in each framework]
With `Setup.bf16` every framework computes in bf16 and keeps fp32 master weights, each in
its own natural way:
- meshspeed and DeepSpeed: config `"bf16": {"enabled": true}`; both cast the model to bf16
  and keep fp32 master weights (sharded from stage 1 on). meshspeed reduces gradients in
  fp32 (its default), DeepSpeed in bf16 (its default: the gradients' dtype).
- ddp: the model cast to bf16 under torch DDP, with a comm hook that all-reduces each
  bucket in fp32 and hands the averaged fp32 gradients to an fp32 master copy of every
  parameter; AdamW steps the masters, which are then copied back into the bf16 model. This
  is the arithmetic of meshspeed stage 0 (bf16 grads -> fp32, all-reduce, / N, AdamW on
  fp32 masters, copy to bf16).
- fsdp2: the fp32 model under `fully_shard(mp_policy=MixedPrecisionPolicy(
  param_dtype=bf16, reduce_dtype=fp32))`: the sharded fp32 parameters are the masters, each
  unit is all-gathered and cast to bf16 for compute, gradients are reduce-scattered in fp32.
  Buffers (the rotary tables) stay fp32 here, whereas the others cast them to bf16.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

MESHSPEED = [f"meshspeed-{s}" for s in range(4)]
DEEPSPEED = [f"deepspeed-{s}" for s in (1, 2, 3)]
DEFAULT = ["ddp", *MESHSPEED, "fsdp2", *DEEPSPEED]
# Not run by default: meshspeed stage 3 with stage3_param_persistence_threshold 1e5
# (DeepSpeed's default), which keeps every parameter of at most 1e5 elements whole on every
# rank (in the default shape: every attention matrix, 256 x 256, the embedding and the head;
# in layer-heavy: every matrix but the embedding and head), and DeepSpeed stage 3 with
# meshspeed's default threshold, 0 (every parameter partitioned).
ALL = [*DEFAULT, "meshspeed-3-t1e5", "deepspeed-3-t0"]


@dataclass(frozen=True)
class Setup:
    """Everything that must be equal across frameworks for the comparison to mean anything."""

    shape: str = "default"  # the name of the preset in SHAPES the model fields come from
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
    bf16: bool = False  # bf16 compute with fp32 master weights (Note [bf16 in each framework])
    warmup: int = 5  # untimed steps first
    steps: int = 30  # timed steps

    @property
    def precision(self) -> str:
        return "bf16" if self.bf16 else "fp32"

    @classmethod
    def of_shape(cls, shape: str, micro_batch: int | None = None, **kw) -> Setup:
        """The preset `shape` of SHAPES, with its micro-batch unless `micro_batch` is given."""
        fields = dict(SHAPES[shape])
        if micro_batch is not None:
            fields["micro_batch"] = micro_batch
        return replace(cls(), shape=shape, **fields, **kw)


# Model shapes; each framework's run (35 steps) takes under a minute on 2 cores. The data
# is bytes, so a larger vocabulary only makes the embedding and the head larger.
_SHAPE_FIELDS = ("vocab_size", "d_model", "n_layer", "n_head", "seq_len", "micro_batch")
SHAPES = {name: dict(zip(_SHAPE_FIELDS, values)) for name, values in {
    "default": (256, 256, 6, 8, 128, 8),  # about 5.0M parameters, spread over 6 blocks
    "vocab-heavy": (32000, 256, 2, 8, 128, 4),  # about 18.0M, 91% in the embedding and the head
    "layer-heavy": (256, 192, 16, 6, 128, 4),  # about 7.2M in 16 thin blocks (many stage-3 units)
    # ZeRO's regime: model state (16 bytes a parameter, 405 MiB) dwarfs the activations of
    # one short sequence, as it does for billion-parameter models; the memory claim is
    # measured here, where sharding model state is what decides peak memory
    "state-heavy": (256, 512, 8, 8, 64, 1),  # about 25.3M in 8 blocks
}.items()}


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
    from meshspeed.parallel.memory import count_bytes, optimizer_state_tensors

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


class MasterWeightsDDP(TorchTrainer):
    """The bf16 DDP baseline (Note [bf16 in each framework]): torch DDP over the bf16 model,
    buckets all-reduced in fp32 by a comm hook that also sets the fp32 masters' gradients."""

    def __init__(self, model, setup: Setup, world: int):
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.world = world
        self.model = model.to(torch.bfloat16)
        self.params = list(self.model.parameters())
        self.master_of = {id(p): torch.nn.Parameter(p.detach().float()) for p in self.params}
        self.wrapped = DDP(self.model)
        self.wrapped.register_comm_hook(self, _reduce_in_fp32)
        self.opt = torch.optim.AdamW([self.master_of[id(p)] for p in self.params], lr=setup.lr,
                                     weight_decay=setup.weight_decay, fused=setup.fused)

    def optimizer_step(self):
        self.opt.step()
        with torch.no_grad():
            for p in self.params:
                p.copy_(self.master_of[id(p)])
                p.grad = None
        self.opt.zero_grad(set_to_none=True)

    def state_bytes(self):
        from meshspeed.parallel.memory import count_bytes, optimizer_state_tensors

        masters = list(self.master_of.values())
        counted = count_bytes({
            "params": [p.detach() for p in self.params],
            "master_params": [m.detach() for m in masters],
            "grads": [p.grad for p in self.params],
            "optimizer_state": optimizer_state_tensors(self.opt),
            "comm_buffers": [m.grad for m in masters],  # the fp32 reduced gradients
        })
        return {"params": counted["params"] + counted["master_params"], "grads": counted["grads"],
                "optimizer_state": counted["optimizer_state"], "comm_buffers": counted["comm_buffers"]}


def _reduce_in_fp32(state: MasterWeightsDDP, bucket):
    """DDP comm hook: all-reduce an fp32 copy of the bucket, average it, make its pieces the
    fp32 masters' gradients, and hand DDP the result in bf16 for the parameters' .grad."""
    flat = bucket.buffer().float()
    params = bucket.parameters()
    assert sum(p.numel() for p in params) == flat.numel(), "DDP bucket layout changed"

    def done(fut):
        reduced = fut.value()[0].div_(state.world)
        offset = 0
        for p in params:  # the bucket holds its parameters' gradients back to back
            state.master_of[id(p)].grad = reduced[offset : offset + p.numel()].view(p.shape)
            offset += p.numel()
        return bucket.buffer().copy_(reduced)

    return dist.all_reduce(flat, async_op=True).get_future().then(done)


def engine_config(setup: Setup, stage: int, persistence_threshold: int | None = None) -> dict:
    """The one config meshspeed and DeepSpeed both get."""
    zero = {"stage": stage}
    if persistence_threshold is not None:
        zero["stage3_param_persistence_threshold"] = persistence_threshold
    config = {
        "train_micro_batch_size_per_gpu": setup.micro_batch,
        # torch_adam: DeepSpeed uses torch.optim.AdamW (no JIT-built op); meshspeed ignores it
        "optimizer": {"type": "AdamW", "params": {"lr": setup.lr, "weight_decay": setup.weight_decay,
                                                  "fused": setup.fused, "torch_adam": True}},
        "gradient_clipping": 0.0,  # meshspeed's default; DeepSpeed's is 1.0
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }
    if setup.bf16:
        config["bf16"] = {"enabled": True}
    return config


class EngineTrainer:
    """meshspeed, or DeepSpeed through the same `initialize` call and config."""

    def __init__(self, model, setup: Setup, stage: int, library: str = "meshspeed",
                 persistence_threshold: int | None = None):
        lib = importlib.import_module(library)
        config = engine_config(setup, stage, persistence_threshold)
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
            return deepspeed_state_bytes(self.engine)
        b = self.engine.memory_breakdown()  # gathered stage-3 params are released by now
        return {"params": b["params"] + b["master_params"], "grads": b["grads"],
                "optimizer_state": b["optimizer_state"], "comm_buffers": b["comm_buffers"]}


def deepspeed_state_bytes(engine) -> dict[str, int]:
    """DeepSpeed's model state on this rank, from the buffers its ZeRO optimizers keep
    (attribute names of DeepSpeed 0.19.8; -1 everywhere when they are not there):
    - params: the storages behind the module's parameters (stages 1-2: the flat buffer of all
      parameters; stage 3: the persistent parameters, gathered ones are released by now), the
      stage-3 flat partition, and the fp32 master partition (stages 1-2 keep one even in fp32);
    - grads: the reduced gradient partition (stages 1-2: `averaged_gradients`; stage 3:
      `grad_partitions_flat_buffer`) and any gradient on a master or parameter;
    - optimizer_state: the wrapped torch optimizer's state;
    - comm_buffers: the stage-3 reduce bucket (allocated at reduce_bucket_size, 5e8 elements,
      with torch.empty: its storage is counted whole, though only touched pages reach RSS)."""
    from meshspeed.parallel.memory import count_bytes, optimizer_state_tensors

    opt = engine.optimizer
    module_params = [p.detach() for p in engine.module.parameters()]
    if hasattr(opt, "fp32_partitioned_groups_flat"):  # stage 3
        params = [*module_params, *getattr(opt, "fp16_partitioned_groups_flat", [])]
        params += [p.ds_tensor for p in engine.module.parameters() if getattr(p, "ds_tensor", None) is not None]
        masters = list(opt.fp32_partitioned_groups_flat)
        grads = [getattr(opt, "grad_partitions_flat_buffer", None)]
        comm = [getattr(b, "buffer", None) for b in getattr(opt, "ipg_buckets", {}).values()]
    elif hasattr(opt, "single_partition_of_fp32_groups"):  # stages 1 and 2
        params = [*module_params, *opt.bit16_groups_flat]
        masters = list(opt.single_partition_of_fp32_groups)
        averaged = getattr(opt, "averaged_gradients", {})
        grads = [g for gs in (averaged.values() if isinstance(averaged, dict) else averaged) for g in gs or ()]
        comm = [b for b in getattr(opt, "ipg_buffer", None) or () if isinstance(b, torch.Tensor)]
    else:
        return {"params": -1, "grads": -1, "optimizer_state": -1}
    grads += [t.grad for t in [*masters, *engine.module.parameters()]]
    inner = getattr(opt, "optimizer", opt)
    counted = count_bytes({"params": params, "master_params": masters, "grads": grads,
                           "optimizer_state": optimizer_state_tensors(inner), "comm_buffers": comm})
    return {"params": counted["params"] + counted["master_params"], "grads": counted["grads"],
            "optimizer_state": counted["optimizer_state"], "comm_buffers": counted["comm_buffers"]}


def is_deepspeed(name: str) -> bool:
    return name.startswith("deepspeed")


def make_trainer(name: str, setup: Setup, world: int):
    model = build_model(setup)
    if name == "ddp":
        if setup.bf16:
            return MasterWeightsDDP(model, setup, world)
        from torch.nn.parallel import DistributedDataParallel as DDP

        return TorchTrainer(model, DDP(model), setup)
    if name == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (world,))
        kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              } if setup.bf16 else {}
        for block in model.layers:
            fully_shard(block, mesh=mesh, **kw)
        fully_shard(model, mesh=mesh, **kw)
        return TorchTrainer(model, model, setup)
    library, stage, *variant = name.split("-")
    return EngineTrainer(model, setup, int(stage), library,
                         persistence_threshold=int(float(variant[0][1:])) if variant else None)
