"""DeepSpeedExamples' cifar10 MoE runs, in small (tests/compat/ds_cifar_moe.py: `import
deepspeed`, `deepspeed.moe.layer.MoE` per entry of --num-experts, the MoE parameter groups,
`deepspeed.initialize(..., training_data=..., config=...)`, the engine's loader, eval),
run unchanged under `meshspeed run --deepspeed-compat --num_gpus 2` with expert
parallelism 2, and each rank's loss at every step, and the test accuracy, are what one
process of plain PyTorch computes with every expert local.

The reference holds the script's Net built with ep_world_size 1 from the same seed (the
experts are copies of one fc3, so both hold the same weights), reads each rank's samples
in the order of the engine's loader (DistributedSampler, shuffled with seed 0), and runs
each rank's 8 rows through the model on their own (routing and capacity are per rank, as
under DeepSpeed), starting each from the same random state: every rank draws the same
numbers (the same shapes), so RSample's Gumbel noise, random token selection and top-2's
second-expert sampling are reproduced too. The one draw each pass over a DataLoader makes
from the global generator is made by opening the same loader. The mean of the two ranks'
losses is backpropagated, the global norm clipped at 1.0, and torch.optim.AdamW steps with
WarmupLR's (log) learning rate.

Runs: run_ds_moe.sh's flags (top-1, RSample, min capacity 0; experts 2 and 4), and
run_ds_prmoe.sh's residual MoE with top-2, where RSample has no effect (as in DeepSpeed;
rank 0 says so once) and the layers' l_aux is added to the loss. The same script under
DeepSpeed 0.19.8 itself (its venv, torchrun) gives the same numbers, RSample's draws
included; those runs are recorded once (tests/compat/golden.py) and checked from the files.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from tests.compat import golden

SCRIPT = Path(__file__).with_name("ds_cifar_moe.py")
ROOT = Path(__file__).resolve().parents[2]
WORLD, MICRO = 2, 8  # train_batch_size 16 over 2 data-parallel ranks
COMMON = ["--log-interval", "4", "--deepspeed", "--moe", "--ep-world-size", "2", "--moe-param-group",
          "--min-capacity", "0"]
RUNS = {  # name: (flags, whether meshspeed warns that RSample has no effect)
    "run_ds_moe": (["--num-experts", "2", "4", "--top-k", "1", "--noisy-gate-policy", "RSample"], False),
    "run_ds_prmoe top-2": (["--num-experts", "2", "4", "--top-k", "2", "--mlp-type", "residual",
                            "--noisy-gate-policy", "RSample", "--aux-loss-coef", "0.01"], True),
}
NO_EFFECT = "noisy_gate_policy='RSample' has no effect with k=2"


def _script_module():
    """The script's functions, imported with `deepspeed` as meshspeed for the import only."""
    from meshspeed.compat.alias import install, uninstall

    install()
    try:
        spec = importlib.util.spec_from_file_location("ds_cifar_moe_ref", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        uninstall()
    return module


def _args(script, flags: list[str]):
    """The script's own argument parsing of `flags`."""
    argv, sys.argv = sys.argv, [str(SCRIPT), *flags]
    try:
        return script.add_argument()
    finally:
        sys.argv = argv


class _Engine:
    """What the script's test() reads of the engine, over the reference model."""

    local_rank = 0

    def __init__(self, module):
        self.module = module

    def eval(self):
        self.module.eval()

    def __call__(self, x):
        return self.module(x)


def _warmup_lr(step: int, script) -> float:
    """WarmupLR (log) at optimizer step `step` (0-based): the schedule stands at iteration
    step - 1, and the fraction is log(i + 1) / log(W) for 0 < i < W (0 at i <= 0)."""
    i = step - 1
    fraction = 0.0 if i <= 0 else 1.0 if i >= script.WARMUP else math.log(i + 1) / math.log(script.WARMUP)
    return script.LR * fraction


def _reference(flags: list[str]) -> tuple[dict[int, list[float]], str]:
    script = _script_module()
    args = _args(script, COMMON + flags)
    args.ep_world_size = 1  # every expert on this process
    trainset = script.synthetic_cifar(script.TRAIN_SAMPLES, seed=1)
    testset = script.synthetic_cifar(script.TEST_SAMPLES, seed=2)
    torch.manual_seed(args.seed)
    net = script.Net(args)
    params = list(net.parameters())
    opt = torch.optim.AdamW(params, lr=0.0, betas=(0.8, 0.999), eps=1e-8, weight_decay=3e-7)
    criterion = torch.nn.CrossEntropyLoss()
    samplers = [DistributedSampler(trainset, num_replicas=WORLD, rank=r, shuffle=True, seed=0, drop_last=True)
                for r in range(WORLD)]
    losses: dict[int, list[float]] = {r: [] for r in range(WORLD)}
    step = 0
    for _ in range(args.epochs):
        iter(DataLoader(trainset, batch_size=MICRO, sampler=samplers[0]))  # the pass's one draw
        orders = [list(s) for s in samplers]
        for i in range(len(orders[0]) // MICRO):
            state = torch.get_rng_state()
            total = 0.0
            for r in range(WORLD):
                torch.set_rng_state(state)  # every rank starts the step from the same state
                x, y = trainset[orders[r][i * MICRO:(i + 1) * MICRO]]
                loss = criterion(net(x), y)
                if args.aux_loss_coef:
                    loss = loss + args.aux_loss_coef * net.l_aux
                losses[r].append(loss.item())
                total = total + loss
            (total / WORLD).backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            for group in opt.param_groups:
                group["lr"] = _warmup_lr(step, script)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        script.test(_Engine(net), testset, "cpu", None)
    return losses, out.getvalue().strip()


def _check(name: str, out: str, warns: bool) -> None:
    losses: dict[int, list[float]] = {r: [] for r in range(WORLD)}
    # no line anchors: the two ranks print to one pipe, and a line's newline can come after
    # the other rank's next line has started
    for rank, step, loss in re.findall(r"LOSS rank=(\d) step=(\d+) loss=([-+.\deE]+|nan|inf)", out):
        assert int(step) == len(losses[int(rank)]) + 1, out[-3000:]
        losses[int(rank)].append(float(loss))
    want, accuracy = _reference(RUNS[name][0])
    assert all(len(v) == 8 for v in losses.values()), out[-3000:]
    for r in range(WORLD):
        torch.testing.assert_close(torch.tensor(losses[r]), torch.tensor(want[r]), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, r=r: f"{name}, rank {r}: losses differ: {m}")
    assert re.findall(r"Accuracy of the network on the \d+ test images: +\d+ %", out) == [accuracy]
    assert out.count("Finished Training") == WORLD
    assert out.count(NO_EFFECT) == (1 if warns else 0), out[-3000:]  # rank 0, once for both layers


def _command(name: str) -> list[str]:
    return [str(SCRIPT), *COMMON, *RUNS[name][0]]


@pytest.mark.parametrize("name", RUNS)
def test_cifar_moe_example_runs_unchanged_and_equals_one_process(name, tmp_path):
    env = {"OMP_NUM_THREADS": "1", "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "meshspeed.cli", "run", "--deepspeed-compat", "--num_gpus", "2", *_command(name)],
        capture_output=True, text=True, timeout=240, check=False, env=env, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _check(name, proc.stdout + proc.stderr, warns=RUNS[name][1])


@pytest.mark.parametrize("name", RUNS)
def test_deepspeeds_own_run_of_the_script_gives_the_same_numbers(name):
    """DeepSpeed 0.19.8's run of the same script, recorded (tests/compat/golden.py)."""
    _check(name, golden.load(f"cifar_moe {name}"), warns=False)  # DeepSpeed ignores RSample at k=2 silently
