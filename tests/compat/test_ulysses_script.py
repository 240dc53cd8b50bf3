"""A DeepSpeed-Ulysses script (tests/compat/ds_ulysses_script.py: `import deepspeed`,
`from deepspeed.sequence.layer import DistributedAttention`, a sequence group from
`dist.new_group`, grouped-query heads, DeepSpeed's rotary_pos_emb, `deepspeed.initialize`)
runs unchanged under `meshspeed run --deepspeed-compat --num_gpus 2`, and its per-step
losses and final parameters are what one process of plain PyTorch computes on the whole
sequence from the same seed and batches. The same script under DeepSpeed 0.19.8 itself
(its venv, torchrun) gives the same numbers, which is what shows it is a DeepSpeed script;
that run is recorded once (tests/compat/golden.py) and checked from the file.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.compat import golden

SCRIPT = Path(__file__).with_name("ds_ulysses_script.py")
ROOT = Path(__file__).resolve().parents[2]
STEPS, LR, MOMENTUM = 4, 0.1, 0.9
CONFIG = {
    "train_batch_size": 4,  # 2 sequences per rank, as the engine counts them (2 data-parallel ranks)
    "train_micro_batch_size_per_gpu": 2,
    # SGD, not Adam: the sequence-parallel gradient is summed in another order than the
    # one-process one (they agree to ~1e-9), and Adam's first steps move each weight by
    # lr * g / (|g| + eps), which turns such differences in near-zero gradients into
    # differences of a good part of lr (5e-5 in the loss by step 2); SGD keeps the
    # comparison at rounding level. DeepSpeed takes "SGD" from torch.optim.
    "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": MOMENTUM}},
    "gradient_clipping": 0,  # DeepSpeed clips at 1.0 when the key is absent
    "steps_per_print": 1000,
}


def _script_module():
    """The script's model and data, imported with `deepspeed` as meshspeed for the import only."""
    from meshspeed.compat.alias import install, uninstall

    install()
    try:
        spec = importlib.util.spec_from_file_location("ds_ulysses_script_ref", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        uninstall()
    return module


def _reference() -> tuple[list[float], float]:
    """One process, the whole sequence: the script's model with its full-attention core,
    seeded as the script seeds it, the same batches, torch.optim.SGD."""
    script = _script_module()
    torch.manual_seed(script.SEED)
    model = script.TinyLM(script.FullCore)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    freqs = script.rotary_table(script.SEQ)
    losses = []
    for step in range(STEPS):
        ids, targets = script.batch(step)
        loss = F.cross_entropy(model(ids, freqs).reshape(-1, script.VOCAB), targets.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, float(torch.cat([p.detach().flatten() for p in model.parameters()]).norm())


def _numbers(out: str) -> tuple[list[float], float]:
    losses = [float(v) for v in re.findall(r"^LOSS step=\d+ loss=(\S+)$", out, re.MULTILINE)]
    norm = re.findall(r"^PARAMS norm=(\S+)$", out, re.MULTILINE)
    assert len(losses) == STEPS and len(norm) == 1, out[-3000:]
    return losses, float(norm[0])


def _check(out: str) -> None:
    losses, norm = _numbers(out)
    want_losses, want_norm = _reference()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=0)
    assert norm == pytest.approx(want_norm, rel=1e-6)


def _config(tmp_path: Path) -> Path:
    cfg = tmp_path / "ds_config.json"
    cfg.write_text(json.dumps(CONFIG))
    return cfg


def test_ulysses_script_runs_unchanged_and_equals_one_process(tmp_path):
    env = {"OMP_NUM_THREADS": "1", "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "meshspeed.cli", "run", "--deepspeed-compat", "--num_gpus", "2", *_command(tmp_path)],
        capture_output=True, text=True, timeout=240, check=False, env=env, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _check(proc.stdout)


def _command(tmp_path: Path) -> list[str]:
    return [str(SCRIPT), "--deepspeed", f"--deepspeed_config={_config(tmp_path)}", f"--steps={STEPS}"]


def test_deepspeeds_own_run_of_the_script_gives_the_same_numbers():
    """DeepSpeed 0.19.8's run of the same script, recorded (tests/compat/golden.py), shows
    the reference is what DeepSpeed computes, so the script is a DeepSpeed script."""
    _check(golden.load("ulysses"))
