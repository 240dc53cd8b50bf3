"""ZeRO-Infinity in one process: host memory per parameter with everything on NVMe.

    PYTHONPATH=. .venv/bin/python benchmarks/infinity.py --params 0.1e9 --steps 3

Builds the reference GPT (`meshspeed.models.gpt.GPT`) of about `--params` parameters
under `meshspeed.zero.Init` in bf16, ZeRO stage 3 with `offload_optimizer` and
`offload_param` both on nvme (a temporary directory under `--nvme-path`), and trains
`--steps` steps on one fixed batch (world 1, no launcher). Reports, as one JSON line
(and a table on stderr):

- peak RSS: VmHWM from /proc/self/status at the end, and the largest of RSS samples
  taken every `--sample-ms` by a thread during the run, split into phases (build,
  initialize, each step's forward+backward and optimizer step);
- `engine.memory_breakdown()` (categories and tiers) after the last step;
- bytes of the swap files on disk (walked, not asked of the strategy);
- loss and time per step.

Bytes per parameter = peak RSS / parameters, with the RSS of the interpreter and torch
before the build subtracted (`rss_start`). The issue-18 target is a peak that depends
on the config's buffer bounds and one unit's size, not on the model's size: compare two
sizes, (peak_b - peak_a) / (params_b - params_a) is the marginal host bytes per parameter.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class RssSampler:
    """A thread sampling RSS; `phase(name)` starts attributing samples to `name`."""

    def __init__(self, period_s: float):
        self.period_s = period_s
        self.peaks: dict[str, int] = {}
        self._phase = "start"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def phase(self, name: str) -> None:
        self._note()
        self._phase = name
        self._note()

    def _note(self) -> None:
        rss = rss_bytes()
        self.peaks[self._phase] = max(self.peaks.get(self._phase, 0), rss)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._note()

    @property
    def peak(self) -> int:
        return max(self.peaks.values())


def gpt_config(params: float, vocab: int, seq: int, d_model: int | None = None):
    """A GPT of about `params` parameters: width by size (or `d_model`), depth to fill the rest."""
    from meshspeed.models.gpt import GPTConfig

    d = d_model or (512 if params <= 0.12e9 else 768 if params <= 0.4e9 else 1024 if params <= 1e9 else 2048)
    per_block = 12 * d * d  # attention 4 d^2 + SwiGLU 3 * d * (8/3 d)
    n_layer = max(1, round((params - 2 * vocab * d) / per_block))
    return GPTConfig(vocab_size=vocab, max_seq_len=seq, n_layer=n_layer, n_head=d // 64, d_model=d)


def ds_config(args, nvme: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**6,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": args.sub_group_size,
            "stage3_prefetch_bucket_size": args.prefetch,
            "stage3_max_live_parameters": args.max_live,
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme,
                                  "buffer_count": args.buffer_count},
            "offload_param": {"device": "nvme", "nvme_path": nvme,
                              "buffer_count": args.param_buffer_count,
                              "buffer_size": args.param_buffer_size},
        },
    }


def swap_bytes(root: str) -> int:
    total = 0
    for d, _, files in os.walk(root):
        for f in files:
            total += os.path.getsize(os.path.join(d, f))
    return total


def run(args) -> dict:
    import meshspeed
    from meshspeed.models.gpt import GPT
    from meshspeed.offload import close

    torch.set_num_threads(args.threads)
    nvme = tempfile.mkdtemp(prefix="infinity-", dir=args.nvme_path)
    cfg = gpt_config(args.params, args.vocab, args.seq, args.d_model)
    gc.collect()
    rss_start = rss_bytes()
    out: dict = {"config": vars(cfg).copy(), "rss_start": rss_start}
    with RssSampler(args.sample_ms / 1000) as sampler:
        sampler.phase("build")
        torch.manual_seed(0)
        with meshspeed.zero.Init(dtype=torch.bfloat16):
            model = GPT(cfg)
        n = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
        out["params"] = n
        sampler.phase("initialize")
        engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config(args, nvme))
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, cfg.vocab_size, (args.micro, args.seq + 1), generator=g)
        x, y = tokens[:, :-1], tokens[:, 1:]
        losses, times = [], []
        for i in range(args.steps):
            t = time.perf_counter()
            sampler.phase(f"step{i}.fwd_bwd")
            loss = engine(x, y)
            engine.backward(loss)
            sampler.phase(f"step{i}.optimizer")
            engine.step()
            times.append(time.perf_counter() - t)
            losses.append(float(loss.detach()))
            print(f"step {i}: loss {losses[-1]:.4f} {times[-1]:.1f} s rss {rss_bytes() / 2**30:.2f} GiB",
                  file=sys.stderr, flush=True)
        sampler.phase("after")
        mem = engine.memory_breakdown()
        out["swap_bytes"] = swap_bytes(nvme)
        close(engine)
    out.update(losses=losses, step_s=times, hwm=hwm_bytes(), sampled_peak=sampler.peak,
               phase_peaks=sampler.peaks, memory_breakdown=mem)
    out["host_bytes_per_param"] = (out["hwm"] - rss_start) / n
    os.rmdir(nvme) if os.path.isdir(nvme) and not os.listdir(nvme) else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=0.1e9)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--nvme-path", default=tempfile.gettempdir())
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--d-model", type=int, default=None, help="width (default: by --params)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--sub-group-size", type=int, default=50_000_000)
    ap.add_argument("--buffer-count", type=int, default=4)
    ap.add_argument("--param-buffer-count", type=int, default=5)
    ap.add_argument("--param-buffer-size", type=int, default=100_000_000)
    ap.add_argument("--prefetch", type=int, default=50_000_000)
    ap.add_argument("--max-live", type=int, default=1_000_000_000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sample-ms", type=float, default=20)
    args = ap.parse_args()
    out = run(args)
    gib = 2**30
    print(f"params {out['params'] / 1e6:.1f}M  hwm {out['hwm'] / gib:.2f} GiB  sampled {out['sampled_peak'] / gib:.2f} GiB"
          f"  start {out['rss_start'] / gib:.2f} GiB  host B/param {out['host_bytes_per_param']:.1f}"
          f"  swap {out['swap_bytes'] / gib:.2f} GiB", file=sys.stderr)
    for k, v in out["phase_peaks"].items():
        print(f"  {k:18s} {v / gib:.2f} GiB", file=sys.stderr)
    mem = out["memory_breakdown"]
    print("  breakdown " + ", ".join(f"{k} {v / gib:.2f}" for k, v in mem.items() if isinstance(v, int)),
          file=sys.stderr)
    print("  tiers " + ", ".join(f"{k} {v / gib:.2f}" for k, v in mem["tiers"].items()), file=sys.stderr)
    print(json.dumps(out, default=str))


if __name__ == "__main__":
    main()
