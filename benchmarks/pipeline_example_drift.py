"""Per-step losses of the DeepSpeedExamples pipeline-parallelism example run without a
pipeline (`train.py -p 0`: the plain data-parallel path) under DeepSpeed, under meshspeed and
in one process of plain PyTorch that computes what that data-parallel run should compute.

    .venv/bin/python benchmarks/pipeline_example_drift.py [--steps 20] [--stages 0 2]
        [--dropout on off] [--image-size 64] [--frameworks meshspeed deepspeed]
        [--variants fused-adam one-buffer] [--gradient-clipping C] [--weight-decay W]
        [--json results.json] [--dump-dir D --dump-steps N]

What it found (the numbers: docs/benchmarks.md, section "DeepSpeedExamples pipeline example"):
- meshspeed departed from the reference from the second step on: it built torch's AdamW for
  "Adam" without saying weight_decay, so torch's default 0.01 applied; DeepSpeed's default is
  0 (Note [no weight_decay means 0] in meshspeed/optim/builder.py). Fixed: meshspeed now
  equals the reference bit for bit, at every ZeRO stage tried.
- DeepSpeed 0.19.8 departs from the reference from the third step on: since 0.19.3 a config
  without "gradient_clipping" clips the global gradient norm at 1.0 (its constants.py,
  GRADIENT_CLIPPING_DEFAULT; PR #8068). Here the first step's norm is 0.14, the second's 47,
  so the second update is computed from a gradient 47 times smaller than the reference's.
  With "gradient_clipping": 0 DeepSpeed follows the reference; with "gradient_clipping": 1.0
  in the config (and a clipping reference, --gradient-clipping 1.0) all three agree.
- Neither sample order, sharding, dropout masks (the RNG state matches at every step) nor
  rounding explain a departure: the two rounding-only variants of the reference stay within
  a few 1e-6 of it over the first steps.
Use --dump-dir/--dump-steps to save every run's parameters (and the gradients the optimizer
is about to use) after the first steps, for a closer look.

The workload is the example's, rebuilt here (no code of the example or of DeepSpeed): an
AlexNet-shaped network (five convolutions, adaptive average pool to 6x6, a 9216-4096-4096-10
classifier with two Dropout(0.5)) on 3-channel images, its `ds_config.json` (fp32, optimizer
`"type": "Adam"` lr 1e-3 betas (0.9, 0.999) eps 1e-8 and nothing else, train_batch_size 256,
micro batch 8; on 2 ranks gradient accumulation 16), `torch.manual_seed(1138)` before the
model is built, the data set passed as `initialize(training_data=...)` and read through
`RepeatingLoader`, and the example's loop (engine(x), CrossEntropyLoss, backward, step). The
data are synthetic, CIFAR-10-like and learnable: image i is N(0, 1) noise plus half of a fixed
random pattern of its class, generated from its index (no download), 50,000 of them. Images
are 64x64 by default, not the example's 224x224 (its resize of CIFAR's 32x32): the smallest
size at which every AlexNet pooling stage still has an output, and about 5x cheaper on a CPU.

Rows:
  reference   one process, plain torch: at optimizer step s rank r's micro-batch m is the
              slice [(16 s + m) * 8, +8) of what `DistributedSampler(rank=r, num_replicas=2,
              seed=0, shuffle=True)` yields (the sampler both engines' loaders use); each rank's
              16 micro-batch gradients of loss/16 are accumulated, the two ranks' sums
              averaged, then one `torch.optim.Adam` step, unclipped (what the config says:
              DeepSpeed's "Adam" is Adam with decoupled weight decay, no weight_decay means 0,
              and the config names no gradient_clipping).
              Dropout masks are replayed per rank: both ranks seed 1138, build the model and
              draw the loader's base seed, so both draw the same masks at the same micro-step;
              the reference restores that RNG state before each rank's micro-batches.
  meshspeed   `import meshspeed as deepspeed`, 2 ranks under torchrun, ZeRO stage s
  deepspeed   DeepSpeed in its own venv (/root/.cache/meshspeed-anchors, skipped with a
              message when it is missing), 2 ranks under torchrun, ZeRO stage s
Columns: `loss` is what train.py prints (rank 0's loss on the first micro-batch of the step,
before that step's update), `d` its difference from the reference's same micro-batch.

Every run also records the global sample indices of every micro-batch and the CPU RNG state
before each step's first forward; the script checks both against the reference and says so.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parent.parent
ANCHOR_PY = Path("/root/.cache/meshspeed-anchors/bin/python")
SEED = 1138  # train.py's --seed default
WORLD = 2
TRAIN_BATCH = 256
MICRO = 8
GAS = TRAIN_BATCH // (MICRO * WORLD)
N_SAMPLES = 50_000  # CIFAR-10's training set size
CLASSES = 10


# -- the workload -------------------------------------------------------------------------------
class AlexNetShaped(nn.Module):
    """The layer shapes of the AlexNet the example trains (modules created in that order, so
    torch's default initialisation draws the same numbers for the same seed)."""

    def __init__(self, num_classes: int = CLASSES, dropout: bool = True):
        super().__init__()
        drop = (lambda: nn.Dropout(0.5)) if dropout else nn.Identity
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, 11, stride=4, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
            nn.Conv2d(64, 192, 5, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
            nn.Conv2d(192, 384, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = nn.Sequential(
            drop(), nn.Linear(256 * 6 * 6, 4096), nn.ReLU(inplace=True),
            drop(), nn.Linear(4096, 4096), nn.ReLU(inplace=True),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


class SyntheticImages(torch.utils.data.Dataset):
    """CIFAR-10-like samples made from their index: (image, label, index). The example reads
    only batch[0] and batch[1]; the index lets the driver check which samples each rank saw."""

    def __init__(self, size: int, n: int = N_SAMPLES):
        self.size, self.n = size, n
        g = torch.Generator().manual_seed(7)
        self.patterns = torch.randn(CLASSES, 3, size, size, generator=g)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(1_000_003 * 11 + int(i))
        label = int(torch.randint(CLASSES, (), generator=g))
        image = torch.randn(3, self.size, self.size, generator=g) + 0.5 * self.patterns[label]
        return image, label, int(i)


def ds_config(stage: int, weight_decay: float | None, clipping: float | None) -> dict:
    params = {"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-8}
    if weight_decay is not None:
        params["weight_decay"] = weight_decay
    cfg = {"train_batch_size": TRAIN_BATCH, "train_micro_batch_size_per_gpu": MICRO,
           "optimizer": {"type": "Adam", "params": params},
           "zero_optimization": {"stage": stage},
           "steps_per_print": 10, "wall_clock_breakdown": False}
    if clipping is not None:
        cfg["gradient_clipping"] = clipping
    return cfg


def dump_params(module: nn.Module, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.detach().clone() for k, v in module.state_dict().items()}, path)


def rng_digest() -> str:
    return hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest()[:12]


# -- one rank of the example (run under torchrun, by either framework's python) -----------------
def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    if args.framework == "meshspeed":
        import meshspeed as deepspeed
    else:
        import deepspeed
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    ds_args = parser.parse_args(["--deepspeed", "--deepspeed_config", args.config])
    deepspeed.init_distributed(dist_backend="gloo")
    ds_args.local_rank = int(os.environ["LOCAL_RANK"])
    import torch.distributed as dist

    rank = dist.get_rank()
    torch.manual_seed(SEED)
    net = AlexNetShaped(dropout=args.dropout == "on")
    trainset = SyntheticImages(args.image_size)
    rng_after_model = rng_digest()
    engine, optimizer, loader, _ = deepspeed.initialize(
        args=ds_args, model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
        training_data=trainset)
    rng_after_init = rng_digest()
    data_iter = iter(deepspeed.utils.RepeatingLoader(loader))
    gas = engine.gradient_accumulation_steps()
    criterion = nn.CrossEntropyLoss()
    record = {"first_micro_loss": [], "step_loss_sum": [], "indices": [], "rng": [],
              "rng_after_model": rng_after_model, "rng_after_init": rng_after_init,
              "optimizer": type(optimizer).__name__,
              "param_groups": [{k: v for k, v in g.items() if k != "params" and isinstance(v, float | int | bool)}
                               for g in optimizer.param_groups]}
    start = time.perf_counter()
    step_sum = 0.0
    for micro_step in range(args.steps * gas):
        batch = next(data_iter)
        if micro_step % gas == 0:
            record["rng"].append(rng_digest())
        record["indices"].append([int(i) for i in batch[2]])
        outputs = engine(batch[0].to(engine.device))
        loss = criterion(outputs, batch[1].to(engine.device))
        engine.backward(loss)
        step = micro_step // gas + 1
        if args.dump_dir and step <= args.dump_steps and rank == 0 and micro_step % gas == gas - 1:
            # the gradients the optimizer is about to use (DeepSpeed stage 0 has averaged them
            # in backward; meshspeed's stage 0 buckets hold the sum until step() divides)
            torch.save({n: p.grad.detach().clone() for n, p in engine.module.named_parameters()
                        if p.grad is not None},
                       Path(args.dump_dir) / f"{args.framework}-z{args.stage}-step{step}-grad.pt")
        engine.step()
        step_sum += float(loss.detach())
        if micro_step % gas == 0:
            record["first_micro_loss"].append(float(loss.detach()))
        if micro_step % gas == gas - 1:
            record["step_loss_sum"].append(step_sum)
            step_sum = 0.0
            if args.dump_dir and step <= args.dump_steps and rank == 0:
                dump_params(engine.module, Path(args.dump_dir) / f"{args.framework}-z{args.stage}-step{step}.pt")
    record["seconds"] = time.perf_counter() - start
    Path(args.out).with_suffix(f".rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()


# -- the one-process reference ----------------------------------------------------------------
REFERENCE_VARIANTS = {
    "exact": "torch.optim.Adam (for-loop), each rank's 16 micro-batches accumulated, ranks' sums averaged",
    "fused-adam": "the same with torch.optim.Adam(fused=True): other rounding in the update only",
    "one-buffer": "the same with all 32 micro-batches (loss / 32) accumulated into one buffer, the ranks' "
                  "micro-batches interleaved: other rounding in the gradient only",
}


def reference(steps: int, image_size: int, dropout: bool, weight_decay: float = 0.0,
              variant: str = "exact", dump_dir: str | None = None, dump_steps: int = 0,
              clipping: float = 0.0) -> dict:
    """What 2-rank data parallelism with accumulation 16 computes, in one process. The
    variants other than "exact" compute the same numbers in another order: their distance
    from "exact" is what rounding alone does to this run (REFERENCE_VARIANTS)."""
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    net = AlexNetShaped(dropout=dropout)
    data = SyntheticImages(image_size)
    samplers = [DistributedSampler(data, num_replicas=WORLD, rank=r, shuffle=True, seed=0)
                for r in range(WORLD)]
    order = [list(s) for s in samplers]
    # the engine's loader draws its base seed from the global RNG when it is first iterated,
    # before the first forward: the same draw here keeps the dropout stream aligned
    iter(DataLoader(data, batch_size=MICRO, sampler=samplers[0]))
    params = [p for p in net.parameters()]
    fused = variant == "fused-adam"
    if weight_decay:
        opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay,
                                fused=fused)
    else:
        opt = torch.optim.Adam(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, fused=fused)
    criterion = nn.CrossEntropyLoss()
    record = {"first_micro_loss": [], "step_loss_sum": [], "indices_by_rank": [[] for _ in range(WORLD)],
              "rng": []}
    start = time.perf_counter()
    for step in range(steps):
        step_rng = torch.get_rng_state()
        record["rng"].append(rng_digest())
        rank_grads, step_sum = [], 0.0

        def micro(r: int, m: int, scale: float, step: int = step) -> None:
            nonlocal step_sum
            idx = order[r][(step * GAS + m) * MICRO:(step * GAS + m + 1) * MICRO]
            x, y, _ = zip(*(data[i] for i in idx), strict=True)
            loss = criterion(net(torch.stack(x)), torch.tensor(y))
            (loss * scale).backward()
            step_sum += float(loss.detach())
            record["indices_by_rank"][r].append(idx)
            if r == 0 and m == 0:
                record["first_micro_loss"].append(float(loss.detach()))

        if variant == "one-buffer":
            for p in params:
                p.grad = None
            rank_rng = [step_rng] * WORLD
            for m in range(GAS):
                for r in range(WORLD):
                    torch.set_rng_state(rank_rng[r])
                    micro(r, m, 1.0 / (GAS * WORLD))
                    rank_rng[r] = torch.get_rng_state()
        else:
            for r in range(WORLD):
                torch.set_rng_state(step_rng)  # every rank continues the same dropout stream
                for p in params:
                    p.grad = None
                for m in range(GAS):
                    micro(r, m, 1.0 / GAS)
                rank_grads.append([p.grad for p in params])
            for p, *gs in zip(params, *rank_grads, strict=True):
                p.grad = sum(gs[1:], gs[0].clone()).div_(WORLD)  # all-reduce(sum) / world
        if clipping > 0:
            torch.nn.utils.clip_grad_norm_(params, clipping)
        if dump_dir and step < dump_steps:
            Path(dump_dir).mkdir(parents=True, exist_ok=True)
            torch.save({n: p.grad.detach().clone() for n, p in net.named_parameters()},
                       Path(dump_dir) / f"reference-{variant}-step{step + 1}-grad.pt")
        opt.step()
        record["step_loss_sum"].append(step_sum)
        if dump_dir and step < dump_steps:
            dump_params(net, Path(dump_dir) / f"reference-{variant}-step{step + 1}.pt")
    record["seconds"] = time.perf_counter() - start
    return record


# -- the driver ---------------------------------------------------------------------------------
def launch(python: Path, framework: str, stage: int, args, tmp: Path, weight_decay) -> dict | None:
    tag = f"{framework}_{stage}_{args.dropout_now}_{weight_decay}_{args.gradient_clipping}"
    config = tmp / f"ds_config_{tag}.json"
    config.write_text(json.dumps(ds_config(stage, weight_decay, args.gradient_clipping)))
    out = tmp / tag
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu"}
    if framework == "deepspeed":  # this checkout must not shadow anything in DeepSpeed's venv
        env["PYTHONPATH"] = str(Path(__file__).resolve().parent)
    cmd = [str(python), "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
           "--master-port", str(29500 + (os.getpid() % 1000)), str(Path(__file__).resolve()),
           "--role", "worker", "--framework", framework, "--config", str(config), "--out", str(out),
           "--steps", str(args.steps), "--image-size", str(args.image_size), "--dropout", args.dropout_now,
           "--stage", str(stage), "--dump-steps", str(args.dump_steps)] + (
               ["--dump-dir", args.dump_dir] if args.dump_dir else [])
    print(f"  running {framework} stage {stage} (dropout {args.dropout_now}"
          f"{'' if weight_decay is None else f', weight_decay {weight_decay}'}"
          f"{'' if args.gradient_clipping is None else f', gradient_clipping {args.gradient_clipping}'}) ...",
          flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        print(f"  {framework} stage {stage} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        return None
    ranks = [json.loads(out.with_suffix(f".rank{r}.json").read_text()) for r in range(WORLD)]
    rec = ranks[0]
    rec["step_loss_sum"] = [sum(v) for v in zip(*(r["step_loss_sum"] for r in ranks), strict=True)]
    rec["indices_by_rank"] = [r["indices"] for r in ranks]
    rec["rng_by_rank"] = [r["rng"] for r in ranks]
    return rec


def report(rows: dict[str, dict], ref: dict, steps: int, title: str) -> None:
    print(f"\n{title}")
    names = list(rows)
    head = f"{'step':>4} {'reference':>10}" + "".join(f" | {n:>18} {'d':>9}" for n in names)
    print(head)
    print("-" * len(head))
    for s in range(steps):
        r = ref["first_micro_loss"][s]
        line = f"{s + 1:>4} {r:>10.6f}"
        for n in names:
            v = rows[n]["first_micro_loss"][s]
            line += f" | {v:>18.6f} {v - r:>+9.2e}"
        print(line)
    mean = lambda rec, s: rec["step_loss_sum"][s] / (GAS * WORLD)
    print(f"mean loss over the step's 256 samples, step {steps}: reference {mean(ref, steps - 1):.6f}"
          + "".join(f", {n} {mean(rows[n], steps - 1):.6f}" for n in names))
    for n, rec in rows.items():
        same_samples = rec["indices_by_rank"] == ref["indices_by_rank"]
        notes = [f"every rank's samples {'identical to' if same_samples else 'DIFFER from'} the reference's"]
        same_rng = rec["rng"] == ref["rng"] and all(x == rec["rng"] for x in rec.get("rng_by_rank", []))
        notes.append("dropout RNG state at every step identical to the reference's"
                     if same_rng else "dropout RNG state DIFFERS from the reference's")
        if "optimizer" in rec:
            notes.append(f"optimizer {rec['optimizer']} {rec['param_groups'][0]}")
        notes.append(f"{rec['seconds']:.0f} s")
        print(f"  {n}: " + "; ".join(notes))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=["driver", "worker"], default="driver")
    ap.add_argument("--framework", choices=["meshspeed", "deepspeed"])
    ap.add_argument("--config")
    ap.add_argument("--out")
    ap.add_argument("--dropout", nargs="+", default=["on"], choices=["on", "off"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--image-size", type=int, default=64)
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 2])
    ap.add_argument("--stage", type=int, default=0, help=argparse.SUPPRESS)  # the worker's
    ap.add_argument("--variants", nargs="*", default=["fused-adam", "one-buffer"],
                    choices=[v for v in REFERENCE_VARIANTS if v != "exact"],
                    help="reference variants shown as rows too: the rounding-only floor")
    ap.add_argument("--dump-dir", help="save every run's parameters after the first --dump-steps steps here")
    ap.add_argument("--dump-steps", type=int, default=0)
    ap.add_argument("--frameworks", nargs="*", default=["meshspeed", "deepspeed"],
                    choices=["meshspeed", "deepspeed"])
    ap.add_argument("--weight-decay", type=float, default=None,
                    help="add this weight_decay to the config's optimizer params (default: none, as the example)")
    ap.add_argument("--gradient-clipping", type=float, default=None,
                    help="add this gradient_clipping to the config, and clip the reference's gradients to "
                         "it (default: no key, as the example: the reference does not clip, meshspeed does "
                         "not clip, DeepSpeed 0.19.8 clips at 1.0)")
    ap.add_argument("--json", help="also write every run's record here")
    args = ap.parse_args()
    if args.role == "worker":
        args.dropout = args.dropout[0]
        worker(args)
        return
    with_ds = "deepspeed" in args.frameworks and ANCHOR_PY.exists()
    if "deepspeed" in args.frameworks and not with_ds:
        print(f"DeepSpeed rows skipped: {ANCHOR_PY} is missing (the anchor venv with DeepSpeed 0.19.8)")
    tmp = Path(tempfile.mkdtemp(prefix="pipeline-drift-"))
    results = {}
    try:
        for dropout in args.dropout:
            args.dropout_now = dropout
            print(f"dropout {dropout}: reference ...", flush=True)
            clip = args.gradient_clipping or 0.0
            ref = reference(args.steps, args.image_size, dropout == "on", args.weight_decay or 0.0,
                            dump_dir=args.dump_dir, dump_steps=args.dump_steps, clipping=clip)
            rows = {}
            for variant in args.variants:
                print(f"  reference variant {variant} ...", flush=True)
                rows[f"ref {variant}"] = reference(args.steps, args.image_size, dropout == "on",
                                                   args.weight_decay or 0.0, variant, args.dump_dir,
                                                   args.dump_steps, clip)
            for stage in args.stages:
                rec = None
                if "meshspeed" in args.frameworks:
                    rec = launch(Path(sys.executable), "meshspeed", stage, args, tmp, args.weight_decay)
                if rec is not None:
                    rows[f"meshspeed z{stage}"] = rec
                if with_ds:
                    rec = launch(ANCHOR_PY, "deepspeed", stage, args, tmp, args.weight_decay)
                    if rec is not None:
                        rows[f"deepspeed z{stage}"] = rec
            wd = "none" if args.weight_decay is None else args.weight_decay
            gc = "none" if args.gradient_clipping is None else args.gradient_clipping
            report(rows, ref, args.steps, f"dropout {dropout}, optimizer params weight_decay {wd}, "
                   f"gradient_clipping {gc} (reference clips at {clip or 'nothing'}), "
                   f"{args.image_size}x{args.image_size} images; loss = rank 0's first micro-batch "
                   "of the step (what train.py prints), d = run - reference")
            for variant in args.variants:
                print(f"  ref {variant}: {REFERENCE_VARIANTS[variant]}")
            results[dropout] = {"reference": ref, **rows}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
