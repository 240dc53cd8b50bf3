"""`meshspeed demo`: train a byte-level GPT on the Python standard library's own source.

The corpus is on every machine that has Python, so the demo needs no download. By default
it runs 2 CPU processes (launched through torchrun) with ZeRO stage 2; the loss should
fall well below the unigram entropy of the bytes (what a model that ignores context can
reach) within a couple of minutes, and the summary shows the bytes of model state each
rank holds, and how they split between device, host and NVMe (`--offload`).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import socket
import sys
import tempfile
import time

import torch
from torch.distributed import run as torchrun

import meshspeed
from meshspeed import comm
from meshspeed.data import ByteWindows, RepeatingLoader, stdlib_corpus, unigram_entropy
from meshspeed.models.gpt import GPT, GPTConfig, param_count
from meshspeed.offload import close
from meshspeed.process.progress import progress

DEMO_MODEL = {"vocab_size": 256, "max_seq_len": 128, "n_layer": 4, "n_head": 4, "d_model": 128}
OFFLOAD_DEVICES = ("none", "cpu", "nvme")  # --offload: zero_optimization.offload_* "device"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=2, help="processes (ranks) to run (default 2)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    parser.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3], help="ZeRO stage")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--bf16", action="store_true", help="train in bfloat16 with fp32 masters")
    parser.add_argument("--corpus-bytes", type=int, default=4_000_000)
    parser.add_argument("--print-every", type=int, default=25, help="steps_per_print")
    parser.add_argument("--offload", default="none", choices=OFFLOAD_DEVICES,
                        help="offload_optimizer device (and offload_param at stage 3); "
                             "needs --stage 1, 2 or 3 (default none)")
    parser.add_argument("--nvme-path", default=None, metavar="DIR",
                        help="where --offload nvme puts its swap files (default: a temporary "
                             "directory, removed after the run)")
    parser.add_argument("--layers", type=int, default=DEMO_MODEL["n_layer"],
                        help=f"transformer blocks (default {DEMO_MODEL['n_layer']}; "
                             "fewer for a quick run)")
    parser.add_argument("--d-model", type=int, default=DEMO_MODEL["d_model"],
                        help=f"residual width (default {DEMO_MODEL['d_model']})")
    parser.add_argument("--heads", type=int, default=DEMO_MODEL["n_head"],
                        help=f"attention heads, dividing --d-model (default {DEMO_MODEL['n_head']})")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel degree: each layer split over this many ranks, the "
                             "rest data parallel (e.g. --nproc 4 --tp 2: tp 2 x dp 2; default 1)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


_ARGS_ENV = "MESHSPEED_DEMO_ARGS"


def main(args: argparse.Namespace) -> int:
    if args.worker or "TORCHELASTIC_RUN_ID" in os.environ:  # a rank started by torchrun
        if _ARGS_ENV in os.environ:
            args = argparse.Namespace(**json.loads(os.environ[_ARGS_ENV]))
        else:
            problem = _check(args)
            if problem:  # every rank refuses alike (launched by hand, not by this command)
                print(f"meshspeed demo: {problem}", file=sys.stderr)
                return 2
        return train(args)
    problem = _check(args)
    if problem:
        print(f"meshspeed demo: {problem}", file=sys.stderr)
        return 2
    if args.offload == "nvme" and args.nvme_path is None:
        # one directory for the run (each rank swaps into its own subdirectory of it)
        with tempfile.TemporaryDirectory(prefix="meshspeed-demo-nvme-") as path:
            args.nvme_path = path
            return _launch(args)
    return _launch(args)


def _check(args) -> str | None:
    """One line saying what is wrong with the options, or None."""
    if args.offload != "none" and args.stage == 0:
        return (f"--offload {args.offload} needs --stage 1, 2 or 3 (stage 0 steps the whole "
                "optimizer on every rank, so there is no per-rank share to offload); "
                "pass --stage 1, 2 or 3, or --offload none")
    if args.nvme_path is not None and args.offload != "nvme":
        return f"--nvme-path is used by --offload nvme only (got --offload {args.offload})"
    if args.nvme_path is not None and not os.path.isdir(args.nvme_path):
        return f"--nvme-path {args.nvme_path!r} is not an existing directory"
    if min(args.layers, args.d_model, args.heads, args.steps, args.micro_batch, args.seq_len,
           args.print_every, args.nproc, args.tp) < 1:
        return ("--layers, --d-model, --heads, --steps, --micro-batch, --seq-len, "
                "--print-every, --nproc and --tp must be at least 1")
    if args.nproc % args.tp or args.heads % args.tp:
        return (f"--tp {args.tp} must divide --nproc ({args.nproc}) and --heads ({args.heads}); "
                f"e.g. --nproc {2 * args.tp} --tp {args.tp}")
    try:
        _model_config(args)
    except ValueError as err:
        return f"model options (--layers/--d-model/--heads/--seq-len): {err}"
    return None


def _model_config(args):
    return GPTConfig(**{**DEMO_MODEL, "max_seq_len": args.seq_len, "n_layer": args.layers,
                        "d_model": args.d_model, "n_head": args.heads})


def _launch(args: argparse.Namespace) -> int:
    argv = ["--nproc-per-node", str(args.nproc), "--master-port", str(_free_port()),
            "-m", "meshspeed.demo", "--worker"]
    # a rendezvous left in the environment (a job step, a test process) is not this one
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE"):
        os.environ.pop(key, None)
    # the options travel in the environment: torchrun's parser would otherwise claim
    # abbreviations of its own flags (--nproc) among the script's arguments
    os.environ[_ARGS_ENV] = json.dumps(vars(args))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        torchrun.main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    except Exception as exc:  # noqa: BLE001 - torchrun raises ChildFailedError (every rank's error)
        print(f"meshspeed demo: a rank failed: {exc}", file=sys.stderr)
        return 1
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(args) -> dict:
    warmup = max(1, args.steps // 20)
    cfg = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95],
                                                  "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupCosineLR", "params": {
            "total_num_steps": args.steps, "warmup_num_steps": warmup, "warmup_type": "linear"}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": args.stage},
        "tensor_parallel": {"autotp_size": args.tp},
        # the demo prints its own progress line (with tokens/s) every --print-every steps
        "steps_per_print": args.steps + 1,
    }
    if args.bf16:
        cfg["bf16"] = {"enabled": True}
    if args.offload != "none":
        device = {"device": args.offload}
        if args.offload == "nvme":
            device["nvme_path"] = args.nvme_path
        cfg["zero_optimization"]["offload_optimizer"] = dict(device)
        if args.stage == 3:  # the parameters' shards go to the same place
            cfg["zero_optimization"]["offload_param"] = dict(device)
    return cfg


def train(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    meshspeed.init_distributed()
    rank = comm.get_rank()
    # no logging set-up: the demo shows what a user's own script shows (meshspeed's banner
    # and lines on rank 0, Note [meshspeed's own handler] in meshspeed/process/speak.py)
    log = logging.getLogger("meshspeed")

    data = stdlib_corpus(args.corpus_bytes)
    entropy = unigram_entropy(data)
    train_set, _ = ByteWindows(data, args.seq_len).split(0.98)
    own_swap = None
    if args.offload == "nvme" and args.nvme_path is None:  # ranks started by hand, not by main()
        own_swap = tempfile.TemporaryDirectory(prefix="meshspeed-demo-nvme-")
        args = argparse.Namespace(**{**vars(args), "nvme_path": own_swap.name})
    torch.manual_seed(0)
    model = GPT(_model_config(args))
    params = param_count(model)  # the whole model: stage 3 and tp leave each rank a part
    engine, _, loader, _ = meshspeed.initialize(model=model, model_parameters=model.parameters(),
                                                training_data=train_set, config=_config(args))
    if rank == 0:
        log.info("demo: %d bytes of Python stdlib source, unigram entropy %.3f nats/byte; "
                 "%.2fM parameters, %d ranks (tp %d), ZeRO stage %d, offload %s", len(data), entropy,
                 params / 1e6, comm.get_world_size(), args.tp, args.stage, args.offload)
    batches = iter(RepeatingLoader(loader))
    tokens_per_step = args.micro_batch * args.seq_len * comm.get_world_size() // args.tp
    # a bar on a terminal, a few plain lines in a log (Note [progress only for long work])
    bar = progress(args.steps, "training", unit="step")
    start = time.perf_counter()
    loss_avg = None
    for step in range(1, args.steps + 1):
        x, y = next(batches)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        value = loss.detach().float()
        comm.all_reduce(value, op="avg")
        loss_avg = value.item() if loss_avg is None else 0.9 * loss_avg + 0.1 * value.item()
        bar.update(1)
        if step % args.print_every == 0 and rank == 0:
            rate = tokens_per_step * step / (time.perf_counter() - start)
            bar.write(f"step {step:4d}  loss {value.item():.4f}  lr {engine.get_lr()[0]:.2e}  "
                      f"{rate:,.0f} tokens/s")
    bar.close()
    elapsed = time.perf_counter() - start
    memory = engine.memory_breakdown()
    sample = _sample(engine, b"def ")
    if rank == 0:
        print("\n--- sample (prompt 'def ') ---")
        print(sample)
        print("--- summary ---")
        print(f"final loss (smoothed)  {loss_avg:.4f} nats/byte (unigram entropy {entropy:.3f}; "
              f"{'below' if loss_avg < entropy else 'NOT below'} it)")
        print(f"throughput             {tokens_per_step * args.steps / elapsed:,.0f} tokens/s over "
              f"{elapsed:.1f} s")
        for line in memory_lines(memory):
            print(line)
        print(f"perplexity             {math.exp(loss_avg):.2f}")
    comm.barrier()
    close(engine)  # background host steps and swap files (a no-op without offload)
    if own_swap is not None:
        own_swap.cleanup()
    return 0


def memory_lines(memory: dict) -> list[str]:
    """The summary's lines for `engine.memory_breakdown()` (rank 0's): the categories with
    bytes and their total on one line, then one line per nested split (its "tiers":
    device / host / nvme, every part shown, zeros included)."""
    flat = {k: v for k, v in memory.items() if not isinstance(v, dict)}
    total = flat.pop("total", None)
    parts = [f"{k} {_mib(v)}" for k, v in flat.items() if v]
    if total is not None:
        parts.append(f"total {_mib(total)}")
    lines = ["model state per rank   " + ", ".join(parts)]
    for key, split in memory.items():
        if isinstance(split, dict):
            label = f"{key} per rank"
            lines.append(f"{label:<22} " + ", ".join(f"{k} {_mib(v)}" for k, v in split.items()))
    return lines


def _sample(engine, prompt: bytes, length: int = 200) -> str:
    engine.eval()
    idx = torch.tensor([list(prompt)], dtype=torch.long)
    torch.manual_seed(0)  # every rank samples the same text (stage 3 gathers need all ranks)
    with torch.no_grad():
        out = engine.module.generate(idx, length, temperature=0.8, top_k=20)
    engine.train()
    return bytes(out[0].tolist()).decode("utf-8", errors="replace")


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="meshspeed demo")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
