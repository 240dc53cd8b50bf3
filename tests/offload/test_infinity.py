"""ZeRO-Infinity at CI size (issue 18): with ZeRO stage 3 and `offload_optimizer` and
`offload_param` both on nvme, bf16, every model state (16-bit shards, fp32 masters, Adam's
moments, reduced gradients) lives in swap files and host memory holds bounded buffers.

- A GPT whose model state is several times a memory cap trains under that cap (peak RSS
  of a fresh process, one rank), bit for bit the same run without offload.
- A run killed with SIGKILL after a checkpoint (dp=2) leaves its swap files behind; fresh
  ranks with the same nvme_path load the checkpoint, rebuild the state in new swap files
  and finish the run exactly as an uninterrupted one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshspeed.models.gpt import GPT, GPTConfig
from meshspeed.testing import DistributedTestError, run_distributed
from meshspeed.testing.parity import ParitySetup
from tests.offload import infinity_workers
from tests.offload.workers import exact_adamw

ROOT = Path(__file__).resolve().parents[2]
MiB = 2**20


def _zero(nvme, *, sub_group_size: int, buffer_size: int) -> dict:
    """Stage 3, everything on NVMe, small bounded buffers."""
    return {
        "stage": 3,
        "sub_group_size": sub_group_size,
        "stage3_max_live_parameters": 1 << 20,
        "stage3_prefetch_bucket_size": 1 << 20,
        "stage3_param_persistence_threshold": 0,
        "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme), "buffer_count": 8},
        "offload_param": {"device": "nvme", "nvme_path": str(nvme), "buffer_count": 4,
                          "buffer_size": buffer_size},
    }


def _setup(zero: dict | None, model: dict | None = None, **kw) -> ParitySetup:
    extra = {**exact_adamw(), **({"zero_optimization": zero} if zero else {})}
    return ParitySetup(stage=3, precision="bf16", model=model or {}, extra_config=extra, **kw)


def _in_fresh_process(tmp_path: Path, name: str, *args, timeout: float = 300, env: dict | None = None):
    """`infinity_workers.<name>(*args)` in a new interpreter (one rank, no harness pool,
    so no earlier test's allocations in its heap or its VmHWM), with `env` added; returns
    its result."""
    args_path, out_path = tmp_path / f"{name}.args.pt", tmp_path / f"{name}.out.pt"
    torch.save((args, {}), args_path)
    # a lone process of its own: no rendezvous settings inherited from this one (an earlier
    # test's MASTER_PORT may still be bound here), so it picks a free port
    launch = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    env = {**{k: v for k, v in os.environ.items() if k not in launch},
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "tests.offload.infinity_workers", name,
                           str(args_path), str(out_path)], check=False, env=env, cwd=ROOT,
                          timeout=timeout, capture_output=True, text=True)
    assert proc.returncode == 0, f"{name} exited with {proc.returncode}:\n{proc.stderr[-4000:]}"
    return torch.load(out_path, weights_only=False)


# -- the RSS cap -------------------------------------------------------------------------------

# 77M parameters: model state 16 B each = 1174 MiB, 3.1x the cap below (375 MiB). d_model 512 makes a
# block unit 6 MiB in bf16, above the host allocator's mmap threshold (4 MiB: Note [a fixed
# mmap threshold for CPU training]) as in a full-size model; vocab 1024 keeps the root unit
# (embedding + head) a third of one block.
CAPPED = {"vocab_size": 1024, "d_model": 512, "n_layer": 24, "n_head": 8, "max_seq_len": 32}
SUB_GROUP = 1 << 20
PARAM_BUFFER = 1 << 20
PENDING_WRITES = 4 << 20  # per queue (publish, gradients): infinity_workers.bound_pending_writes
# glibc's mmap threshold in the measured process. At the default, 4 MiB, this model's 2 MiB
# matrices and their gradients fragment the heap by an amount that depends on the swap
# I/O's timing (the peak ranged over 226-426 MiB from run to run, up to 381 MiB of it free
# heap; the root cause is not found); at 1 MiB it is 194-195 MiB. The bound tested is the
# buffers' (Note [a fixed mmap threshold for CPU training] in meshspeed/process/malloc.py).
MMAP_THRESHOLD = 1 << 20


def _sizes(cfg: GPTConfig) -> dict:
    """Parameters of the whole GPT, of its largest block unit, of the root unit and of its
    largest single parameter (built on the meta device: nothing allocated)."""
    with torch.device("meta"):
        gpt = GPT(cfg)
    total = sum(p.numel() for p in gpt.parameters())
    block = sum(p.numel() for p in gpt.layers[0].parameters())
    return {"total": total, "block": block, "root": total - len(gpt.layers) * block,
            "largest_param": max(p.numel() for p in gpt.parameters())}


def _memory_cap(s: ParitySetup, zero: dict) -> dict[str, int]:
    """Bytes host memory may grow by, term by term, from the config's bounds and the
    model's unit sizes (one rank, world 1: a shard is a whole unit; bf16 parameters,
    fp32 optimizer state)."""
    c = s.gpt_config()
    n = _sizes(c)
    oo, op = zero["offload_optimizer"], zero["offload_param"]
    unit, root = n["block"], n["root"]
    tokens = s.micro * s.seq
    training = {
        # optimizer swap pool: buffer_count buffers of the largest sub-group, fp32
        "swap_pool": oo["buffer_count"] * max(zero["sub_group_size"], n["largest_param"]) * 4,
        # stage-3 shard staging pool: buffer_count x buffer_size 16-bit elements
        "param_pool": op["buffer_count"] * op["buffer_size"] * 2,
        # gathered 16-bit parameters: the root unit (whole through forward and backward),
        # the running unit and what may be prefetched (stage3_max_live_parameters)
        "gathered": 2 * (root + unit + zero["stage3_max_live_parameters"]),
        # fp32 gradient staging (comm_dtype): the unit being filled and the one reduction
        # in flight, each a full-gradient buffer and its reduce-scatter output (the whole
        # unit at world 1), plus the root's buffer, filled through the whole backward
        "grad_staging": (4 * unit + root) * 4,
        # one unit's gradient in transit: autograd's 16-bit gradients, the reduced 16-bit
        # shard, and its fp32 copy being written to its file
        "unit_grads": (2 + 2 + 4) * unit,
        # copies held by writes in flight: two queues of PENDING_WRITES each
        "writes_in_flight": 2 * PENDING_WRITES,
        # activations: the GPT saves ~49 B per token, layer and model dim in bf16 (measured
        # with torch.autograd.graph.saved_tensors_hooks); 64 covers the gradients of the
        # layer in backward. The logits, their log-softmax and gradients are fp32.
        "activations": tokens * (c.n_layer * c.d_model * 64 + c.vocab_size * 16),
    }
    # building under zero.Init holds this rank's 16-bit shards (the whole model at world
    # 1) and one fp32 tensor being replayed; initialize frees them before training
    build = 2 * n["total"] + 4 * n["largest_param"]
    return {**training, "build_or_training": max(build, sum(training.values())),
            # interpreter and torch code first used by this size, thread stacks
            "runtime_slack": 32 * MiB,
            # glibc's heap between trims (Note [returning the freed heap after each offloaded
            # step]): blocks below the mmap threshold freed within a step stay resident
            # until it ends. At the 1 MiB threshold this test runs with (MMAP_THRESHOLD) the
            # peak was 194-195 MiB in every run
            "allocator_slack": 96 * MiB}


def test_model_state_on_nvme_trains_under_a_memory_cap(tmp_path):
    """Peak RSS growth of one rank in a fresh process, from before the model is built to
    after the last step (a 2 ms sampler and VmHWM), stays under the cap derived from the
    config while the model state is >= 3x that cap; the run equals the run without offload
    (reference AdamW kernel: bit for bit)."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    zero = _zero(nvme, sub_group_size=SUB_GROUP, buffer_size=PARAM_BUFFER)
    s = _setup(zero, CAPPED, world=1, steps=2, seq=32)  # the first step and a steady one
    warmup = _setup(zero, world=1, steps=2, seq=32)  # the tiny default GPT, same config
    terms = _memory_cap(s, zero)
    cap = terms["build_or_training"] + terms["runtime_slack"] + terms["allocator_slack"]
    state = 16 * _sizes(s.gpt_config())["total"]  # bf16 params 2 + grads 2 + fp32 masters 4 + Adam 8
    assert state >= 3 * cap, {k: v / MiB for k, v in terms.items()}

    no_offload = _setup({k: v for k, v in zero.items() if not k.startswith("offload_")},
                        CAPPED, world=1, steps=2, seq=32)
    r = _in_fresh_process(tmp_path, "capped_run", s, warmup, PENDING_WRITES, no_offload,
                          env={"MESHSPEED_MMAP_THRESHOLD": str(MMAP_THRESHOLD)})
    report = {"peak MiB": r["growth"] / MiB, "VmHWM MiB": (r["hwm_growth"] or 0) / MiB,
              "cap MiB": cap / MiB, "state MiB": state / MiB,
              **{f"{k} MiB": v / MiB for k, v in terms.items()}}
    assert r["numel"] >= _sizes(s.gpt_config())["total"], report
    assert r["growth"] <= cap, report
    if r["hwm_growth"] is not None:  # the kernel's own high-water mark, between samples too
        assert r["hwm_growth"] <= cap, report
    assert list(nvme.iterdir()) == []  # the swap directory went with its engine
    # the same run without offload, in the same process after the measurement
    assert r["losses"] == r["reference_losses"], (r["losses"], r["reference_losses"])
    assert not r["missing"] and not r["differ"], (r["missing"], r["differ"])


# -- a killed run resumes ----------------------------------------------------------------------

SMALL = {"vocab_size": 256, "d_model": 128, "n_layer": 4, "n_head": 4, "max_seq_len": 16}
K = 3  # the checkpoint is taken after K of the 6 steps


def _resume_setup(nvme) -> ParitySetup:
    # several sub-groups per rank and a root shard read in pieces (buffer_size < its shard)
    return _setup(_zero(nvme, sub_group_size=1 << 14, buffer_size=1 << 14), SMALL, steps=6)


def test_killed_run_resumes_from_its_checkpoint(tmp_path):
    """dp=2: save after step K, SIGKILL both ranks in the middle of the next optimizer step
    (swap files half-updated, never closed); fresh ranks on the same nvme_path, where a
    stale directory even has the name a new rank would pick (a reused pid), load the
    checkpoint into new swap files and train the rest: optimizer state at step K and at the
    end, losses and final parameters equal an uninterrupted run's."""
    nvme, ckpt = tmp_path / "nvme", tmp_path / "ckpt"
    nvme.mkdir()
    s = _resume_setup(nvme)
    ref = run_distributed(infinity_workers.uninterrupted, world_size=2, args=(s, K), timeout=300)

    with pytest.raises(DistributedTestError) as killed:
        run_distributed(infinity_workers.killed_mid_step, world_size=2,
                        args=(s, K, str(ckpt)), timeout=300)
    assert "SIGKILL" in str(killed.value), killed.value
    stale = {d.name: infinity_workers.tree(str(d)) for d in nvme.iterdir()}
    assert sorted(n.split("-")[1] for n in stale) == ["rank0", "rank1"], stale
    assert all(files for files in stale.values()), stale  # left behind, with their files

    got = run_distributed(infinity_workers.resumed, world_size=2,
                          args=(s, K, str(ckpt), str(nvme)), timeout=300)
    for rank, (r, want) in enumerate(zip(got, ref)):
        # the stale directory renamed to this rank's own name is untouched; a new one was made
        own = f"meshspeed-rank{rank}-{r['pid']}"
        assert r["swap_dir"] == str(nvme / f"{own}-1"), r["swap_dir"]
        assert infinity_workers.tree(str(nvme / own)) == stale[r["renamed_from"]]
        # the loaded state went to new swap files; gradient files follow at the next backward
        for at, subs in (("files_at_k", ("masters", "optimizer", "params")), ("files", ("grads",))):
            for sub in subs:
                assert any(f.startswith(sub + "/") and size for f, size in r[at].items()), (sub, r[at])
        for at in ("state_at_k", "state"):
            for name, keys in want[at].items():
                for key, value in keys.items():
                    assert torch.equal(r[at][name][key], value), (at, name, key)
        assert r["losses"] == want["losses"][K:], (r["losses"], want["losses"])
        for name, value in want["params"].items():
            assert torch.equal(r["params"][name], value), name
    # the resumed ranks removed their own directories; the dead run's stay
    assert sorted(d.name for d in nvme.iterdir()) == sorted(
        f"meshspeed-rank{rank}-{r['pid']}" for rank, r in enumerate(got))

