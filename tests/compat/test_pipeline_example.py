"""DeepSpeedExamples' pipeline example, in small: a script that does `import deepspeed` and
`from deepspeed.pipe import PipelineModule` (tests/compat/ds_pipeline_train.py) runs
unchanged under `meshspeed run --deepspeed-compat --num_gpus 2 ... -p 2`, and its losses are
what one process of plain PyTorch computes from the same seed and the same samples.

And what train_batch() does with data it cannot use: an iterator that runs dry and a
micro-batch that is not an (inputs, labels) pair each raise one error on every rank.

The real example (AlexNet, against DeepSpeed 0.19.8): benchmarks/pipeline_example.py.
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
from torch import nn
from torch.utils.data.distributed import DistributedSampler

from meshspeed.testing import run_distributed

SCRIPT = Path(__file__).with_name("ds_pipeline_train.py")
ROOT = Path(__file__).resolve().parents[2]
SEED, STEPS, MICRO, GAS = 1138, 4, 4, 4
CONFIG = {
    "train_batch_size": MICRO * GAS,  # pp 2 x dp 1: gradient_accumulation_steps 4
    "train_micro_batch_size_per_gpu": MICRO,
    "optimizer": {"type": "Adam", "params": {"lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-8}},
    "gradient_clipping": 0,
    "steps_per_print": 1000,
}


def _script_module():
    """The script's model and data (its functions), imported with `deepspeed` as meshspeed
    for the duration of the import only."""
    from meshspeed.compat.alias import install, uninstall

    install()
    try:
        spec = importlib.util.spec_from_file_location("ds_pipeline_train_ref", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        uninstall()
    return module


def _reference() -> tuple[list[float], int]:
    """One process, plain torch: the script's layers in order, seeded as the script seeds
    them; step s's micro-batch m is samples [(s * GAS + m) * MICRO, +MICRO) of the order
    `DistributedSampler(num_replicas=1, rank=0, shuffle=False)` gives (the sampler the
    pipeline engine's loader uses: in dataset order, as DeepSpeed's PipelineEngine reads
    training_data); loss / GAS accumulated, one unclipped Adam step."""
    script = _script_module()
    torch.manual_seed(SEED)
    layers = script.join_layers(script.conv_net())
    data = script.synthetic_trainset()
    order = list(DistributedSampler(data, num_replicas=1, rank=0, shuffle=False))
    params = [p for layer in layers if isinstance(layer, nn.Module) for p in layer.parameters()]
    opt = torch.optim.Adam(params, lr=0.01, betas=(0.9, 0.999), eps=1e-8)
    criterion = nn.CrossEntropyLoss()
    losses = []
    for step in range(STEPS):
        total = 0.0
        for m in range(GAS):
            idx = order[(step * GAS + m) * MICRO:(step * GAS + m + 1) * MICRO]
            x, y = data[idx]
            for layer in layers:
                x = layer(x)
            loss = criterion(x, y)
            (loss / GAS).backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / GAS)
    return losses, sum(p.numel() for p in params)


def test_pipeline_example_runs_unchanged_and_equals_one_process(tmp_path):
    cfg = tmp_path / "ds_config.json"
    cfg.write_text(json.dumps(CONFIG))
    env = {"OMP_NUM_THREADS": "1", "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "meshspeed.cli", "run", "--deepspeed-compat", "--num_gpus", "2", str(SCRIPT),
         f"--deepspeed_config={cfg}", "-p", "2", f"--steps={STEPS}", "--backend", "gloo", "--seed", str(SEED)],
        capture_output=True, text=True, timeout=240, check=False, env=env, cwd=tmp_path,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    found = re.findall(r"^STAGE rank=(\d) first=(\w+) last=(\w+) params=(\d+)$", out, re.MULTILINE)
    stages = {int(r): (f, last, int(n)) for r, f, last, n in found}
    assert {r: s[:2] for r, s in stages.items()} == {0: ("True", "False"), 1: ("False", "True")}, out
    losses = [float(v) for v in re.findall(r"^LOSS step=\d+ loss=(\S+)$", out, re.MULTILINE)]
    expected, n_params = _reference()
    assert sum(s[2] for s in stages.values()) == n_params  # each stage holds only its own layers
    assert len(losses) == STEPS, out
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)


# -- data train_batch() cannot use: one error on every rank, no hang ---------------------------
def _engine():
    import meshspeed
    from meshspeed.pipe import PipelineModule

    torch.manual_seed(0)
    net = PipelineModule([nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)], num_stages=2,
                         loss_fn=nn.CrossEntropyLoss())
    config = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "steps_per_print": 1000}
    engine, *_ = meshspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    return engine


def _micro_batch(i: int):
    g = torch.Generator().manual_seed(i)
    return torch.randn(1, 4, generator=g), torch.randint(3, (1,), generator=g)


def _train_batch_error(kind: str):
    """Run train_batch once on data it cannot use (it should raise)."""
    from meshspeed import comm

    engine = _engine()
    rank = comm.get_rank()
    if kind == "dry":  # 3 micro-batches for a batch of 4, on both stages
        batches = [_micro_batch(i) for i in range(3)]
    elif kind == "dry-first":  # only the first stage's iterator runs dry
        batches = [_micro_batch(i) for i in range(3 if rank == 0 else 4)]
    elif kind == "bare":  # tensors, not (inputs, labels)
        batches = [_micro_batch(i)[0] for i in range(4)]
    else:  # (inputs, labels, index): one item too many
        batches = [(*_micro_batch(i), i) for i in range(4)]
    engine.train_batch(iter(batches))


def _caught(kind: str):
    """(error type, message) on this rank, or None if train_batch did not raise."""
    try:
        _train_batch_error(kind)
    except Exception as err:  # noqa: BLE001 - the test reads the type and message
        return type(err).__name__, str(err)
    return None


@pytest.mark.parametrize("kind, rank0, rank1", [
    ("dry", "ran dry after 3 of the 4 micro-batches", "ran dry after 3 of the 4 micro-batches"),
    ("dry-first", "ran dry after 3 of the 4 micro-batches", "another rank could not read its micro-batches"),
    ("bare", "must be a pair (inputs, labels)", "must be a pair (inputs, labels)"),
    ("triple", "got tuple of 3 items", "got tuple of 3 items"),
])
def test_train_batch_with_unusable_data_fails_on_every_rank(kind, rank0, rank1):
    results = run_distributed(_caught, world_size=2, args=(kind,), timeout=60)
    for rank, (want, got) in enumerate(zip((rank0, rank1), results, strict=True)):
        assert got is not None, f"rank {rank}: train_batch did not fail"
        name, message = got
        assert name == "PipelineError" and want in message, (rank, got)
        assert message.startswith(f"train_batch: rank {rank} (stage {rank})") or "another rank" in message
    if kind == "bare":
        assert "got Tensor" in results[0][1]
