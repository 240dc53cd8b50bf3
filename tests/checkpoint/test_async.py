"""`checkpoint.async_save`: the save returns after an in-memory snapshot, training goes
on, the next save (or exit) waits, and what lands on disk is the snapshot, bitwise."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from meshspeed.checkpoint import consolidate, read_meta
from meshspeed.checkpoint.reshard import SavedTensors
from meshspeed.testing.harness import run_distributed
from tests.checkpoint import workers

ROOT = Path(__file__).resolve().parents[2]


def saved_tensors(path: str) -> dict[str, torch.Tensor]:
    store = SavedTensors(path, read_meta(path))
    out = {}
    for name in sorted(store.meta["files"]):
        f = store.file(name)
        out.update({f"{name}:{k}": f.read(k) for k in f.entries if not k.startswith("rng/")})
    return out


def test_async_save_matches_sync_save(tmp_path):
    out = run_distributed(workers.async_then_sync, 2, args=(str(tmp_path),))[0]
    assert out["in_flight"] and out["latest_during"] is None  # returned before writing
    assert out["latest_after"] == "global_step4" and out["losses_equal"]
    a = saved_tensors(str(tmp_path / "async" / "global_step4"))
    s = saved_tensors(str(tmp_path / "sync" / "global_step4"))
    assert a.keys() == s.keys() and all(torch.equal(a[k], s[k]) for k in a)
    # the held save wrote its snapshot, not the weights of the steps taken meanwhile
    step2 = consolidate(tmp_path / "async", tag="global_step2")
    step4 = consolidate(tmp_path / "async", tag="global_step4")
    assert not torch.equal(step2["tok_emb.weight"], step4["tok_emb.weight"])
    assert read_meta(str(tmp_path / "async" / "global_step2"))["counters"]["global_steps"] == 2


SCRIPT = textwrap.dedent("""
    import sys
    from meshspeed.checkpoint import writer
    from tests.checkpoint.workers import make_engine, setup_for, train
    import time

    def slow(point):
        time.sleep(1.0)  # the interpreter is already on its way out

    setup = setup_for(1, 2, steps=1, extra_config={"checkpoint": {"async_save": True}})
    engine = make_engine(setup)
    train(engine, setup, 0, 1)
    writer._test_pause = slow
    engine.save_checkpoint(sys.argv[1])
    print("returned", flush=True)
""")


def test_exit_waits_for_the_background_save(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "ckpt")], env=env,
                            capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "returned" in result.stdout
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step1"
    assert consolidate(tmp_path / "ckpt")


def test_background_failure_surfaces_in_the_next_step(tmp_path):
    errors = run_distributed(workers.async_failure_surfaces_in_step, 2, args=(str(tmp_path),))
    assert all(e and "no space left on device" in e for e in errors), errors
