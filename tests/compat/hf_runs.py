"""The Hugging Face runs meshspeed is compared with DeepSpeed on: the Trainer script
(tests/compat/hf_trainer.py) at ZeRO 1, 2 and 3, with and without `offload_optimizer: cpu`,
then resumed from its step-4 checkpoint; and the accelerate loop (tests/compat/hf_accelerate.py)
at ZeRO 2 and 3. Each run is `(name, script arguments)`, in order: a resumed run reads the
checkpoint its full run wrote, so a list is run in one working directory, first to last.

Used by tests/compat/golden.py (DeepSpeed's output, recorded), tests/compat/test_hf_trainer.py
(meshspeed against the recording) and benchmarks/hf_compat.py (both, side by side)."""

from __future__ import annotations

import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAINER = str(HERE / "hf_trainer.py")
ACCELERATE = str(HERE / "hf_accelerate.py")


def trainer_runs() -> list[tuple[str, list[str]]]:
    runs = []
    for stage in (1, 2, 3):
        for offload in (False, True):
            tag = f"zero{stage}" + (" offload" if offload else "")
            out = f"trainer-{stage}{'-offload' if offload else ''}"
            argv = [TRAINER, "--stage", str(stage), "--out", out] + (["--offload"] if offload else [])
            runs.append((f"trainer {tag}", argv))
            if stage > 1 and not offload:
                runs.append((f"trainer {tag} resume", [*argv, "--resume", f"{out}/checkpoint-4"]))
    return runs


def accelerate_runs() -> list[tuple[str, list[str]]]:
    return [(f"accelerate zero{s}", [ACCELERATE, "--out", f"accelerate-{s}", "--stage", str(s)]) for s in (2, 3)]


RUNS = trainer_runs() + accelerate_runs()


def losses(text: str) -> dict[int, float]:
    """`LOSS <step> <value>` lines; a step printed twice (the accelerate loop trains 5-6 again
    after load_state) keeps its last value, and both must agree (checked by the caller)."""
    return {int(m[1]): float(m[2]) for m in re.finditer(r"^LOSS (\d+) (\S+)$", text, re.M)}


def loss_lines(text: str) -> list[tuple[int, float]]:
    return [(int(m[1]), float(m[2])) for m in re.finditer(r"^LOSS (\d+) (\S+)$", text, re.M)]


def weights(text: str) -> dict[str, tuple[str, float]]:
    """`WEIGHT <name> <shape> <norm>` lines: what trainer.save_model wrote."""
    return {m[1]: (m[2], float(m[3])) for m in re.finditer(r"^WEIGHT (\S+) (\(.*?\)) (\S+)$", text, re.M)}


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)
