"""Issue 34 item 4: the miniature HelloDeepSpeed of
tests/checkpoint/test_rank_dirs.py::test_hello_deepspeed_saves_and_resumes_unchanged (each rank
names its run directory from the clock and a random suffix, as DeepSpeedExamples'
train_bert_ds.py does), run on real DeepSpeed 0.19.8 (the anchor venv) and on meshspeed through
the `deepspeed` alias; prints both sides' losses before and after resuming, and their largest
relative difference.

    .venv/bin/python benchmarks/hello_deepspeed_resume.py            # driver, about 75 s
    HELLO_CLIP=absent .venv/bin/python benchmarks/hello_deepspeed_resume.py

The config says "gradient_clipping": 1.0 by default: DeepSpeed 0.19.3+ clips at 1.0 when the key
is missing and meshspeed does not (a documented departure, docs/deepspeed_compat.md);
HELLO_CLIP=absent leaves the key out, as the example does. On DeepSpeed the ranks' shards land
in their own directories, and it resumes only from the two merged by hand (the driver does it).
`python benchmarks/hello_deepspeed_resume.py worker ...` is one rank, spawned by the driver.
"""
import datetime
import json
import os
import random
import shutil
import socket
import string
import subprocess
import sys
import time

HERE = os.environ.get("HELLO_WORK", "/tmp/meshspeed_hello_ds")
DS_PY = "/root/.cache/meshspeed-anchors/bin/python"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MS_PY = os.path.join(REPO, ".venv", "bin", "python")
STEPS, SAVE_EVERY = 6, 3
CONFIG = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
          "bf16": {"enabled": True},
          "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}
if os.environ.get("HELLO_CLIP", "1.0") != "absent":
    CONFIG["gradient_clipping"] = float(os.environ.get("HELLO_CLIP", "1.0"))
if os.environ.get("HELLO_BF16", "1") == "0":  # probe only: the same run in fp32
    CONFIG["bf16"]["enabled"] = False
if os.environ.get("HELLO_TORCH_ADAM") == "1":  # probe only: DeepSpeed's torch.optim Adam, not cpu_adam
    CONFIG["optimizer"]["params"]["torch_adam"] = True


def worker(out_path, root, load_dirs_json):
    import torch

    torch.set_num_threads(1)
    import deepspeed  # real DeepSpeed, or meshspeed through the shim

    from meshspeed.models.gpt import GPT
    from meshspeed.testing.engines import TINY

    deepspeed.init_distributed(dist_backend="gloo")
    import torch.distributed as dist

    rank = dist.get_rank()
    load_dirs = json.loads(load_dirs_json)
    if load_dirs is None:  # the script: clock + random suffix on every rank, rank 0 mkdirs
        now = datetime.datetime.now()
        suffix = "".join(random.SystemRandom().choices(string.ascii_lowercase + string.digits, k=8))
        exp_dir = os.path.join(root, f"bert_pretrain.{now:%Y.%m.%d.%H.%M.%S}.{suffix}")
        if rank == 0:
            os.mkdir(exp_dir)
    else:
        exp_dir = load_dirs[rank]
    torch.manual_seed(42)
    model = GPT(TINY)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=json.loads(json.dumps(CONFIG)))
    start = 1
    if load_dirs is not None:
        _, client_state = engine.load_checkpoint(load_dir=load_dirs[rank], tag=f"global_step{SAVE_EVERY}")
        start = client_state["checkpoint_step"] + 1
    losses = {}
    for step in range(start, STEPS + 1):
        tokens = torch.randint(0, 16, (1, 4), generator=torch.Generator().manual_seed(1000 * step + rank))
        loss = engine(tokens, tokens)
        engine.backward(loss)
        engine.step()
        losses[step] = loss.float().item()
        if step % SAVE_EVERY == 0:
            engine.save_checkpoint(save_dir=exp_dir, client_state={"checkpoint_step": step})
    with open(out_path, "w") as f:
        json.dump({"exp_dir": exp_dir, "losses": losses}, f)
    dist.barrier()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(kind, tag, root, load_dirs, timeout=240):
    py = DS_PY if kind == "ds" else MS_PY
    path = REPO if kind == "ds" else f"{HERE}/shim:{REPO}"
    port = free_port()
    procs, outs = [], []
    for rank in range(2):
        out = f"{HERE}/out/{kind}{(os.environ.get('HELLO_BF16', '') + os.environ.get('HELLO_TORCH_ADAM', ''))}.{tag}.rank{rank}.json"
        if os.path.exists(out):
            os.remove(out)
        env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
                   CUDA_VISIBLE_DEVICES="", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        log = open(f"{HERE}/out/{kind}{(os.environ.get('HELLO_BF16', '') + os.environ.get('HELLO_TORCH_ADAM', ''))}.{tag}.rank{rank}.log", "w")
        procs.append(subprocess.Popen([py, __file__, "worker", out, root, json.dumps(load_dirs)],
                                      env=env, stdout=log, stderr=subprocess.STDOUT, cwd=HERE))
        outs.append(out)
    t0 = time.time()
    while any(p.poll() is None for p in procs) and time.time() - t0 < timeout:
        if any(p.poll() not in (None, 0) for p in procs):  # one rank died: the other would hang
            time.sleep(3)
            break
        time.sleep(0.5)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    results = []
    for rank, out in enumerate(outs):
        if os.path.exists(out):
            with open(out) as f:
                r = json.load(f)
            results.append({"exp_dir": r["exp_dir"], "losses": {int(k): v for k, v in r["losses"].items()}})
        else:
            with open(f"{HERE}/out/{kind}{(os.environ.get('HELLO_BF16', '') + os.environ.get('HELLO_TORCH_ADAM', ''))}.{tag}.rank{rank}.log") as f:
                lines = [ln for ln in f.read().splitlines() if ln.strip()]
            err = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1] if lines else "?")
            results.append({"error": err.strip()})
    return results


def tree(d):
    if not os.path.isdir(d):
        return f"{d}: (absent)"
    return f"{d}: " + ", ".join(sorted(os.path.relpath(os.path.join(a, f), d)
                                      for a, _, fs in os.walk(d) for f in fs))


def run_kind(kind):
    root = f"{HERE}/runs/{kind}" + (os.environ.get("HELLO_BF16", "") + os.environ.get("HELLO_TORCH_ADAM", ""))
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    first = launch(kind, "first", root, None)
    if any("error" in r for r in first):
        print(f"[{kind}] first run failed: {first}")
        return first, None, None
    dirs = [r["exp_dir"] for r in first]
    print(f"[{kind}] rank dirs: {dirs}")
    for d in dict.fromkeys(dirs):
        print(f"[{kind}]   {tree(d)}")
    # the script's resume: every rank loads the directory rank 0 printed
    attempts = [("rank0dir", [dirs[0], dirs[0]])]
    if kind == "ds":
        # what DeepSpeed can resume from otherwise: each rank its own directory, or the two
        # ranks' directories merged into one (by hand)
        merged = os.path.join(root, "merged")
        shutil.copytree(dirs[0], merged)
        shutil.copytree(dirs[1], merged, dirs_exist_ok=True)
        attempts += [("owndirs", dirs), ("merged", [merged, merged])]
    resumed, used = None, None
    for name, load_dirs in attempts:
        r = launch(kind, f"resume_{name}", root, load_dirs)
        ok = not any("error" in x for x in r)
        print(f"[{kind}] resume from {name} {load_dirs}: {'OK' if ok else [x.get('error') for x in r]}")
        if ok:
            resumed, used = r, name
            break
    return first, resumed, used


def main():
    os.makedirs(f"{HERE}/out", exist_ok=True)
    subprocess.run([MS_PY, "-c", f"from meshspeed.compat.install import write_shim; write_shim({HERE + '/shim'!r})"],
                   check=True, env={**os.environ, "PYTHONPATH": REPO})
    print("config:", json.dumps(CONFIG))
    res = {kind: run_kind(kind) for kind in ("ds", "ms")}
    worst = 0.0
    for rank in range(2):
        for kind in ("ds", "ms"):
            first, resumed, used = res[kind]
            if first and "losses" in first[rank]:
                print(f"{kind} rank {rank} uninterrupted 1-6: {[first[rank]['losses'][s] for s in range(1, 7)]}")
            if resumed:
                print(f"{kind} rank {rank} resumed ({used}) 4-6: {[resumed[rank]['losses'][s] for s in range(4, 7)]}")
        ds_first, ds_res, _ = res["ds"]
        ms_first, ms_res, _ = res["ms"]
        pairs = []
        if ds_first and ms_first and "losses" in ds_first[rank] and "losses" in ms_first[rank]:
            pairs += [(ds_first[rank]["losses"][s], ms_first[rank]["losses"][s]) for s in range(1, 7)]
        if ds_res and ms_res:
            pairs += [(ds_res[rank]["losses"][s], ms_res[rank]["losses"][s]) for s in range(4, 7)]
        for a, b in pairs:
            worst = max(worst, abs(a - b) / abs(a))
        for kind in ("ds", "ms"):
            f, r, _ = res[kind]
            if f and r:
                same = all(r[rank]["losses"][s] == f[rank]["losses"][s] for s in range(4, 7))
                print(f"{kind} rank {rank}: resumed 4-6 == uninterrupted 4-6 bit-exactly: {same}")
    print(f"max relative difference meshspeed vs DeepSpeed (all steps, both ranks, both runs): {worst:.3e}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker(*sys.argv[2:5])
    else:
        main()
