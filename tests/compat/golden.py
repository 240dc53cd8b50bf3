"""DeepSpeed's own output for the compat scripts, recorded once and committed, so the tests
that compare meshspeed with DeepSpeed run in CI without DeepSpeed installed.

    python tests/compat/golden.py            # re-record every run with the anchor venv
    python tests/compat/golden.py cifar_moe  # one script's runs (cifar_moe, ulysses, hf)

Each file under tests/compat/golden/ holds the command that ran (DeepSpeed 0.19.8 in the
venv of ../shared/tools/anchor-venv.sh, torchrun, DS_ACCELERATOR=cpu, two ranks), the
DeepSpeed version, and the lines of its output the tests read (the scripts print their
losses, parameter norms and accuracy as `LOSS ...`, `PARAMS ...`, `Accuracy ...` lines).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "golden"
KEEP = re.compile(r"^(LOSS |PARAMS |GRAD_NORM |WEIGHT |FROM_PRETRAINED |STATE_DICT |SAVED$|Accuracy of the network|Finished Training|\[rank\d\]: LOSS )")


def path_of(name: str) -> Path:
    return GOLDEN / (re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_") + ".json")


def load(name: str) -> str:
    """The recorded output lines of run `name`, joined as the scripts printed them."""
    return "\n".join(json.loads(path_of(name).read_text())["lines"])


def record(name: str, argv: list[str], cwd: Path, python: str) -> None:
    env = {"OMP_NUM_THREADS": "1", "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "DS_ACCELERATOR": "cpu",
           "HOME": os.environ.get("HOME", "/root")}  # no meshspeed on the path: DeepSpeed alone
    command = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *argv]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False, env=env, cwd=cwd)
    out = proc.stdout + proc.stderr
    if proc.returncode:
        raise SystemExit(f"{name}: DeepSpeed's run failed:\n{out[-3000:]}")
    version = subprocess.run([python, "-c", "import deepspeed; print(deepspeed.__version__)"],
                             capture_output=True, text=True, env=env, check=True).stdout.strip().splitlines()[-1]
    lines = [line for line in out.splitlines() if KEEP.search(line)]
    shown = [a.replace(f"{HERE}/", "").replace(f"{cwd}/", "") for a in command[1:]]  # paths of this checkout
    GOLDEN.mkdir(exist_ok=True)
    path_of(name).write_text(json.dumps({"command": ["python", *shown], "deepspeed": version, "lines": lines},
                                        indent=1) + "\n")
    print(f"{name}: {len(lines)} lines -> {path_of(name).relative_to(HERE.parents[1])}")


def main(argv: list[str]) -> int:
    import tempfile

    sys.path.insert(0, str(HERE.parents[1]))
    from tests.compat import hf_runs
    from tests.compat import test_cifar_moe_script as cifar
    from tests.compat import test_ulysses_script as ulysses

    python = str(Path(os.environ.get("ANCHOR_VENV", Path.home() / ".cache/meshspeed-anchors")) / "bin/python")
    which = set(argv) or {"cifar_moe", "ulysses", "hf"}
    with tempfile.TemporaryDirectory() as tmp:
        if "cifar_moe" in which:
            for name in cifar.RUNS:
                record(f"cifar_moe {name}", cifar._command(name), Path(tmp), python)
        if "ulysses" in which:
            record("ulysses", ulysses._command(Path(tmp)), Path(tmp), python)
        if "hf" in which:  # in order, in one folder: a resumed run reads its full run's checkpoint
            for name, run_argv in hf_runs.RUNS:
                record(name, run_argv, Path(tmp), python)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
