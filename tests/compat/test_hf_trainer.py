"""Hugging Face's front door, unchanged: the Trainer script (tests/compat/hf_trainer.py,
`TrainingArguments(deepspeed=<ds_config with "auto" values>)`) and the accelerate loop
(tests/compat/hf_accelerate.py, `Accelerator(deepspeed_plugin=DeepSpeedPlugin(...))`) run on
meshspeed on 2 processes and give DeepSpeed 0.19.8's numbers: per-step losses, what
`trainer.save_model()` wrote (every tensor, by name, shape and norm), the losses after
`resume_from_checkpoint`, and accelerate's gradient norms, `save_state`/`load_state` and
`get_state_dict`. DeepSpeed's runs are recorded once (tests/compat/golden.py, the same
arguments, tests/compat/hf_runs.py) and read from the files.

The ZeRO-3 Trainer runs under `meshspeed run --deepspeed-compat`; the ZeRO-2 Trainer and the
accelerate loop under plain `torchrun` with the alias installed by `meshspeed compat install`
(into a folder on PYTHONPATH standing in for site-packages), the way a user launches once
it is installed. ZeRO 1 and the offload variants are in benchmarks/hf_compat.py's table.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from meshspeed.compat.install import write_shim
from tests.compat import golden, hf_runs

ROOT = Path(__file__).resolve().parents[2]
RTOL = 1e-5  # fp32; the runs agree to ~1e-7 (the order of a few float32 sums differs)
RUNS = dict(hf_runs.RUNS)


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
ACCELERATE_LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--use_deepspeed", "--num_processes", "2",
                     "--zero_stage", "2", "--gradient_accumulation_steps", "2", "--gradient_clipping", "1.0"]


def _launch(names: list[str], cwd: Path, installed: bool, launcher: list[str] = TORCHRUN,
            drop: int = 0) -> dict[str, str]:
    """Run `names` in order in `cwd` on 2 processes; their outputs by name. `installed`:
    under `launcher` with the alias installed; else under `meshspeed run --deepspeed-compat`.
    `drop`: leave out the run's last arguments (accelerate launch gives the stage)."""
    env = {"OMP_NUM_THREADS": "1", "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(cwd)}
    if installed:
        site = cwd / "site"
        write_shim(str(site))  # the files `meshspeed compat install` writes into site-packages
        env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT)])
    else:
        env["PYTHONPATH"] = str(ROOT)
        launcher = [sys.executable, "-m", "meshspeed.cli", "run", "--deepspeed-compat", "--nproc-per-node", "2"]
    outputs = {}
    for name in names:
        argv = RUNS[name][:len(RUNS[name]) - drop] if drop else RUNS[name]
        proc = subprocess.run([*launcher, *argv], capture_output=True, text=True, timeout=600, check=False,
                              env=env, cwd=cwd)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{name}:\n{out[-4000:]}"
        outputs[name] = out
    return outputs


@pytest.fixture(scope="module", params=[2, 3])
def trainer(request, tmp_path_factory):
    stage = request.param
    cwd = tmp_path_factory.mktemp(f"trainer{stage}")
    names = [f"trainer zero{stage}", f"trainer zero{stage} resume"]
    return stage, cwd, _launch(names, cwd, installed=stage == 2)


def _same_losses(got: dict[int, float], want: dict[int, float]) -> None:
    assert sorted(got) == sorted(want), (got, want)
    for step in want:
        assert hf_runs.relative(got[step], want[step]) <= RTOL, (step, got[step], want[step])


def test_trainer_losses_equal_deepspeeds(trainer):
    stage, _, out = trainer
    name = f"trainer zero{stage}"
    got, want = hf_runs.losses(out[name]), hf_runs.losses(golden.load(name))
    assert len(want) == 8
    _same_losses(got, want)


def test_resume_from_checkpoint_continues_with_the_same_losses(trainer):
    stage, _, out = trainer
    full = hf_runs.losses(out[f"trainer zero{stage}"])
    resumed = hf_runs.losses(out[f"trainer zero{stage} resume"])
    assert sorted(resumed) == [5, 6, 7, 8]  # checkpoint-4 was loaded, not a fresh start
    _same_losses(resumed, {s: full[s] for s in resumed})
    _same_losses(resumed, hf_runs.losses(golden.load(f"trainer zero{stage} resume")))


def test_save_model_writes_the_whole_model(trainer):
    """Every tensor DeepSpeed's save_model writes, with the same shape and norm; and
    `from_pretrained` of the folder (one process) holds exactly the file's weights. Under
    ZeRO-3, `from_pretrained` in the job (HfDeepSpeedConfig live) loads the same weights
    into the shards, each rank holding half the model's numbers."""
    stage, cwd, out = trainer
    got = hf_runs.weights(out[f"trainer zero{stage} resume"])
    want = hf_runs.weights(golden.load(f"trainer zero{stage} resume"))
    # GPT-2's 28 tensors, plus lm_head.weight under ZeRO 1/2 (a clone of the state_dict, as
    # DeepSpeed's; under ZeRO-3 the consolidated dict keeps the tie and it is left out)
    assert sorted(got) == sorted(want) and len(want) == (28 if stage == 3 else 29)
    for name, (shape, norm) in want.items():
        assert got[name][0] == shape, name
        assert hf_runs.relative(got[name][1], norm) <= RTOL, (name, got[name][1], norm)
    final = cwd / f"trainer-{stage}" / "final"
    model = AutoModelForCausalLM.from_pretrained(final)
    file = load_file(final / "model.safetensors")
    for name, p in model.state_dict().items():
        key = "transformer.wte.weight" if name == "lm_head.weight" else name  # tied
        torch.testing.assert_close(p, file[key], rtol=0, atol=0, msg=name)
    if stage == 3:  # from_pretrained with the Trainer's ZeRO-3 config live: built into the shards
        loaded = [line for line in out[f"trainer zero{stage} resume"].splitlines() if line.startswith("FROM_PRETRAINED")]
        assert loaded == ["FROM_PRETRAINED local share 0.50 max |diff| 0"]
        assert loaded == [line for line in golden.load("trainer zero3 resume").splitlines()
                          if line.startswith("FROM_PRETRAINED")]


@pytest.mark.parametrize("launch", ["plugin, ZeRO-3, torchrun", "accelerate launch --use_deepspeed, ZeRO-2"])
def test_accelerate_loop_equals_deepspeed(tmp_path, launch):
    """prepare, backward, clip_grad_norm_, save_state / load_state (steps 5-6 repeat exactly
    after the load), get_state_dict (gathered under ZeRO-3) and unwrap_model: with the
    script's own DeepSpeedPlugin at ZeRO-3 under torchrun, and with the plugin from
    `accelerate launch --use_deepspeed --zero_stage 2 ...` flags (DeepSpeed's run of the
    same loop with the plugin at ZeRO-2 is the recording)."""
    if launch.startswith("plugin"):
        name = "accelerate zero3"
        out = _launch([name], tmp_path, installed=True)[name]
    else:
        name = "accelerate zero2"  # the same arguments but `--stage 2`: the flags give it
        out = _launch([name], tmp_path, installed=True, launcher=ACCELERATE_LAUNCH, drop=2)[name]
    want = golden.load(name)
    got_lines, want_lines = hf_runs.loss_lines(out), hf_runs.loss_lines(want)
    assert [s for s, _ in got_lines] == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8] == [s for s, _ in want_lines]
    for (_, a), (_, b) in zip(got_lines, want_lines):
        assert hf_runs.relative(a, b) <= RTOL, (a, b)
    first, again = got_lines[4:6], got_lines[6:8]
    assert first == again  # load_state put back the step-4 state exactly
    for tag in ("GRAD_NORM", "PARAMS"):
        got = [float(line.split()[-1]) for line in out.splitlines() if line.startswith(tag)]
        ref = [float(line.split()[-1]) for line in want.splitlines() if line.startswith(tag)]
        assert len(got) == len(ref) > 0 and all(hf_runs.relative(a, b) <= RTOL for a, b in zip(got, ref)), tag
    state = [line for line in out.splitlines() if line.startswith("STATE_DICT")]
    assert state == [line for line in want.splitlines() if line.startswith("STATE_DICT")]
