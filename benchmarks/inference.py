"""Generation side by side: meshspeed's runner and KV cache against Hugging Face `generate`
and DeepSpeed 0.19's `init_inference`, on the same model and prompts (issue 16).

    .venv/bin/python benchmarks/inference.py [--quick] [--repeats N] [--write-docs]

The model is a Hugging Face GPT-2 built from a config with random weights (fp32, CPU,
`--threads` intra-op threads). Prompts are random token ids of mixed lengths, left padded
for a batch. For each batch size (1, 8, 32) and each framework, one run generates 1 new
token (the time to the first token: prefill and one pick) and one run generates
`--new-tokens` (greedy, every sequence runs to the end: no stop token), so

    first token (ms)  = t(1)
    per token (ms)    = (t(n) - t(1)) / (n - 1)          one decode step of the whole batch
    tokens/s          = batch * n / t(n)

Note [interleaved repeats]
The frameworks run in turns (hf, meshspeed paged, meshspeed contiguous, deepspeed, hf,
...) and each figure is the median of `--repeats` turns, so slow minutes of the machine
fall on all of them. meshspeed's tokens equal HF's for every prompt (greedy, fp32): the
report says so, and a mismatch is printed as such, not hidden. DeepSpeed runs in its own
venv (`../shared/tools/anchor-venv.sh`) with `DS_ACCELERATOR=cpu`: on a CPU its
`init_inference` does not inject kernels (`replace_with_kernel_inject` needs CUDA), so its
row is HF's generate inside DeepSpeed's engine.

Continuous batching: `meshspeed.inference.throughput.compare_batching` on a stream of
mixed-length requests (prompts and new tokens of different lengths), `max_batch` 8: the
same runner and requests, once in static batches (a batch finishes before the next
starts) and once through `Server` (a finished request's slot is refilled at the next step).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from meshspeed.inference.inject import inject_kernels

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
ANCHOR = Path(os.environ.get("MESHSPEED_ANCHOR_PYTHON", "/root/.cache/meshspeed-anchors/bin/python"))


def machine_busy_s() -> float:
    """CPU seconds every process of the machine has been busy since boot (/proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process and its waited-for children (the DeepSpeed run)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def model_config(args) -> dict:
    return {"n_layer": args.layers, "n_embd": args.d_model, "n_head": args.heads, "vocab_size": args.vocab,
            "n_positions": args.max_len}


def build_model(cfg: dict):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    # no end-of-sequence token: every sequence runs its full length in every framework (an
    # eos with min_new_tokens would make HF mask that token's logit and pick another)
    config = GPT2Config(**cfg, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    return GPT2LMHeadModel(config).eval()


def prompts(batch: int, args, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded (batch, longest) ids and the attention mask; lengths in [min, max]."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(args.prompt_min, args.prompt_max + 1, (batch,), generator=g)
    longest = int(lengths.max())
    ids = torch.zeros(batch, longest, dtype=torch.long)
    mask = torch.zeros(batch, longest, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        ids[i, longest - n:] = torch.randint(1, args.vocab, (n,), generator=g)
        mask[i, longest - n:] = 1
    return ids, mask


def hf_generate(model, ids, mask, n):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                          pad_token_id=0, eos_token_id=None)


def meshspeed_generate(cache):
    def run(model, ids, mask, n):
        from meshspeed.inference.generation import generate

        return generate(model, ids, mask, max_new_tokens=n, pad_token_id=0, cache=cache)
    return run


def timed(fn, *a) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    with torch.no_grad():
        out = fn(*a)
    return time.perf_counter() - t0, out


def run_local(args) -> dict:
    """HF and meshspeed in this process, interleaved (Note [interleaved repeats])."""
    torch.set_num_threads(args.threads)
    model = build_model(model_config(args))
    injected = copy.deepcopy(model)
    inject_kernels(injected)  # replace_with_kernel_inject (inject.py)

    def with_injection(fn):
        return lambda _model, ids, mask, n: fn(injected, ids, mask, n)

    kinds = {"hf": hf_generate, "meshspeed paged": meshspeed_generate("paged"),
             "meshspeed contiguous": meshspeed_generate("contiguous"),
             "meshspeed paged, kernel inject": with_injection(meshspeed_generate("paged"))}
    out: dict = {}
    for batch in args.batches:
        ids, mask = prompts(batch, args, seed=batch)
        times = {k: {"first": [], "full": []} for k in kinds}
        tokens = {}
        for k, fn in kinds.items():  # warm-up (and the tokens to compare)
            timed(fn, model, ids, mask, 2)
            tokens[k] = timed(fn, model, ids, mask, args.new_tokens)[1]
        for _ in range(args.repeats):
            for k, fn in kinds.items():
                times[k]["first"].append(timed(fn, model, ids, mask, 1)[0])
                times[k]["full"].append(timed(fn, model, ids, mask, args.new_tokens)[0])
        out[batch] = {k: summarise(v, batch, args.new_tokens) for k, v in times.items()}
        for k in kinds:
            if k != "hf":
                out[batch][k]["same_tokens_as_hf"] = bool(torch.equal(tokens[k], tokens["hf"]))
        print(f"batch {batch}: " + ", ".join(f"{k} {v['tokens_per_s']:.0f} tok/s" for k, v in out[batch].items()),
              flush=True)
    return out


def summarise(times: dict, batch: int, n: int) -> dict:
    first, full = statistics.median(times["first"]), statistics.median(times["full"])
    return {"first_token_ms": 1e3 * first, "per_token_ms": 1e3 * (full - first) / max(n - 1, 1),
            "tokens_per_s": batch * n / full, "runs": len(times["full"])}


DS_SCRIPT = r'''
import json, os, statistics, sys, time
import torch
torch.set_num_threads(int(sys.argv[2]))
import deepspeed
from transformers import GPT2Config, GPT2LMHeadModel
spec = json.loads(open(sys.argv[1]).read())
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(**spec["cfg"], bos_token_id=None, eos_token_id=None, pad_token_id=0)).eval()
engine = deepspeed.init_inference(model, dtype=torch.float32, replace_with_kernel_inject=False)
out = {}
for batch, (ids, mask) in spec["prompts"].items():
    ids, mask = torch.tensor(ids), torch.tensor(mask)
    def gen(n):
        t0 = time.perf_counter()
        with torch.no_grad():
            toks = engine.module.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                                          pad_token_id=0, eos_token_id=None)
        return time.perf_counter() - t0, toks
    gen(2)
    first, full = [], []
    for _ in range(spec["repeats"]):
        first.append(gen(1)[0]); t, toks = gen(spec["n"]); full.append(t)
    out[batch] = {"first": first, "full": full, "tokens": toks.tolist()}
print("RESULT" + json.dumps(out))
'''


def run_deepspeed(args) -> dict | str:
    if not ANCHOR.exists():
        return f"DeepSpeed's venv is not built ({ANCHOR}); run ../shared/tools/anchor-venv.sh"
    spec = {"cfg": model_config(args), "repeats": args.repeats, "n": args.new_tokens,
            "prompts": {b: [t.tolist() for t in prompts(b, args, seed=b)] for b in args.batches}}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "spec.json"
        path.write_text(json.dumps(spec))
        script = Path(tmp) / "ds.py"
        script.write_text(DS_SCRIPT)
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": str(args.threads)}
        proc = subprocess.run([str(ANCHOR), str(script), str(path), str(args.threads)], capture_output=True,
                              text=True, env=env, timeout=3600, check=False, cwd=tmp)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")), None)
    if line is None:
        return f"DeepSpeed failed: {(proc.stderr or proc.stdout).strip().splitlines()[-1][:300]}"
    raw = json.loads(line[len("RESULT"):])
    return {int(b): {**summarise(v, int(b), args.new_tokens), "tokens": v["tokens"]} for b, v in raw.items()}


def run_batching(args) -> dict:
    from meshspeed.inference.runners import runner_for
    from meshspeed.inference.throughput import compare_batching, mixed_requests

    torch.set_num_threads(args.threads)
    model = build_model(model_config(args))
    runner = runner_for(model)
    requests = mixed_requests(args.stream, vocab_size=args.vocab, prompt_lengths=(args.prompt_min, args.prompt_max),
                              new_tokens=(4, 2 * args.new_tokens), seed=0)
    compare_batching(runner, requests[:8], max_batch=8)  # warm-up
    return compare_batching(runner, requests, max_batch=8)


def markdown(res: dict, args, command: str, machine: dict, wall_s: float) -> str:
    from zero_report import command_and_machine

    lines = [
        "## Generation: meshspeed against Hugging Face and DeepSpeed (`benchmarks/inference.py`)",
        "",
        (f"Hugging Face GPT-2 from a config, random weights: {args.layers} layers, d_model {args.d_model}, "
         f"{args.heads} heads, vocabulary {args.vocab}, fp32 on the CPU with {args.threads} thread(s). Prompts of "
         f"{args.prompt_min}-{args.prompt_max} random tokens, left padded; greedy, {args.new_tokens} new tokens per "
         f"sequence. Medians of {args.repeats} interleaved runs (Note [interleaved repeats]). \"kernel inject\": "
         "`replace_with_kernel_inject` (meshspeed/inference/inject.py: linear layers prepacked for oneDNN; not "
         "bit-identical, so its tokens may differ where two logits are within rounding). DeepSpeed 0.19.8's "
         "`init_inference` runs in its own venv and process, without kernel injection (CUDA only), i.e. HF's "
         f"generate inside its engine. Whole run: {wall_s:.0f} s, while other processes used "
         f"{res.get('other_load', 0):.0%} of the machine's CPU."),
        *command_and_machine(command, machine),
        "| batch | framework | first token ms | per token ms | tokens/s | vs HF | same tokens as HF |",
        "|---|---|---|---|---|---|---|",
    ]
    for batch in args.batches:
        rows = dict(res["local"][batch])
        ds = res["deepspeed"]
        if isinstance(ds, dict) and batch in ds:
            rows["deepspeed init_inference"] = ds[batch]
        hf = rows["hf"]["tokens_per_s"]
        for name, r in rows.items():
            same = r.get("same_tokens_as_hf", "—" if name == "hf" else "")
            same = {True: "yes", False: "**no**"}.get(same, same)
            lines.append(f"| {batch} | {name} | {r['first_token_ms']:.1f} | {r['per_token_ms']:.2f} | "
                         f"{r['tokens_per_s']:.0f} | {r['tokens_per_s'] / hf:.2f} | {same} |")
    if not isinstance(res["deepspeed"], dict):
        lines += ["", f"DeepSpeed: {res['deepspeed']}"]
    b = res.get("batching")
    if b:
        s, c = b["static"], b["continuous"]
        lines += ["", (f"Continuous batching, {args.stream} requests of mixed lengths, max_batch 8: static batches "
                       f"{s['tokens_per_s']:.0f} tokens/s in {s['decode_steps']} decode steps, `Server` "
                       f"{c['tokens_per_s']:.0f} tokens/s in {c['decode_steps']} ({c['tokens_per_s'] / s['tokens_per_s']:.2f}x); "
                       f"the same tokens for {b['agreement']:.0%} of the requests.")]
    lines += ["", "Targets (issue 16):", ""]
    for batch, want in ((8, 1.5), (1, 1.0)):
        if batch in res["local"]:
            r = res["local"][batch]
            exact = max(r["meshspeed paged"]["tokens_per_s"], r["meshspeed contiguous"]["tokens_per_s"])
            injected = r["meshspeed paged, kernel inject"]["tokens_per_s"]
            best = max(exact, injected)
            ratio = best / r["hf"]["tokens_per_s"]
            lines.append(f"- {'met' if ratio >= want else '**not met**'}: batch {batch}, meshspeed at least {want}x "
                         f"HF's tokens/s: {ratio:.2f}x (kernel inject {injected / r['hf']['tokens_per_s']:.2f}x, "
                         f"without {exact / r['hf']['tokens_per_s']:.2f}x)")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--d-model", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--prompt-min", type=int, default=16)
    ap.add_argument("--prompt-max", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--stream", type=int, default=48, help="requests in the continuous-batching stream")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--quick", action="store_true", help="small sizes, one repeat")
    ap.add_argument("--write-docs", action="store_true")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.write_docs:
        # lazy: benchmarks/ joins sys.path below the imports
        from docs_stamp import require_committed

        require_committed()  # refuse uncommitted code before the run, not after it
    if args.quick:
        args.repeats, args.new_tokens, args.batches, args.stream = 1, 8, [1, 8], 16
    t0, busy0, ours0 = time.time(), machine_busy_s(), own_cpu_s()
    res = {"local": run_local(args)}
    res["deepspeed"] = "skipped (--no-deepspeed)" if args.no_deepspeed else run_deepspeed(args)
    if isinstance(res["deepspeed"], dict):
        for batch, r in res["deepspeed"].items():
            hf_tokens = hf_generate(build_model(model_config(args)), *prompts(batch, args, seed=batch), args.new_tokens)
            r["same_tokens_as_hf"] = r.pop("tokens") == hf_tokens.tolist()
    res["batching"] = run_batching(args)
    wall_s = time.time() - t0
    others = machine_busy_s() - busy0 - (own_cpu_s() - ours0)
    res["other_load"] = max(0.0, others / (wall_s * (os.cpu_count() or 1)))
    from zero_report import machine_description, replace_section

    machine = machine_description()
    command = " ".join([".venv/bin/python", "benchmarks/inference.py", *(argv if argv is not None else sys.argv[1:])])
    text = markdown(res, args, command, machine, wall_s)
    print(text)
    if args.write_docs:
        replace_section(text, REPO / "docs" / "benchmarks.md", "inference.py")
        (REPO / "benchmarks" / "results" / "inference.json").write_text(
            json.dumps({"command": command, "machine": machine, "args": vars(args), "results": res}, indent=1,
                       default=str))
        print("wrote docs/benchmarks.md (inference.py section) and benchmarks/results/inference.json")


if __name__ == "__main__":
    main()
