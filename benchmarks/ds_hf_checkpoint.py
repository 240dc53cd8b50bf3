"""Hugging Face Trainer checkpoints moved between DeepSpeed 0.19.8 and meshspeed, both ways.

    PYTHONPATH=. .venv/bin/python benchmarks/ds_hf_checkpoint.py [--json out.json] [--case z2_dp2 ...]
    PYTHONPATH=. .venv/bin/python benchmarks/ds_hf_checkpoint.py --write-fixtures

For each case (ZeRO stage, number of processes, whose optimizer) the unchanged Trainer script
tests/checkpoint/ds_hf_trainer.py (a tiny random-init GPT-2, 6 optimizer steps, a
`checkpoint-<N>` folder every 3) runs under torchrun:
- DeepSpeed (the anchor venv, DS_ACCELERATOR=cpu, nothing of meshspeed on the path) trains
  steps 1-6; then `trainer.train(resume_from_checkpoint=<its checkpoint-3>)` runs once on
  DeepSpeed and once on meshspeed (this venv, the alias installed as `meshspeed compat
  install` installs it): steps 4-6 on each.
- meshspeed trains steps 1-6 with `"checkpoint": {"format": "deepspeed"}` in the Trainer's
  ds_config (the DeepSpeed trail); its checkpoint-3 is resumed on meshspeed and on DeepSpeed.
Prints the losses of steps 4-6 on both sides and their largest relative difference.

`--write-fixtures` runs the one-process cases on DeepSpeed only and writes
tests/checkpoint/fixtures/deepspeed/hf_<case>/: DeepSpeed's checkpoint-3 folder (less the
DeepSpeed scripts it copies there, the pickled TrainingArguments, and the weights and
config files the Trainer does not read on a DeepSpeed resume) and expected.json (DeepSpeed's
losses of steps 1-6 and of steps 4-6 after resuming from it), for tests/checkpoint/test_ds_hf.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "checkpoint" / "ds_hf_trainer.py"
FIXTURES = REPO / "tests" / "checkpoint" / "fixtures" / "deepspeed"
# What the fixture keeps of DeepSpeed's checkpoint-3 folder (the Trainer reads these on resume).
KEEP = ("latest", "trainer_state.json", "scheduler.pt")

# name: (ZeRO stage, processes, Trainer builds the optimizer (torch AdamW + linear schedule))
CASES = {
    "z1_dp2": (1, 2, False), "z2_dp2": (2, 2, False), "z3_dp2": (3, 2, False),
    "z2_dp2_hfopt": (2, 2, True), "z3_dp2_hfopt": (3, 2, True),
    "z2_dp1": (2, 1, False), "z3_dp1_hfopt": (3, 1, True),
}
FIXTURE_CASES = ("z2_dp1", "z3_dp1_hfopt")


def anchor_python() -> str:
    return str(Path(os.environ.get("ANCHOR_VENV", Path.home() / ".cache/meshspeed-anchors")) / "bin/python")


def base_env() -> dict[str, str]:
    return {"OMP_NUM_THREADS": "1", "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": os.environ.get("HOME", "/root")}


def run(python: str, env: dict[str, str], cwd: Path, nproc: int, args: list[str]) -> dict[int, float]:
    command = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               str(SCRIPT), *args]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False, env=env, cwd=cwd)
    out = proc.stdout + proc.stderr
    if proc.returncode or "DONE" not in out:
        raise SystemExit(f"{' '.join(command)} (in {cwd}) failed:\n{out[-4000:]}")
    return {int(line.split()[1]): float(line.split()[2]) for line in out.splitlines() if line.startswith("LOSS ")}


def relative(a: dict[int, float], b: dict[int, float]) -> float:
    if sorted(a) != sorted(b):
        raise SystemExit(f"different steps: {a} vs {b}")
    return max(abs(a[s] - b[s]) / abs(b[s]) for s in b)


def case_args(stage: int, hf_opt: bool) -> list[str]:
    return ["--stage", str(stage), "--trail"] + (["--hf-optimizer"] if hf_opt else [])


def measure(name: str, tmp: Path, ms_env: dict[str, str], ds_env: dict[str, str]) -> dict:
    stage, nproc, hf_opt = CASES[name]
    args = case_args(stage, hf_opt)
    ds, ms = tmp / name / "ds", tmp / name / "ms"
    ds.mkdir(parents=True)
    ms.mkdir(parents=True)
    ds_full = run(anchor_python(), ds_env, ds, nproc, [*args, "--out", "full"])
    ds_ckpt = str(ds / "full" / "checkpoint-3")
    ds_on_ds = run(anchor_python(), ds_env, ds, nproc, [*args, "--out", "resumed", "--resume", ds_ckpt])
    ms_on_ds = run(sys.executable, ms_env, ms, nproc, [*args, "--out", "from_ds", "--resume", ds_ckpt])
    ms_full = run(sys.executable, ms_env, ms, nproc, [*args, "--out", "full"])
    ms_ckpt = str(ms / "full" / "checkpoint-3")
    ms_on_ms = run(sys.executable, ms_env, ms, nproc, [*args, "--out", "resumed", "--resume", ms_ckpt])
    ds_on_ms = run(anchor_python(), ds_env, ds, nproc, [*args, "--out", "from_ms", "--resume", ms_ckpt])
    row = {"case": name, "stage": stage, "processes": nproc, "optimizer": "trainer" if hf_opt else "ds_config",
           "ds_full": ds_full, "ms_full": ms_full,
           "ds_ckpt": {"deepspeed": ds_on_ds, "meshspeed": ms_on_ds, "max_rel": relative(ms_on_ds, ds_on_ds)},
           "ms_ckpt": {"meshspeed": ms_on_ms, "deepspeed": ds_on_ms, "max_rel": relative(ds_on_ms, ms_on_ms)}}
    fmt = lambda d: ", ".join(f"{d[s]:.8f}" for s in sorted(d))
    print(f"| {name} | DeepSpeed | {fmt(ds_on_ds)} | {fmt(ms_on_ds)} | {row['ds_ckpt']['max_rel']:.1e} |\n"
          f"| {name} | meshspeed | {fmt(ds_on_ms)} | {fmt(ms_on_ms)} | {row['ms_ckpt']['max_rel']:.1e} |", flush=True)
    return row


def write_fixture(name: str, tmp: Path, ds_env: dict[str, str]) -> None:
    stage, nproc, hf_opt = CASES[name]
    args = case_args(stage, hf_opt)
    cwd = tmp / name
    cwd.mkdir(parents=True)
    full = run(anchor_python(), ds_env, cwd, nproc, [*args, "--out", "full"])
    src = cwd / "full" / "checkpoint-3"
    resumed = run(anchor_python(), ds_env, cwd, nproc, [*args, "--out", "resumed", "--resume", str(src)])
    dest = FIXTURES / f"hf_{name}"
    shutil.rmtree(dest, ignore_errors=True)
    (dest / "checkpoint-3").mkdir(parents=True)
    for item in sorted(src.iterdir()):
        if item.name in KEEP or item.name.startswith("rng_state"):
            shutil.copy(item, dest / "checkpoint-3" / item.name)
        elif item.is_dir() and item.name.startswith("global_step"):
            shutil.copytree(item, dest / "checkpoint-3" / item.name)
    version = subprocess.run([anchor_python(), "-c", "import deepspeed; print(deepspeed.__version__)"],
                             capture_output=True, text=True, check=True, env=ds_env).stdout.split()[-1]
    expected = {"deepspeed": version, "stage": stage, "processes": nproc, "script_args": args,
                "losses": {str(s): v for s, v in full.items()},
                "losses_after_resume": {str(s): v for s, v in resumed.items()}}
    (dest / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    print(f"{dest.relative_to(REPO)}: {sorted(p.name for p in (dest / 'checkpoint-3').rglob('*'))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", nargs="*", choices=sorted(CASES), default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--write-fixtures", action="store_true")
    args = parser.parse_args()
    ds_env = {**base_env(), "DS_ACCELERATOR": "cpu"}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        if args.write_fixtures:
            for name in FIXTURE_CASES:
                write_fixture(name, tmp, ds_env)
            return
        from meshspeed.compat.install import install

        install(tmp / "site")
        ms_env = {**base_env(), "PYTHONPATH": os.pathsep.join([str(tmp / "site"), str(REPO)])}
        print("| case | checkpoint written by | DeepSpeed losses 4-6 after resume | meshspeed | max rel |\n"
              "|---|---|---|---|---|", flush=True)
        rows = [measure(name, tmp, ms_env, ds_env) for name in (args.case or CASES)]
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
