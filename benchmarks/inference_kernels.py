"""Each inference kernel's implementations against its plain path, per shape and dtype.

    .venv/bin/python benchmarks/inference_kernels.py [--device cpu|cuda] [--threads 1] [--repeats 15]

For every op in meshspeed.inference.kernels, at a decode shape (8, 1, 512) and a prefill
shape (8, 128, 512), in fp32 and bf16 (and fp16 on CUDA), prints microseconds per call of
the plain path and of each other implementation that can run there (torch.compile'd
versions are measured whether or not the registry prefers them here, since this table is
what decides that: Note [where torch.compile pays] in the module), after warm-up; the
warm-up's first calls (compilation included) are reported apart. The last column names
the shapes where it beat plain. Timings are the fastest of `--repeats` interleaved runs of
20 calls (see time_us).
"""

from __future__ import annotations

import argparse
import time

import torch

from meshspeed.inference import kernels

SHAPES = {"decode": (8, 1, 512), "prefill": (8, 128, 512)}


def make_args(op: str, shape, dtype, device):
    b, t, h = shape
    g = torch.Generator().manual_seed(0)

    def r(*s):
        return torch.randn(*s, generator=g).to(device=device, dtype=dtype)

    if op == "rms_norm":
        return (r(b, t, h), r(h), 1e-6)
    if op == "add_rms_norm":
        return (r(b, t, h), r(b, t, h), r(h), 1e-6)
    if op == "layer_norm":
        return (r(b, t, h), r(h), r(h), 1e-5)
    if op == "add_layer_norm":
        return (r(b, t, h), r(b, t, h), r(h), r(h), 1e-5)
    if op == "rotary":  # 8 heads of 64, (B, heads, T, D), cos/sin (T, D) broadcast
        return (r(b, 8, t, 64), r(t, 64), r(t, 64))
    if op == "bias_gelu":
        return (r(b, t, 4 * h), r(4 * h), "tanh")
    if op == "silu_mul":
        return (r(b, t, 4 * h), r(b, t, 4 * h))
    if op == "fused_qkv":
        mods = [torch.nn.Linear(h, h).to(device=device, dtype=dtype) for _ in range(3)]
        return (r(b, t, h), *mods)
    raise ValueError(f"no benchmark arguments for op {op!r}")


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_us(fns: dict, args, device, repeats: int, calls: int = 20) -> dict[str, float]:
    """Fastest of `repeats` runs of `calls` calls, the candidates interleaved run by run:
    on a shared machine other work only ever adds time, so the minimum is the estimate
    least polluted by it, and interleaving exposes every candidate to the same load."""
    best = {label: float("inf") for label in fns}
    for _ in range(repeats):
        for label, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            for _ in range(calls):
                fn(*args)
            sync(device)
            best[label] = min(best[label], (time.perf_counter() - t0) / calls * 1e6)
    return best


def candidates(op: str) -> dict[str, object]:
    found = {"plain": kernels._PLAIN[op]}
    for impl in kernels._FAST[op]:
        fn = impl.fn
        if impl.label == "compiled":  # a fresh one per dtype so compile time is its own
            fn = kernels._compiled(kernels._PLAIN[op])
        found[impl.label] = fn
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--ops", nargs="*", default=list(kernels.OPS))
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    dtypes = [torch.float32, torch.bfloat16] + ([torch.float16] if opts.device == "cuda" else [])
    print(f"device {opts.device}, {opts.threads} thread(s), torch {torch.__version__}; "
          "us per call (fastest run), first s = the first calls (compiling)")
    print(f"{'op':<15} {'dtype':<9} {'impl':<9} {'decode':>9} {'prefill':>9} {'first s':>9}  faster at")
    with torch.inference_mode():
        for op in opts.ops:
            for dtype in dtypes:
                fns = candidates(op)
                rows: dict[str, dict[str, float]] = {label: {} for label in fns}
                for name, shape in SHAPES.items():
                    args = make_args(op, shape, dtype, opts.device)
                    for label, fn in fns.items():  # compile / pack / warm
                        t0 = time.perf_counter()
                        fn(*args)
                        rows[label].setdefault("first " + name, time.perf_counter() - t0)
                        fn(*args)
                    for label, us in time_us(fns, args, opts.device, opts.repeats).items():
                        rows[label][name] = us
                for label, row in rows.items():
                    faster = [s for s in SHAPES if label != "plain" and row[s] < rows["plain"][s]]
                    first = row["first decode"] + row["first prefill"]
                    print(f"{op:<15} {str(dtype)[6:]:<9} {label:<9} {row['decode']:>9.1f} "
                          f"{row['prefill']:>9.1f} {first:>9.2f}  {' '.join(faster)}", flush=True)


if __name__ == "__main__":
    main()
