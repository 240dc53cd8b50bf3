"""DeepSpeedExamples' training/pipeline_parallelism/train.py, unchanged, with `-p 2` on two
CPU ranks: under meshspeed (`meshspeed run --deepspeed-compat`) and under DeepSpeed 0.19.8
(its own `deepspeed` launcher, in the anchor venv), per-step losses side by side with one
process of plain PyTorch, and the step time of each.

    .venv/bin/python benchmarks/pipeline_example.py [--steps 20] [--dropout off on]
        [--frameworks meshspeed deepspeed] [--image-size 64] [--json out.json]
        [--markdown] [--write-docs]

The script comes from the DeepSpeedExamples snapshot (MIRROR below, `git show`), written to
a temporary directory at run time and run from there as it is; nothing of it is kept in
this repository. What it needs and this machine lacks is made locally, in the same
temporary directory, first on PYTHONPATH of both frameworks' processes:
- benchmarks/pipeline_example_stub/torchvision: AlexNet's shapes, a synthetic CIFAR10 (no
  download) and simple transforms (its docstring says what each does; the images are made
  at 64x64, not resized to 224x224).
- benchmarks/pipeline_example_stub/sitecustomize.py: `torch.cuda.set_device` (the script
  calls it unconditionally; a CPU build of torch raises AttributeError there) becomes a
  no-op without CUDA; and each rank notes what `engine.train_batch()` returns (the script
  drops it) and how long the call took, written to rank<R>.json at exit.
- ds_config.json: the example's own (fp32, "type": "Adam", lr 1e-3, betas (0.9, 0.999),
  eps 1e-8, steps_per_print) with a smaller batch, train_batch_size 32 and micro batch 8
  (pp 2 x dp 1: 4 micro-batches a step; the example's 256 would be 32), and
  "gradient_clipping": 0: since 0.19.3 DeepSpeed clips at 1.0 when the key is absent,
  meshspeed does not (benchmarks/pipeline_example_drift.py's docstring).
Both frameworks get `--backend gloo`; DeepSpeed also DS_ACCELERATOR=cpu (it detects the CPU
accelerator by itself too). Its first run JIT-builds its shm comm op (about 4 minutes on
2 cores, cached in ~/.cache/torch_extensions afterwards).

The reference (one process, plain torch, the stub's model and data): the example's seeds
(torch.manual_seed(1138), then set_random_seed(1138)), the model built the same way, the
loader's base seed drawn once (both engines' loaders draw it at their first batch), the
samples in dataset order (both engines read `training_data` with
`DistributedSampler(num_replicas=1, shuffle=False)`), per micro-batch the stages' layers
in turn, each stage's layers with that stage's own RNG stream (a stage is one process:
its Dropout masks come from its rank's generator), loss / 4 accumulated, one unclipped
torch.optim.Adam step. With dropout the masks depend on where the stages are cut, so the
reference is computed for each framework's cut (recorded from `module.parts`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
STUB = HERE / "pipeline_example_stub"
MIRROR = Path("/work/.mirror/deepspeedai+DeepSpeedExamples/repo")
EXAMPLE = "training/pipeline_parallelism/train.py"
ANCHOR_PY = Path("/root/.cache/meshspeed-anchors/bin/python")
SEED = 1138  # train.py's --seed default
STAGES, MICRO, GAS = 2, 8, 4
CONFIG = {
    "train_batch_size": MICRO * GAS,
    "train_micro_batch_size_per_gpu": MICRO,
    "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-8}},
    "gradient_clipping": 0,
    "steps_per_print": 1,
    "wall_clock_breakdown": False,
}
NAMES = {"meshspeed": "meshspeed", "deepspeed": "DeepSpeed 0.19.8"}


# -- the runs ---------------------------------------------------------------------------------
def prepare(tmp: Path) -> None:
    """The example script, the stub and the config, in `tmp`."""
    script = subprocess.run(["git", "-C", str(MIRROR), "show", f"HEAD:{EXAMPLE}"], capture_output=True,
                            text=True, check=True).stdout
    (tmp / "train.py").write_text(script)
    shutil.copytree(STUB, tmp / "stub", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp / "ds_config.json").write_text(json.dumps(CONFIG, indent=1))


def launch(framework: str, tmp: Path, steps: int, image_size: int, dropout: str, port: int,
           tag: str = "") -> dict:
    """One run of train.py on 2 ranks: every rank's record, the output, the wall time and
    the share of the machine's CPU that other processes used meanwhile."""
    record = tmp / f"record-{framework}-{dropout}-{tag}"
    record.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PIPE_EXAMPLE_RECORD": str(record),
           "PIPE_EXAMPLE_IMAGE_SIZE": str(image_size), "PIPE_EXAMPLE_DROPOUT": dropout}
    script_args = ["train.py", "--deepspeed_config=ds_config.json", "-p", str(STAGES), f"--steps={steps}",
                   "--backend", "gloo"]
    if framework == "meshspeed":
        env["PYTHONPATH"] = os.pathsep.join([str(tmp / "stub"), str(REPO), str(HERE)])
        cmd = [sys.executable, "-m", "meshspeed.cli", "run", "--deepspeed-compat", "--num_gpus", "2",
               "--master_port", str(port), *script_args]
    else:  # nothing of this checkout but the stub's imports (benchmarks/) in DeepSpeed's processes
        env["PYTHONPATH"] = os.pathsep.join([str(tmp / "stub"), str(HERE)])
        env["PATH"] = os.pathsep.join([str(ANCHOR_PY.parent), env.get("PATH", "")])
        env["DS_ACCELERATOR"] = "cpu"
        cmd = [str(ANCHOR_PY.parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(port), *script_args]
    print(f"  {framework}, dropout {dropout}: {' '.join(cmd[2:] if framework == 'meshspeed' else cmd)}",
          flush=True)
    busy0, ours0, start = _busy_cpu_s(), _children_cpu_s(), time.perf_counter()
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, check=False, timeout=1800)
    wall = time.perf_counter() - start
    other = max(0.0, (_busy_cpu_s() - busy0) - (_children_cpu_s() - ours0)) / (wall * (os.cpu_count() or 1))
    output = proc.stdout + proc.stderr
    (record / "output.log").write_text(output)
    ranks = [json.loads(p.read_text()) for p in sorted(record.glob("rank*.json"))]
    ok = proc.returncode == 0 and len(ranks) == STAGES and all(len(r["losses"]) == steps for r in ranks)
    if not ok:
        print(f"  {framework} failed (exit {proc.returncode}):\n{output[-4000:]}")
    return {"ok": ok, "returncode": proc.returncode, "wall_s": wall, "ranks": ranks, "output": output,
            "other_load": other, "error": "" if ok else _error_line(output)}


def _busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy (every process), from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    """CPU seconds of this driver's finished child processes (the runs)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def failures_of(failures: dict[str, str], framework: str, dropout: str) -> list[str]:
    """[framework] if it already failed in this setting (no point in repeating it)."""
    return [framework] if f"{NAMES[framework]}, dropout {dropout}" in failures else []


def _error_line(output: str) -> str:
    lines = [l for l in output.splitlines() if re.search(r"(Error|Exception)\b", l)]
    return lines[-1].strip() if lines else output.strip().splitlines()[-1] if output.strip() else "no output"


def logged_losses(output: str) -> list[float]:
    """DeepSpeed's own per-step log line, `steps: N loss: X iter time (s): ...`."""
    return [float(v) for v in re.findall(r"steps: \d+ loss: (\S+) iter time", output)]


# -- the reference ----------------------------------------------------------------------------
def reference(steps: int, image_size: int, dropout: str, cut: list[int]) -> list[float]:
    """What the pipelined run computes, in one process (module docstring); the stage
    boundaries `cut` decide which rank's RNG stream each Dropout draws from."""
    from torch.utils.data.distributed import DistributedSampler

    os.environ.update(PIPE_EXAMPLE_IMAGE_SIZE=str(image_size), PIPE_EXAMPLE_DROPOUT=dropout)
    if str(STUB) not in sys.path:
        sys.path.insert(0, str(STUB))
    import torchvision  # the stub
    from torchvision import transforms

    torch.set_num_threads(1)  # as each rank
    torch.manual_seed(SEED)
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)
    net = torchvision.models.AlexNet(num_classes=10)
    transform = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(),
                                    transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])])
    data = torchvision.datasets.CIFAR10(root=None, train=True, download=True, transform=transform)
    layers = [*net.features, net.avgpool, lambda x: torch.flatten(x, 1), *net.classifier]
    if cut[0] != 0 or cut[-1] != len(layers):
        raise ValueError(f"stage boundaries {cut} do not span the {len(layers)} layers")
    torch.empty((), dtype=torch.int64).random_()  # the loader's base seed, at its first batch
    streams = [torch.get_rng_state()] * (len(cut) - 1)  # every rank's generator is in this state
    order = list(DistributedSampler(data, num_replicas=1, rank=0, shuffle=False))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
    criterion = nn.CrossEntropyLoss()
    losses = []
    for step in range(steps):
        total = 0.0
        for m in range(GAS):
            idx = order[(step * GAS + m) * MICRO:(step * GAS + m + 1) * MICRO]
            x = torch.stack([data[i][0] for i in idx])
            y = torch.tensor([data[i][1] for i in idx])
            for s, (lo, hi) in enumerate(itertools.pairwise(cut)):
                torch.set_rng_state(streams[s])
                for layer in layers[lo:hi]:
                    x = layer(x)
                streams[s] = torch.get_rng_state()
            loss = criterion(x, y)
            (loss / GAS).backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / GAS)
    return losses


# -- the report -------------------------------------------------------------------------------
def summary(repeats: list[dict]) -> dict:
    """One framework's runs of one setting: the losses (every repeat must give the same),
    and per repeat rank 0's median train_batch time over steps 2 on; the fastest repeat is
    the one shown (the others were slowed by whatever else the machine ran)."""
    def timed(r: dict) -> list[float]:  # step 1 warms up
        return r["seconds"][1:] or r["seconds"]

    per = []
    for run in repeats:
        ranks = sorted(run["ranks"], key=lambda r: r["stage"])
        per.append({"median_step_s_ranks": [statistics.median(timed(r)) for r in ranks],
                    "first_step_s": ranks[0]["seconds"][0], "wall_s": run["wall_s"],
                    "other_load": run["other_load"], "losses": ranks[0]["losses"],
                    "same_on_every_rank": all(r["losses"] == ranks[0]["losses"] for r in ranks)})
    best = min(per, key=lambda r: r["median_step_s_ranks"][0])
    r0 = sorted(repeats[0]["ranks"], key=lambda r: r["stage"])
    return {"losses": per[0]["losses"], "parts": r0[0]["parts"], "stage_params": [r["params"] for r in r0],
            "median_step_s": best["median_step_s_ranks"][0], "best": best, "repeats": per,
            "same_on_every_rank": all(r["same_on_every_rank"] for r in per),
            "same_every_repeat": all(r["losses"] == per[0]["losses"] for r in per)}


def loss_table(dropout: str, rows: dict[str, dict], refs: dict[str, list[float]], steps: int) -> list[str]:
    names = list(rows)
    head = ["step"] + [c for n in names for c in (NAMES[n], f"{NAMES[n]} - reference")]
    if len(names) == 2:
        head.append(f"{NAMES[names[1]]} - {NAMES[names[0]]}")
    if dropout == "off":
        head.insert(1, "reference")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in range(steps):
        cells = [str(s + 1)]
        if dropout == "off":
            cells.append(f"{refs[names[0]][s]:.6f}")
        for n in names:
            v = rows[n]["losses"][s]
            cells += [f"{v:.6f}", f"{v - refs[n][s]:+.1e}"]
        if len(names) == 2:
            cells.append(f"{rows[names[1]]['losses'][s] - rows[names[0]]['losses'][s]:+.1e}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def time_table(results: dict) -> list[str]:
    lines = [("| framework | dropout | median train_batch (s), stage 0 / stage 1 | every repeat: stage 0 "
              "(other load) | first train_batch (s) | launch to exit (s) | parameters stage 0 / stage 1 | "
              "stage boundaries (`module.parts`) |"),
             "|---|---|---|---|---|---|---|---|"]
    for dropout, rows in results.items():
        for n, r in rows["runs"].items():
            best = r["best"]
            every = ", ".join(f"{x['median_step_s_ranks'][0]:.2f} ({x['other_load']:.0%})" for x in r["repeats"])
            lines.append(f"| {NAMES[n]} | {dropout} | "
                         + " / ".join(f"{t:.2f}" for t in best["median_step_s_ranks"])
                         + f" | {every} | {best['first_step_s']:.2f} | {best['wall_s']:.0f} | "
                         + " / ".join(f"{p:,}" for p in r["stage_params"]) + f" | {r['parts']} |")
    return lines


def markdown(results: dict, args, failures: dict) -> str:
    sys.path.insert(0, str(HERE))
    from zero_report import command_and_machine, machine_description

    machine = machine_description()
    if ANCHOR_PY.exists():
        machine["deepspeed"] = f"0.19.8 (its own venv, {ANCHOR_PY})"
    cmd = (f".venv/bin/python benchmarks/pipeline_example.py --steps {args.steps} --dropout "
           f"{' '.join(args.dropout)} --image-size {args.image_size} --repeats {args.repeats} --markdown --write-docs")
    out = ["## DeepSpeedExamples pipeline example, -p 2 (`benchmarks/pipeline_example.py`)", "",
           (f"DeepSpeedExamples' `{EXAMPLE}` run unchanged with `-p 2 --steps {args.steps} --backend gloo` "
           "on 2 CPU ranks (pipeline 2 x data 1): under meshspeed with `meshspeed run --deepspeed-compat "
           "--num_gpus 2`, under DeepSpeed with its own `deepspeed --num_gpus 2` launcher and "
           "`DS_ACCELERATOR=cpu`. Made locally (the script's docstring): a torchvision stub (AlexNet's "
           f"shapes, synthetic learnable CIFAR-10-like {args.image_size}x{args.image_size} images, no "
           "download), a sitecustomize that makes `torch.cuda.set_device` a no-op without CUDA and notes "
           "each `train_batch()`'s loss and wall time, and the example's ds_config.json with "
           f"train_batch_size {MICRO * GAS}, micro batch {MICRO} ({GAS} micro-batches a step) and "
           "`\"gradient_clipping\": 0`. The **reference** is one process of plain torch: the same seeds, "
           "samples in dataset order, each stage's Dropout masks from its own rank's RNG stream, one "
           "unclipped Adam step per batch. A loss is `train_batch()`'s return value, the mean over the "
           "step's micro-batches before that step's update."), *command_and_machine(cmd, machine)]
    for dropout, rows in results.items():
        runs = rows["runs"]
        if not runs:
            continue
        what = ("AlexNet's two Dropout(0.5) replaced by Identity" if dropout == "off" else
                "AlexNet as it is, two Dropout(0.5); each column's reference is computed with that "
                "framework's stage boundaries")
        out += [f"### dropout {dropout}: {what}", "", *loss_table(dropout, runs, rows["refs"], args.steps), ""]
    out += ["### step time", "", *time_table(results), "",
            (f"Median over steps 2 on, rank by rank, of the run with the fastest stage 0 out of {args.repeats}; "
             "other load: the share of the machine's CPU that other processes used during that run (this "
             "machine is shared); `launch to exit` includes starting the processes and importing the "
             "framework (DeepSpeed also loads its JIT-built shm comm op)."), ""]
    for key, error in failures.items():
        out.append(f"- **{key}** did not run: `{error}`")
    return "\n".join(out).rstrip() + "\n"


def write_docs(section: str, path: Path, key: str = "pipeline_example.py") -> None:
    from zero_report import replace_section

    replace_section(section, path, key)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dropout", nargs="+", default=["off", "on"], choices=["off", "on"])
    ap.add_argument("--frameworks", nargs="+", default=["meshspeed", "deepspeed"], choices=list(NAMES))
    ap.add_argument("--image-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1, help="runs of each framework (alternating); the "
                    "fastest one's step time is shown")
    ap.add_argument("--json", help="write every number here")
    ap.add_argument("--markdown", action="store_true", help="print the docs/benchmarks.md section")
    ap.add_argument("--write-docs", action="store_true", help="put that section into docs/benchmarks.md")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (its path is printed)")
    args = ap.parse_args()
    frameworks = list(args.frameworks)
    failures: dict[str, str] = {}
    if "deepspeed" in frameworks and not ANCHOR_PY.exists():
        failures["DeepSpeed"] = f"{ANCHOR_PY} is missing (build it with ../shared/tools/anchor-venv.sh)"
        frameworks.remove("deepspeed")
    tmp = Path(tempfile.mkdtemp(prefix="pipeline-example-"))
    results: dict[str, dict] = {}
    try:
        prepare(tmp)
        print(f"example script and stub in {tmp}", flush=True)
        for dropout in args.dropout:
            runs, refs, ref_by_cut, logged = {}, {}, {}, {}
            done: dict[str, list[dict]] = {f: [] for f in frameworks}
            for rep in range(args.repeats):  # alternate the order: slow spells hit both
                for i, framework in enumerate(frameworks if rep % 2 == 0 else frameworks[::-1]):
                    if framework in failures_of(failures, framework, dropout):
                        continue
                    run = launch(framework, tmp, args.steps, args.image_size, dropout,
                                 29500 + os.getpid() % 500 + i, tag=str(rep))
                    if not run["ok"]:
                        failures[f"{NAMES[framework]}, dropout {dropout}"] = run["error"]
                        continue
                    done[framework].append(run)
                    logged[framework] = logged_losses(run["output"])
            for framework in frameworks:
                if not done[framework]:
                    continue
                runs[framework] = summary(done[framework])
                cut = tuple(runs[framework]["parts"]) if dropout == "on" else ("any",)
                if cut not in ref_by_cut:
                    print(f"  reference, dropout {dropout}, stage boundaries {runs[framework]['parts']} ...",
                          flush=True)
                    ref_by_cut[cut] = reference(args.steps, args.image_size, dropout, runs[framework]["parts"])
                refs[framework] = ref_by_cut[cut]
            results[dropout] = {"runs": runs, "refs": refs}
            if runs:
                print("\n".join(["", f"dropout {dropout}", *loss_table(dropout, runs, refs, args.steps), ""]))
            for framework, values in logged.items():
                if values:  # DeepSpeed's own log line against what train_batch returned
                    mine = runs[framework]["losses"]
                    agree = len(values) == len(mine) and all(abs(a - b) <= 5e-5 for a, b in zip(values, mine))
                    print(f"  {framework}'s own 'steps: N loss: X' lines {'agree' if agree else 'DISAGREE'} "
                          "with the recorded losses (to their 4 decimals)")
            for framework, r in runs.items():
                if not r["same_on_every_rank"]:
                    print(f"  {framework}: train_batch returned different losses on the two stages")
                if not r["same_every_repeat"]:
                    print(f"  {framework}: the repeats gave different losses")
        print("\n".join(["", *time_table(results), ""]))
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    for key, error in failures.items():
        print(f"{key} did not run: {error}")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "failures": failures}, indent=1))
    if args.markdown or args.write_docs:
        section = markdown(results, args, failures)
        if args.markdown:
            print(section)
        if args.write_docs:
            write_docs(section, REPO / "docs" / "benchmarks.md")


if __name__ == "__main__":
    main()
