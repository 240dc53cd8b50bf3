"""Every script in examples/ runs as its docstring says (`meshspeed run --nproc-per-node N
examples/x.py ...` or `python examples/x.py ...`), with small step counts, and prints what a
user looks for: losses that fall, a resume that carries on, generated text, the mesh.

Almost all of each run is process start-up (every rank imports torch, some transformers),
and the ranks wait on each other, so the runs this session selected start together in two
threads (`runs`, module scope) and each test reads its own run's output. Every launch gets
its own free port (two torchrun jobs on the default port would meet).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # this checkout: the ranks import meshspeed from here
EXAMPLES = ROOT / "examples"
TIMEOUT = 300


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _env(cwd: Path) -> dict[str, str]:
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)  # a rendezvous an earlier in-process test left is not this one
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONIOENCODING"] = "utf-8"  # generated text may hold U+FFFD
    env["HOME"] = str(cwd)  # transformers / accelerate caches stay in the test's folder
    env["TMPDIR"] = str(cwd)
    return env


def _run(cwd: Path, nproc: int, script: str, *args: str, compat: bool = False) -> str:
    """Run examples/<script> as a user would, in `cwd`; its output (stdout + stderr).
    nproc 0: `python examples/<script>`; else `meshspeed run --nproc-per-node nproc`."""
    path = str(EXAMPLES / script)
    if nproc:
        launcher = [sys.executable, "-m", "meshspeed.cli", "run", "--nproc-per-node", str(nproc),
                    "--master-port", _free_port()] + (["--deepspeed-compat"] if compat else [])
    else:
        launcher = [sys.executable]
    proc = subprocess.run([*launcher, path, *args], cwd=cwd, env=_env(cwd), capture_output=True,
                          encoding="utf-8", errors="replace", timeout=TIMEOUT, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script} {' '.join(args)} exited {proc.returncode}:\n{out[-4000:]}"
    return proc.stdout


def _losses(out: str) -> dict[int, float]:
    """{step: loss} from the library's `steps_per_print` lines on rank 0."""
    lines = re.finditer(r"^\[meshspeed\] step (\d+), loss ([0-9.]+)", out, re.MULTILINE)
    return {int(m.group(1)): float(m.group(2)) for m in lines}


def _final(out: str) -> dict[int, float]:
    """{step: loss} from the example's own `final loss X after N steps` line (printed only
    when the last step fell between the library's lines)."""
    lines = re.finditer(r"^final loss ([0-9.]+) after (\d+) steps$", out, re.MULTILINE)
    return {int(m.group(2)): float(m.group(1)) for m in lines}


def _falls(out: str, steps: list[int], final: int | None = None) -> dict[int, float]:
    """The library printed the loss at `steps` (and the example its final line at step
    `final`, else none), each loss once, and it fell from the first to the last."""
    assert not re.search(r"^step\s+\d+\s+loss", out, re.MULTILINE), "the example prints its own loss lines"
    losses, ended = _losses(out), _final(out)
    assert sorted(losses) == steps, out[-3000:]
    assert sorted(ended) == ([] if final is None else [final]), out[-3000:]
    losses.update(ended)
    first, last = losses[steps[0]], losses[final or steps[-1]]
    assert last < first - 0.2, f"loss did not fall: {losses}\n{out[-3000:]}"
    return losses


# -- the runs ----------------------------------------------------------------------------------


def _zero3_and_inference(cwd: Path) -> dict[str, str]:
    """Train and save, resume from the save, then generate from the checkpoint."""
    first = _run(cwd, 2, "zero3_checkpoint.py", "--steps", "10", "--save-every", "5", "--save-dir", "ckpt")
    resumed = _run(cwd, 2, "zero3_checkpoint.py", "--steps", "5", "--save-dir", "ckpt", "--resume")
    generated = _run(cwd, 0, "inference.py", "--checkpoint", "ckpt", "--new-tokens", "8")
    return {"first": first, "resumed": resumed, "generated": generated}


JOBS = {  # test name -> what it runs (in a folder of its own); the longest first
    "test_zero3_checkpoint_resume_and_inference": _zero3_and_inference,
    "test_hf_trainer": lambda cwd: _run(cwd, 2, "hf_trainer.py", "--deepspeed", str(EXAMPLES / "ds_config.json"),
                                        "--steps", "6", compat=True),
    "test_hf_model": lambda cwd: _run(cwd, 2, "hf_model.py", "--steps", "6", "--print-every", "3"),
    "test_tp_sp": lambda cwd: _run(cwd, 4, "tp_sp.py", "--steps", "6", "--print-every", "3"),
    "test_pipeline": lambda cwd: _run(cwd, 2, "pipeline.py", "--steps", "6", "--print-every", "3"),
    "test_long_context": lambda cwd: _run(cwd, 2, "long_context.py", "--steps", "5", "--print-every", "2"),
    "test_moe": lambda cwd: _run(cwd, 2, "moe.py", "--steps", "6", "--print-every", "3"),
    "test_zero_infinity": lambda cwd: _run(cwd, 0, "zero_infinity.py", "--steps", "4", "--nvme-path", str(cwd)),
}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """{test name: Future of its run's result}, for the tests this session selected."""
    selected = {item.name for item in request.session.items if item.path == Path(__file__)}
    pool = ThreadPoolExecutor(max_workers=2)
    futures: dict[str, Future] = {}
    for name, job in JOBS.items():
        if name in selected:
            futures[name] = pool.submit(job, tmp_path_factory.mktemp(name.removeprefix("test_")))
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


# -- the tests ---------------------------------------------------------------------------------


def test_zero3_checkpoint_resume_and_inference(runs):
    out = runs["test_zero3_checkpoint_resume_and_inference"].result()
    first = _falls(out["first"], [5, 10])
    assert "saved ckpt at step 10" in out["first"]
    resumed = out["resumed"]
    assert "resumed from ckpt/global_step10 at step 10" in resumed, resumed[-3000:]
    after = _losses(resumed)
    assert sorted(after) == [15], resumed[-3000:]
    # a fresh model would start near ln(256) = 5.5 again; the resumed one carries on
    assert after[15] < first[5] - 0.2, (first, after)

    generated = out["generated"]
    assert "loaded ckpt: 21 tensors" in generated, generated[-3000:]
    greedy = generated.split("--- engine.generate (greedy) ---")[1].split("--- Server")[0]
    assert len(re.findall(r"^'.*' -> '.+'$", greedy, re.MULTILINE)) == 4, generated
    served = re.findall(r"^request (\d): '.*' -> '(.*)'$", generated, re.MULTILINE)
    assert sorted(int(i) for i, _ in served) == [0, 1, 2, 3], generated
    assert re.search(r"server: ServerStats\(.*tokens=16\)", generated), generated  # 8 + 4 + 2 + 2


def test_tp_sp(runs):
    out = runs["test_tp_sp"].result()
    assert "Topology(rank 0 of 4 ranks = pp 1 x dp 2 x cp 1 x tp 2)" in out, out[-3000:]
    assert "layers[0].attn.wq holds (32, 64) on each rank" in out, out[-3000:]  # heads split over tp
    # sequence parallelism: between the split matmuls each tp rank holds half the sequence
    assert "the norms' input on each rank: (8, 32, 64) (batch, sequence, width) of a (8, 64, 64) batch" in out
    _falls(out, [3, 6])


def test_pipeline(runs):
    out = runs["test_pipeline"].result()
    assert "Topology(rank 0 of 2 ranks = pp 2 x dp 1 x cp 1 x tp 1)" in out, out[-3000:]
    _falls(out, [3, 6])


def test_long_context(runs):
    out = runs["test_long_context"].result()
    assert "cp 2" in out and "256 tokens per sequence, 128 on each rank (ring_balanced)" in out, out[-3000:]
    _falls(out, [2, 4], final=5)  # 5 steps, a line every 2: the example prints the last loss


def test_moe(runs):
    out = runs["test_moe"].result()
    assert "(dp 2 = ep 2 x edp 1)" in out and "2 of 4 experts on each rank, top-2" in out, out[-3000:]
    _falls(out, [3, 6])
    counts = re.findall(r"tokens per expert \[([0-9, ]+)\]", out)
    assert counts, out[-3000:]
    for line in counts:  # every token of the rank's batch (8 x 64) reaches its top 2
        assert sum(int(c) for c in line.split(",")) == 8 * 64 * 2, line


def test_zero_infinity(runs, tmp_path_factory):
    out = runs["test_zero_infinity"].result()
    _falls(out, [2, 4])
    nvme = re.search(r"tiers: .*nvme ([0-9.]+) MiB", out)
    files = re.search(r"swap files under (.+): ([0-9.]+) MiB", out)
    assert nvme and float(nvme.group(1)) > 0, out[-3000:]
    assert files and float(files.group(2)) > 0, out[-3000:]
    assert not [p for p in Path(files.group(1)).rglob("*") if p.is_file()], "swap files left behind"


def test_hf_model(runs):
    out = runs["test_hf_model"].result()
    assert "tp 2" in out and "LlamaForCausalLM: q_proj holds (32, 64) on each rank" in out, out[-3000:]
    _falls(out, [3, 6])


def test_hf_trainer(runs):
    out = runs["test_hf_trainer"].result()
    assert "trained by meshspeed.compat.deepspeed.runtime.engine.DeepSpeedEngine" in out, out[-3000:]
    losses = [float(x) for x in re.findall(r"\{'loss': '([0-9.]+)'", out)]
    assert len(losses) == 1, out[-3000:]  # logging_steps 5 of 6 steps
    assert "saved hf_trainer_out/final" in out, out[-3000:]


def test_every_example_has_its_command_and_help(tmp_path):
    """Each script's docstring quotes how to run it, examples/README.md lists it, and
    `--help` works (one interpreter runs them all: argparse exits before any work)."""
    scripts = sorted(p.name for p in EXAMPLES.glob("*.py"))
    assert len(scripts) >= 9, scripts
    readme = (EXAMPLES / "README.md").read_text()
    for name in scripts:
        text = (EXAMPLES / name).read_text()
        assert re.search(rf"^    (meshspeed run .*|python )examples/{name}", text, re.MULTILINE), name
        assert f"examples/{name}" in readme, f"examples/README.md does not list {name}"
    code = ("import runpy, sys\n"
            f"for name in {scripts!r}:\n"
            f"    sys.argv = [name, '--help']\n"
            "    try:\n"
            f"        runpy.run_path({str(EXAMPLES)!r} + '/' + name, run_name='__main__')\n"
            "    except SystemExit as e:\n"
            "        assert e.code == 0, (name, e.code)\n"
            "    else:\n"
            "        raise AssertionError(name + ' --help did not exit')\n"
            "    print('HELP OK', name)\n")
    proc = subprocess.run([sys.executable, "-c", code], env=_env(tmp_path), capture_output=True,
                          encoding="utf-8", timeout=TIMEOUT, check=False, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("HELP OK") == len(scripts), proc.stdout
