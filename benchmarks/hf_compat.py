"""Hugging Face Trainer and accelerate on meshspeed and on DeepSpeed 0.19.8, side by side.

    .venv/bin/python benchmarks/hf_compat.py [--only trainer] [--write-docs]

Runs every case of tests/compat/hf_runs.py twice on 2 processes, in two working folders
(a resumed run reads the checkpoint its full run wrote):
- DeepSpeed: the anchor venv (../shared/tools/anchor-venv.sh; ANCHOR_VENV overrides its
  folder) under torchrun, DS_ACCELERATOR=cpu, nothing of meshspeed on the path;
- meshspeed: this venv under torchrun with the alias installed the way
  `meshspeed compat install` installs it (into a folder on PYTHONPATH), no DeepSpeed.
The same unchanged scripts: tests/compat/hf_trainer.py (TrainingArguments(deepspeed=<ds_config
with "auto" values>), ZeRO 1/2/3, with and without offload_optimizer cpu, save_model, then
resume_from_checkpoint at step 4) and tests/compat/hf_accelerate.py (Accelerator with a
DeepSpeedPlugin, save_state/load_state, clip_grad_norm_, get_state_dict).

Prints one row per run: the first and last loss of each, the largest relative difference
over every step, and whether save_model wrote the same tensors (names, shapes; largest
relative difference of their norms). `--write-docs` puts the table in docs/deepspeed_compat.md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.compat import hf_runs  # noqa: E402 - the repository root goes on the path first

DOCS_KEY = "hf_compat.py"


def anchor_python() -> str:
    return str(Path(os.environ.get("ANCHOR_VENV", Path.home() / ".cache/meshspeed-anchors")) / "bin/python")


def launch(python: str, argv: list[str], cwd: Path, env: dict[str, str]) -> tuple[str, float]:
    command = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *argv]
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False, env=env, cwd=cwd)
    out = proc.stdout + proc.stderr
    if proc.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{out[-3000:]}")
    return out, time.perf_counter() - start


def compare(name: str, ds: str, ms: str) -> str:
    a, b = hf_runs.loss_lines(ms), hf_runs.loss_lines(ds)
    if [s for s, _ in a] != [s for s, _ in b] or not a:
        raise SystemExit(f"{name}: the runs printed different steps: {a} vs {b}")
    worst = max(hf_runs.relative(x, y) for (_, x), (_, y) in zip(a, b))
    saved = "—"
    wa, wb = hf_runs.weights(ms), hf_runs.weights(ds)
    if wb:
        if sorted(wa) != sorted(wb) or any(wa[k][0] != wb[k][0] for k in wb):
            saved = f"**differ**: {sorted(set(wa) ^ set(wb))}"
        else:
            saved = f"{len(wb)} tensors, norms within {max(hf_runs.relative(wa[k][1], wb[k][1]) for k in wb):.1e}"
    steps = f"{a[0][0]}–{a[-1][0]}"
    return (f"| {name} | {steps} | {b[0][1]:.8f} / {b[-1][1]:.8f} | {a[0][1]:.8f} / {a[-1][1]:.8f} "
            f"| {worst:.1e} | {saved} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("trainer", "accelerate"), default=None)
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    runs = [(n, a) for n, a in hf_runs.RUNS if args.only is None or n.startswith(args.only)]
    base = {"OMP_NUM_THREADS": "1", "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": os.environ.get("HOME", "/root")}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ds_dir, ms_dir = Path(tmp, "deepspeed"), Path(tmp, "meshspeed")
        ds_dir.mkdir()
        ms_dir.mkdir()
        from meshspeed.compat.install import install

        install(ms_dir / "site")
        ms_env = {**base, "PYTHONPATH": os.pathsep.join([str(ms_dir / "site"), str(REPO)])}
        ds_env = {**base, "DS_ACCELERATOR": "cpu"}
        for name, argv in runs:
            ds, ds_s = launch(anchor_python(), argv, ds_dir, ds_env)
            ms, ms_s = launch(sys.executable, argv, ms_dir, ms_env)
            rows.append(compare(name, ds, ms))
            print(f"{rows[-1]}   [{ds_s:.0f}s / {ms_s:.0f}s]", flush=True)
    version = subprocess.run([anchor_python(), "-c", "import deepspeed; print(deepspeed.__version__)"],
                             capture_output=True, text=True, check=True, env={**base, "DS_ACCELERATOR": "cpu"})
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout
    section = (
        f"Command: `.venv/bin/python benchmarks/hf_compat.py --write-docs` at commit {commit.strip()}; "
        f"DeepSpeed {version.stdout.strip().splitlines()[-1]}, 2 processes, gloo, fp32. Each row is one unchanged "
        "script run under each; losses are per optimizer step, summed over its 2 micro-batches, at full "
        "precision. \"saved\" compares what `trainer.save_model()` wrote.\n\n"
        "| run | steps | DeepSpeed first / last loss | meshspeed first / last loss | largest relative "
        "difference | saved |\n|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    print(section)
    if args.write_docs:
        sys.path.insert(0, str(REPO / "benchmarks"))
        from zero_report import replace_section

        replace_section(section, REPO / "docs" / "deepspeed_compat.md", DOCS_KEY)


if __name__ == "__main__":
    main()
