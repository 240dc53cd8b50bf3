"""Tensor parallelism with sequence parallelism on 4 processes: tp 2 x dp 2.

    meshspeed run --nproc-per-node 4 examples/tp_sp.py --steps 30

Each attention and MLP layer is split over the 2 ranks of a tensor-parallel group
(Megatron-style column/row splits); with "sequence_parallel" the norms and the residual
stream between them hold 1/2 of the sequence on each rank. The remaining factor of the
world, 2, is data parallelism, and ZeRO (stage 1 here) shards over it. The model code is
unchanged: `initialize` rewrites its layers. docs/tensor_parallel.md says which bytes
each layer shards and which collective moves them.
"""

import argparse

import torch

import meshspeed
from meshspeed import comm
from meshspeed.data import ByteWindows, RepeatingLoader, stdlib_corpus
from meshspeed.models import GPT, GPTConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (default 2)")
    parser.add_argument("--print-every", type=int, default=5,
                        help="the library prints a step line every N steps (steps_per_print; default 5)")
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # DeepSpeed launchers
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)  # every rank builds the same weights before they are split
    meshspeed.init_distributed()
    model = GPT(GPTConfig(vocab_size=256, max_seq_len=64, n_layer=2, n_head=4, d_model=64))
    train_set, _ = ByteWindows(stdlib_corpus(200_000), seq_len=64).split(0.98)
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "steps_per_print": args.print_every,  # rank 0 prints "[meshspeed] step N, loss X, ..."
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 1},
        "tensor_parallel": {"autotp_size": args.tp},
    }
    if args.tp > 1:  # the norms' sequence split, and each split matmul overlapped with its collective
        config["tensor_parallel"].update(sequence_parallel=True, tp_overlap_comm=True)
    engine, _, loader, _ = meshspeed.initialize(model=model, model_parameters=model.parameters(),
                                                training_data=train_set, config=config)
    rank0 = comm.get_rank() == 0
    if rank0:
        print(engine.mesh, flush=True)  # the degrees, then this rank's groups
        wq = engine.module.layers[0].attn.wq.weight
        print(f"layers[0].attn.wq holds {tuple(wq.shape)} on each rank (whole: (64, 64)); "
              f"sequence parallel {args.tp > 1}", flush=True)

    # what the norms see: with sequence parallelism, each rank's part of the sequence
    seen = {}

    def record(module, inputs, output) -> None:
        seen.setdefault("x", tuple(inputs[0].shape))

    engine.module.layers[0].mlp_norm.register_forward_hook(record)
    batches = iter(RepeatingLoader(loader))  # the loader splits over dp; both tp ranks read the same batch
    for step in range(1, args.steps + 1):
        ids, targets = next(batches)
        loss = engine(ids, targets)
        engine.backward(loss)
        engine.step()
        if rank0 and step == 1:
            print(f"the norms' input on each rank: {seen['x']} (batch, sequence, width) "
                  f"of a ({ids.shape[0]}, {ids.shape[1]}, 64) batch", flush=True)
    if rank0 and args.steps % args.print_every:  # the last step fell between the library's lines
        print(f"final loss {loss.item():.4f} after {step} steps", flush=True)


if __name__ == "__main__":
    main()
