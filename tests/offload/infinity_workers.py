"""Workers of test_infinity.py: a GPT built under `meshspeed.zero.Init` in bf16, trained at
stage 3 with (or without) everything on NVMe.

Run on the harness's ranks (`run_distributed`) or, where the test needs a process of its
own (a clean RSS high-water mark, a process to SIGKILL), as

    python -m tests.offload.infinity_workers NAME ARGS.pt OUT.pt

which loads `(args, kwargs)` from ARGS.pt, calls NAME from this module and saves what it
returns to OUT.pt.
"""

from __future__ import annotations

import copy
import gc
import os
import signal
import sys
import threading

import torch

from meshspeed.process.accelerator import peak_rss_bytes, rss_bytes
from meshspeed.testing.parity import ParitySetup, full_state_dict, train_steps


def build_engine(s: ParitySetup):
    """The setup's GPT, partitioned as it is built (bf16 shards), and its engine."""
    import meshspeed
    from meshspeed.models.gpt import GPT

    torch.manual_seed(0)
    with meshspeed.zero.Init(dtype=torch.bfloat16):
        model = GPT(s.gpt_config())
    engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=copy.deepcopy(s.ds_config()))
    return engine


def bound_pending_writes(engine, nbytes: int) -> None:
    """Bound the 16-bit publish and fp32 gradient writes in flight (Note [bounded writes in
    flight] in meshspeed/offload/masters.py) to `nbytes` each: the default, 256 MiB, is not
    a config key and is larger than a CI-sized model's whole state."""
    placement = engine.strategy.placement
    for queue in (placement.master_files, placement.grad_files):
        if queue is not None:  # (None where masters or gradients stay in memory)
            queue.max_pending_bytes = nbytes


def optimizer_state(engine) -> dict[str, dict[str, torch.Tensor]]:
    """Adam's state of every parameter, read back whole (from the swap files with NVMe)."""
    from meshspeed.utils import safe_get_full_optimizer_state

    return {name: {key: safe_get_full_optimizer_state(p, key) for key in ("exp_avg", "exp_avg_sq")}
            for name, p in engine.module.named_parameters()}


def run(s: ParitySetup) -> dict:
    """Train every step; losses and final parameters."""
    from meshspeed.offload import close

    engine = build_engine(s)
    out = {"losses": train_steps(engine, s), "params": full_state_dict(engine)}
    close(engine)
    return out


# -- peak RSS --------------------------------------------------------------------------------


def _resetpeak_rss_bytes() -> bool:
    """Set VmHWM to the current RSS (Linux's clear_refs "5"); False where refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


class RssPeak:
    """The largest RSS growth over the start, sampled every 2 ms by a thread, and the
    kernel's high-water mark (VmHWM, reset at the start) over the same start."""

    def __enter__(self):
        gc.collect()
        self.hwm_reset = _resetpeak_rss_bytes()
        self.start = rss_bytes()
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        self.growth = self.peak - self.start
        self.hwm_growth = peak_rss_bytes() - self.start if self.hwm_reset else None


def capped_run(s: ParitySetup, warmup: ParitySetup, pending_bytes: int,
               reference: ParitySetup) -> dict:
    """Train `s` with the peak RSS measured from before the model is built to after the
    last step; `warmup` (a tiny model, same config) runs first so that code and buffers
    set up on first use (imports, I/O threads, allocator arenas) are not counted. Then,
    outside the measurement, `reference` (the same run without offload) runs in this
    process too, and the parameters that differ are returned (max abs difference)."""
    from meshspeed.offload import close

    engine = build_engine(warmup)
    bound_pending_writes(engine, pending_bytes)
    train_steps(engine, warmup)
    close(engine)
    del engine
    with RssPeak() as peak:
        engine = build_engine(s)
        bound_pending_writes(engine, pending_bytes)
        losses = train_steps(engine, s)
    out = {"growth": peak.growth, "hwm_growth": peak.hwm_growth, "losses": losses,
           "numel": sum(u.layout.numel for u in engine.strategy.units)}
    params = full_state_dict(engine)
    close(engine)
    del engine
    ref = run(reference)
    out["reference_losses"] = ref["losses"]
    out["differ"] = {name: (params[name] - value).abs().max().item()
                     for name, value in ref["params"].items() if not torch.equal(params[name], value)}
    out["missing"] = sorted(ref["params"].keys() ^ params.keys())
    return out


# -- a run killed after its checkpoint -------------------------------------------------------


def tree(path: str) -> dict[str, int]:
    """Bytes of each file under `path`, by path relative to it."""
    out = {}
    for root, _, names in os.walk(path):
        for n in names:
            full = os.path.join(root, n)
            out[os.path.relpath(full, path)] = os.path.getsize(full)
    return out


def uninterrupted(s: ParitySetup, k: int) -> dict:
    """Every step in one engine; the optimizer state after step k and at the end."""
    from meshspeed.offload import close

    engine = build_engine(s)
    head = train_steps(engine, s, 0, k)
    at_k = optimizer_state(engine)
    tail = train_steps(engine, s, k)
    out = {"losses": head + tail, "state_at_k": at_k, "state": optimizer_state(engine),
           "params": full_state_dict(engine)}
    close(engine)
    return out


def killed_mid_step(s: ParitySetup, k: int, save_dir: str) -> None:
    """Train k steps and save; then SIGKILL this rank in the next optimizer step, once two
    sub-groups' state went back to their files: nothing is closed or removed."""
    engine = build_engine(s)
    train_steps(engine, s, 0, k)
    engine.save_checkpoint(save_dir, tag="k")
    store = engine.optimizer.store
    release, released = store.release, []

    def release_then_die(*args, **kwargs):
        release(*args, **kwargs)
        released.append(True)
        if len(released) == 2:
            os.kill(os.getpid(), signal.SIGKILL)

    store.release = release_then_die
    train_steps(engine, s, k, k + 1)
    raise AssertionError("the rank was meant to be killed in its optimizer step")


def resumed(s: ParitySetup, k: int, save_dir: str, nvme_path: str) -> dict:
    """A fresh engine on the same nvme_path loads the checkpoint of step k and trains the
    rest. First, the dead run's directory of this rank is renamed to the one this process
    would make (as if its pid had been reused), so the new SwapDir must step around it."""
    from meshspeed import comm
    from meshspeed.offload import close

    prefix = f"meshspeed-rank{comm.get_rank()}-"
    (stale,) = [d for d in os.listdir(nvme_path) if d.startswith(prefix)]
    os.rename(os.path.join(nvme_path, stale), os.path.join(nvme_path, f"{prefix}{os.getpid()}"))
    engine = build_engine(s)
    engine.load_checkpoint(save_dir, tag="k")
    (swapdir,) = engine.strategy.placement.swap_dirs.values()
    out = {"pid": os.getpid(), "renamed_from": stale, "swap_dir": swapdir.path,
           "state_at_k": optimizer_state(engine), "files_at_k": tree(swapdir.path)}
    out["losses"] = train_steps(engine, s, k)
    out["files"] = tree(swapdir.path)
    out["state"] = optimizer_state(engine)
    out["params"] = full_state_dict(engine)
    close(engine)
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    name, args_path, out_path = sys.argv[1:4]
    args, kwargs = torch.load(args_path, weights_only=False)
    result = globals()[name](*args, **kwargs)
    torch.save(result, out_path)
