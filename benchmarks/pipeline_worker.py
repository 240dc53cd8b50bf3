"""The model, data and timed loop that `pipeline.py` runs under meshspeed and DeepSpeed.

Self-contained on purpose: it imports torch (and, in its DeepSpeed entry, deepspeed), never
meshspeed, so the DeepSpeed side runs in its own venv with nothing of meshspeed on the
path, and both frameworks build the very same layers from this file.

    python pipeline_worker.py --stages 2 --micro-batches 4 8 16 --out result.json
        # DeepSpeed's PipelineEngine (1F1B) on `--stages` gloo ranks, DS_ACCELERATOR=cpu

The model is a small pre-norm GPT written as a layer list, `layer_specs(cfg, LayerSpec)`:
`Embed` (tokens + learned positions), `n_layer` x `Block` (causal attention through
`F.scaled_dot_product_attention`, a GELU MLP of 4 d_model), `FinalNorm` (LayerNorm), `Head`
(untied). Every layer draws its initial weights from its own generator, seeded by its index,
so the weights do not depend on which stage (or framework) builds the layer. The stages are
cut with `partition_method="type:Block"` in both frameworks: equal numbers of blocks, the
embedding on the first stage, the norm and head on the last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 256
    n_head: int = 4
    n_layer: int = 8
    micro_batch: int = 4  # sequences per micro-batch
    seed: int = 1234
    lr: float = 3e-4
    weight_decay: float = 0.01


def _init(module: nn.Module, seed: int, residual_std: float) -> None:
    """N(0, 0.02) for every Linear / Embedding weight (the output projections scaled), zero
    biases, from a generator of this layer's own."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, sub in module.named_modules():
            if isinstance(sub, (nn.Linear, nn.Embedding)):
                std = residual_std if name.endswith(("proj", "down")) else 0.02
                sub.weight.normal_(0.0, std, generator=g)
                if getattr(sub, "bias", None) is not None:
                    sub.bias.zero_()


class Embed(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        _init(self, cfg.seed + index, 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, d)
        return self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        d = cfg.d_model
        self.n_head = cfg.n_head
        self.attn_norm, self.mlp_norm = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        _init(self, cfg.seed + index, 0.02 / math.sqrt(2 * cfg.n_layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, d) -> (B, T, d)
        B, T, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(B, T, 3, self.n_head, d // self.n_head).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, d))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class FinalNorm(nn.LayerNorm):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__(cfg.d_model)


class Head(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.out = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        _init(self, cfg.seed + index, 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, d) -> (B, T, vocab)
        return self.out(x)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.reshape(-1))


def layer_specs(cfg: ModelConfig, layer_spec) -> list:
    """The layer list, as `layer_spec(cls, cfg, index)` of the framework's LayerSpec class."""
    classes = [Embed, *[Block] * cfg.n_layer, FinalNorm, Head]
    return [layer_spec(cls, cfg, i) for i, cls in enumerate(classes)]


def make_batches(cfg: ModelConfig, batches: int, micro_batches: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """`batches` lists of `micro_batches` (ids, targets) pairs, (B, T) int64 each: next-token
    windows of one seeded random token stream (timing does not need learnable data)."""
    g = torch.Generator().manual_seed(cfg.seed)
    rows = torch.randint(0, cfg.vocab_size, (batches, micro_batches, cfg.micro_batch, cfg.seq_len + 1),
                         generator=g)
    return [[(mb[:, :-1].contiguous(), mb[:, 1:].contiguous()) for mb in batch] for batch in rows]


def engine_config(cfg: ModelConfig, micro_batches: int) -> dict:
    """The one config both engines get (meshspeed adds its `pipeline.schedule`)."""
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch,
        "gradient_accumulation_steps": micro_batches,
        # torch_adam: DeepSpeed uses torch.optim.AdamW (no JIT-built op); meshspeed ignores it
        "optimizer": {"type": "AdamW", "params": {"lr": cfg.lr, "weight_decay": cfg.weight_decay,
                                                  "fused": True, "torch_adam": True}},
        "gradient_clipping": 0.0,  # meshspeed's default; DeepSpeed's is 1.0
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10**9,
    }


def busy_seconds() -> float:
    """CPU seconds all processes of the machine have been busy since boot (/proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def wait_until_idle(max_wait: float, threshold: float = 0.2) -> float:
    """Sleep until less than `threshold` of the machine's CPUs are busy over a second (or
    `max_wait` seconds pass); returns the last busy fraction."""
    deadline = time.monotonic() + max_wait
    while True:
        b0, t0 = busy_seconds(), time.perf_counter()
        time.sleep(1.0)
        busy = (busy_seconds() - b0) / ((time.perf_counter() - t0) * os.cpu_count())
        if busy < threshold or time.monotonic() >= deadline:
            return busy


class LoadMeter:
    """How much of the machine's CPU time other processes took meanwhile: (the machine's busy
    seconds - every rank's own CPU seconds) / (wall seconds x CPUs). `stop()` is a collective."""

    def start(self) -> None:
        self.busy, self.cpu, self.wall = busy_seconds(), time.process_time(), time.perf_counter()

    def stop(self, all_gather_object) -> float:
        cpu = time.process_time() - self.cpu
        busy, wall = busy_seconds() - self.busy, time.perf_counter() - self.wall
        cpus = [None] * int(os.environ["WORLD_SIZE"])
        all_gather_object(cpus, cpu)
        return max(0.0, (busy - sum(cpus)) / (wall * os.cpu_count()))


def timed_batches(engine, batches, barrier) -> tuple[list[float], list[float], list[float]]:
    """train_batch over `batches`, each started at a barrier; (wall seconds, this process's
    CPU seconds, loss) of each."""
    seconds, cpu, losses = [], [], []
    for batch in batches:
        barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        loss = engine.train_batch(iter(batch))
        seconds.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        losses.append(float(loss))
    return seconds, cpu, losses


def stage_params(engine) -> int:
    return sum(p.numel() for p in engine.module.parameters())


# -- DeepSpeed -------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deepspeed_rank(rank: int, world: int, port: int, cfg: ModelConfig, micro_batches: list[int],
                   warmup: int, steps: int, wait_idle: float, out_file: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import deepspeed
    import torch.distributed as dist
    from deepspeed.pipe import LayerSpec, PipelineModule

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    results = []
    try:
        for m in micro_batches:
            torch.manual_seed(cfg.seed)
            net = PipelineModule(layers=layer_specs(cfg, LayerSpec), num_stages=world, loss_fn=lm_loss,
                                 partition_method="type:Block")
            engine, *_ = deepspeed.initialize(model=net, model_parameters=[p for p in net.parameters()],
                                              config=engine_config(cfg, m))
            batches = make_batches(cfg, warmup + steps, m)
            timed_batches(engine, batches[:warmup], dist.barrier)
            if rank == 0 and wait_idle:
                wait_until_idle(wait_idle)
            meter = LoadMeter()
            meter.start()
            seconds, cpu, losses = timed_batches(engine, batches[warmup:], dist.barrier)
            load = meter.stop(dist.all_gather_object)
            row = {"micro_batches": m, "step_s": seconds, "cpu_s": cpu, "losses": losses,
                   "stage_params": stage_params(engine),
                   "other_load": load}
            rows = [None] * world
            dist.all_gather_object(rows, row)
            results.append({"micro_batches": m, "ranks": rows})
            del engine, net
        if rank == 0:
            Path(out_file).write_text(json.dumps({"deepspeed": deepspeed.__version__, "torch": torch.__version__,
                                                  "results": results}))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="DeepSpeed's PipelineEngine (1F1B) on this file's GPT")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS",
                    help="before timing each m, wait up to this long for the machine to be <20%% busy")
    ap.add_argument("--config-json", default="{}", help="ModelConfig fields, as JSON")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    import torch.multiprocessing as mp

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    cfg = ModelConfig(**json.loads(args.config_json))
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(deepspeed_rank, args=(args.stages, _free_port(), cfg, args.micro_batches, args.warmup,
                                       args.steps, args.wait_idle, out), nprocs=args.stages, join=True)
        data = json.loads(Path(out).read_text())
    data["config"] = asdict(cfg)
    for r in data["results"]:
        r["median_step_s"] = statistics.median(max(col) for col in zip(*(x["step_s"] for x in r["ranks"])))
        r["other_load"] = r["ranks"][0]["other_load"]
        r["median_cpu_s"] = max(statistics.median(x["cpu_s"]) for x in r["ranks"])
    Path(args.out).write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
