"""Export to DeepSpeed, measured on DeepSpeed 0.19.8: does DeepSpeed continue as meshspeed does?

    python benchmarks/ds_checkpoint_export.py                 # every case: losses + zero_to_fp32
    python benchmarks/ds_checkpoint_export.py --write-golden  # tests/checkpoint/fixtures/deepspeed/golden/

Per case (ZeRO stage, dp, dtype): meshspeed trains a tiny MLP 2 steps on fixed batches and
saves; `meshspeed convert --to deepspeed` (the exporter) writes DeepSpeed's layout; DeepSpeed
0.19.8 (anchor venv, CPU, gloo, same dp) load_checkpoint()s it and trains 3 more steps;
meshspeed loads its own checkpoint and trains the same 3 steps. Printed: both loss lists,
their max relative difference, and whether DeepSpeed's zero_to_fp32 on the export equals
meshspeed's consolidated masters exactly. --write-golden: DeepSpeed itself trains and saves
the same model for a few cases; the structure of its files (ds_golden.describe) goes to
JSON, and meshspeed's checkpoint of the same run is kept as the tests' input.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ANCHOR_PY = "/root/.cache/meshspeed-anchors/bin/python"
GOLDEN = REPO / "tests/checkpoint/fixtures/deepspeed/golden"
CASES = ([(s, dp, "fp32") for s in (0, 1, 2, 3) for dp in (1, 2)] + [(0, 1, "bf16"), (1, 2, "bf16"), (3, 2, "bf16")]
         + [(0, 1, "fp16"), (1, 2, "fp16"), (2, 1, "fp16"), (3, 2, "fp16")])
GOLDEN_CASES = [(1, 2, "fp32"), (3, 2, "fp32"), (0, 1, "bf16")]
ROWS = 4  # rows per optimizer step, split over dp


def model():
    import torch

    torch.manual_seed(0)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
            self.net.register_buffer("scale", torch.ones(3))

        def forward(self, x, y):
            return torch.nn.functional.mse_loss(self.net(x) * self.net.scale.to(x.dtype), y)

    return M()


def config(stage: int, dp: int, dtype: str) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": ROWS // dp, "gradient_accumulation_steps": 1,
           "gradient_clipping": 1.0,  # DeepSpeed 0.19.8's default; said explicitly for both
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
           "zero_optimization": {"stage": stage}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":  # 2^15: the scale grows right after the load, then overflows (hysteresis, drop)
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 15, "loss_scale_window": 2, "hysteresis": 2}
    return cfg


def loss_scale(engine) -> float | None:
    """The current loss scale (fp16) on either side."""
    if hasattr(engine, "loss_scaler"):  # meshspeed
        return float(engine.loss_scaler.scale)
    opt = engine.optimizer  # DeepSpeed: ZeRO keeps a LossScaler object, FP16_Optimizer a config
    held = getattr(opt, "loss_scaler", None) or getattr(opt, "loss_scale_config", None)
    return float(held.cur_scale) if held is not None else None


def allow_fp16_on_cpu() -> None:
    """DeepSpeed 0.19.8's CPU accelerator says it has no fp16 and `initialize` refuses an fp16
    config, though torch computes fp16 on CPU: turned on here so DeepSpeed loads and trains
    the fp16 exports (nothing else of DeepSpeed's is changed)."""
    from deepspeed.accelerator import get_accelerator

    type(get_accelerator()).is_fp16_supported = lambda self: True


def train(engine, rank: int, dp: int, first: int, last: int, dtype: str,
          scales: list | None = None) -> list[float]:
    import torch
    import torch.distributed as dist

    losses = []
    for i in range(first, last):
        g = torch.Generator().manual_seed(1000 + i)
        x, y = torch.randn(ROWS, 5, generator=g), torch.randn(ROWS, 3, generator=g)
        rows = slice(rank * ROWS // dp, (rank + 1) * ROWS // dp)
        x, y = x[rows], y[rows]
        if dtype in ("bf16", "fp16"):
            low = torch.bfloat16 if dtype == "bf16" else torch.float16
            x, y = x.to(low), y.to(low)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        t = loss.detach().float().reshape(1)
        dist.all_reduce(t)
        losses.append(t.item() / dp)
        if scales is not None:
            scales.append(loss_scale(engine))
    return losses


def _rank(rank: int, world: int, port: int, job: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    stage, dp, dtype, work = job["stage"], world, job["dtype"], Path(job["dir"])
    cfg = config(stage, dp, dtype)
    out: dict = {}
    if job["side"] == "meshspeed":
        import meshspeed
        from meshspeed.checkpoint import consolidate
        from meshspeed.checkpoint.deepspeed_format import export

        m = model()
        a, *_ = meshspeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)
        out["first_scales"] = []
        out["first"] = train(a, rank, dp, 0, 2, dtype, out["first_scales"])
        a.save_checkpoint(str(work / "ms"), client_state={"note": "hi"})
        if rank == 0:
            export(str(work / "ms"), str(work / "ds"))
            torch.save(consolidate(str(work / "ms")), str(work / "masters.pt"))
        dist.barrier()
        m = model()
        b, *_ = meshspeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)
        b.load_checkpoint(str(work / "ms"))
        out["loaded_scale"], out["scales"] = loss_scale(b), []
        out["after"] = train(b, rank, dp, 2, 5, dtype, out["scales"])
    elif job["side"] == "deepspeed":
        import deepspeed

        if dtype == "fp16":
            allow_fp16_on_cpu()
        m = model()
        e, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)
        _, client = e.load_checkpoint(str(work / "ds"))
        out["client_note"] = client.get("note")
        out["global_steps"] = e.global_steps
        out["loaded_scale"], out["scales"] = loss_scale(e), []
        out["after"] = train(e, rank, dp, 2, 5, dtype, out["scales"])
        if rank == 0 and stage > 0:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            got = get_fp32_state_dict_from_zero_checkpoint(str(work / "ds"))
            want = torch.load(str(work / "masters.pt"))
            out["zero_to_fp32_exact"] = (set(got) == set(want)
                                         and all(torch.equal(got[k].float(), want[k].float()) for k in want))
    else:  # golden: DeepSpeed trains and saves the same run itself
        import deepspeed

        if dtype == "fp16":
            allow_fp16_on_cpu()
        m = model()
        e, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)
        train(e, rank, dp, 0, 2, dtype)
        e.save_checkpoint(str(work / "dsref"), client_state={"note": "hi"})
    if rank == 0:
        (work / f"{job['side']}.json").write_text(json.dumps(out))
    dist.barrier()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(job: dict) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(_rank, args=(job["dp"], _port(), job), nprocs=job["dp"], start_method="spawn")


def run(side: str, stage: int, dp: int, dtype: str, work: Path) -> dict:
    job = {"side": side, "stage": stage, "dp": dp, "dtype": dtype, "dir": str(work)}
    python = sys.executable if side == "meshspeed" else ANCHOR_PY
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu"}
    subprocess.run([python, __file__, "--worker", json.dumps(job)], check=True, env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return json.loads((work / f"{side}.json").read_text())


def write_golden() -> None:
    sys.path.insert(0, str(REPO))
    from tests.checkpoint.ds_golden import describe, load

    for stage, dp, dtype in GOLDEN_CASES:
        name = f"zero{stage}_dp{dp}_{dtype}"
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            run("golden", stage, dp, dtype, work)
            run("meshspeed", stage, dp, dtype, work)
            tag_dir = work / "dsref" / "global_step2"
            files = {}
            for f in sorted(tag_dir.glob("*.pt")):
                obj = load(str(f))
                for d in (obj, obj.get("optimizer_state_dict") or {}):
                    if isinstance(d, dict) and "ds_config" in d:
                        d["ds_config"] = "<config>"
                files[f.name] = describe(obj)
            (GOLDEN / f"{name}.json").write_text(json.dumps(
                {"case": {"stage": stage, "dp": dp, "dtype": dtype}, "deepspeed": "0.19.8",
                 "command": "python benchmarks/ds_checkpoint_export.py --write-golden",
                 "files": files}, indent=1) + "\n")
            dest = GOLDEN / f"meshspeed_{name}"
            shutil.rmtree(dest, ignore_errors=True)
            shutil.copytree(work / "ms", dest)
        print(f"wrote {GOLDEN / name}.json and {dest}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--write-golden", action="store_true")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None, help="these cases only")
    args = p.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    if args.write_golden:
        write_golden()
        return
    for stage, dp, dtype in [c for c in CASES if args.dtype in (None, c[2])]:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            ms = run("meshspeed", stage, dp, dtype, work)
            ds = run("deepspeed", stage, dp, dtype, work)
        rel = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(ms["after"], ds["after"]))
        fmt = lambda xs: [round(x, 8) for x in xs]
        print(f"ZeRO {stage} dp {dp} {dtype}: meshspeed {fmt(ms['after'])}  "
              f"DeepSpeed {fmt(ds['after'])}  max rel diff {rel:.2e}  "
              f"zero_to_fp32 exact: {ds.get('zero_to_fp32_exact', 'n/a (stage 0)')}  "
              f"global_steps {ds['global_steps']} client_state note {ds['client_note']!r}", flush=True)
        if dtype == "fp16":
            print(f"    loss scale: meshspeed steps 1-2 {ms['first_scales']}, after load {ms['loaded_scale']} "
                  f"-> {ms['scales']}; DeepSpeed after load {ds['loaded_scale']} -> {ds['scales']}", flush=True)


if __name__ == "__main__":
    main()
