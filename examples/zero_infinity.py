"""ZeRO-Infinity: every model state in swap files on NVMe (here: any local folder).

    meshspeed run --nproc-per-node 2 examples/zero_infinity.py --steps 10 --nvme-path /local_nvme

ZeRO stage 3 with `offload_param` and `offload_optimizer` on "nvme" keeps the 16-bit
parameter shards, fp32 masters, Adam moments and gradients in files under --nvme-path
(one folder per rank); host memory holds bounded buffers, whose size comes from the config
(`sub_group_size`, `buffer_count`, `buffer_size`), not from the model. `zero.Init` builds
the model already partitioned, so no rank ever holds it whole. The model is small so the
example runs in seconds; docs/infinity.md trains a 2B-parameter one the same way, and
`meshspeed estimate --params 2e9 --stage 3 --offload-optimizer nvme --offload-param nvme`
itemises the buffers. Without --nvme-path the files go to a temporary folder.
"""

import argparse
import os
import tempfile

import torch

import meshspeed
from meshspeed import comm
from meshspeed.data import ByteWindows, RepeatingLoader, stdlib_corpus
from meshspeed.models import GPT, GPTConfig


def file_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


def train(args, nvme_path: str) -> None:
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": args.print_every,  # rank 0 prints "[meshspeed] step N, loss X, ..."
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 1_000_000,  # fp32 elements per optimizer step group: sizes the host buffers
            "offload_param": {"device": "nvme", "nvme_path": nvme_path},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path},
        },
    }
    with meshspeed.zero.Init(dtype=torch.bfloat16):  # each parameter partitioned as it is built
        model = GPT(GPTConfig(vocab_size=256, max_seq_len=64, n_layer=args.layers, n_head=4, d_model=128))
    train_set, _ = ByteWindows(stdlib_corpus(200_000), seq_len=64).split(0.98)
    engine, _, loader, _ = meshspeed.initialize(model=model, model_parameters=model.parameters(),
                                                training_data=train_set, config=config)
    rank0 = comm.get_rank() == 0
    batches = iter(RepeatingLoader(loader))
    for step in range(1, args.steps + 1):
        ids, targets = next(batches)
        loss = engine(ids, targets)
        engine.backward(loss)
        engine.step()  # every --print-every steps the library prints the step's loss
    if rank0 and args.steps % args.print_every:  # the last step fell between the library's lines
        print(f"final loss {loss.item():.4f} after {step} steps", flush=True)
    comm.barrier()  # every rank's files are written before rank 0 measures the folder
    if rank0:
        split = {k: v for k, v in engine.memory_breakdown().items() if isinstance(v, dict)}
        for key, tiers in split.items():
            print(f"{key}: " + ", ".join(f"{tier} {n / 2**20:.2f} MiB" for tier, n in tiers.items()))
        print(f"swap files under {nvme_path}: {file_bytes(nvme_path) / 2**20:.2f} MiB", flush=True)
    engine.destroy()  # waits for background writes, closes and removes this rank's swap files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps (default 10)")
    parser.add_argument("--nvme-path", default=None, metavar="DIR",
                        help="an existing folder for the swap files (default: a temporary folder)")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    parser.add_argument("--print-every", type=int, default=2,
                        help="the library prints a step line every N steps (steps_per_print; default 2)")
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # DeepSpeed launchers
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    meshspeed.init_distributed()
    if args.nvme_path is not None:
        train(args, args.nvme_path)
    else:
        with tempfile.TemporaryDirectory(prefix="meshspeed-infinity-") as folder:  # one per rank
            train(args, folder)

if __name__ == "__main__":
    main()
