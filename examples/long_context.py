"""Long context: each sequence split over 2 ranks (Ring Attention, or Ulysses).

    meshspeed run --nproc-per-node 2 examples/long_context.py --steps 20 --mode ring_balanced

The context-parallel axis of the mesh holds slices of the same sequences: every rank keeps
1/cp of each sequence's tokens, and attention is the one layer that talks to the others
("ulysses": all-to-alls over heads; "ring", "ring_balanced": K/V passed around a ring).
The model and the loop do not change: `engine(ids, targets)` takes whole sequences and
each rank keeps its part; the loss returned is the whole sequences' loss on every rank.
docs/long_context.md says what each mode moves and holds.
"""

import argparse

import torch

import meshspeed
from meshspeed import comm
from meshspeed.data import ByteWindows, RepeatingLoader, stdlib_corpus
from meshspeed.models import GPT, GPTConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    parser.add_argument("--cp", type=int, default=2, help="context-parallel degree (default 2)")
    parser.add_argument("--mode", default="ring_balanced", choices=["ring_balanced", "ring", "ulysses"],
                        help="how attention crosses the ranks (default ring_balanced)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    parser.add_argument("--print-every", type=int, default=5,
                        help="the library prints a step line every N steps (steps_per_print; default 5)")
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # DeepSpeed launchers
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    meshspeed.init_distributed()
    model = GPT(GPTConfig(vocab_size=256, max_seq_len=args.seq_len, n_layer=2, n_head=4, d_model=64))
    train_set, _ = ByteWindows(stdlib_corpus(400_000), seq_len=args.seq_len).split(0.98)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": args.print_every,  # rank 0 prints "[meshspeed] step N, loss X, ..."
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2},  # shards over dp x cp
        "context_parallel": {"size": args.cp, "mode": args.mode},
    }
    engine, _, loader, _ = meshspeed.initialize(model=model, model_parameters=model.parameters(),
                                                training_data=train_set, config=config)
    rank0 = comm.get_rank() == 0
    if rank0:
        print(engine.mesh, flush=True)
        print(f"{args.seq_len} tokens per sequence, {args.seq_len // args.cp} on each rank ({args.mode})",
              flush=True)
    batches = iter(RepeatingLoader(loader))  # the cp ranks of a dp group read the same sequences
    for step in range(1, args.steps + 1):
        ids, targets = next(batches)  # whole sequences, (micro, seq_len)
        loss = engine(ids, targets)
        engine.backward(loss)
        engine.step()  # every --print-every steps the library prints the step's loss
    if rank0 and args.steps % args.print_every:  # the last step fell between the library's lines
        print(f"final loss {loss.item():.4f} after {step} steps", flush=True)


if __name__ == "__main__":
    main()
