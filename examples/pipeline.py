"""Pipeline parallelism with `engine.train_batch()`: the GPT's layers cut into 2 stages.

    meshspeed run --nproc-per-node 2 examples/pipeline.py --steps 30 --schedule 1f1b

`GPTPipe` is the reference GPT as a `PipelineModule` (DeepSpeed's class: a list of layer
specs; each stage builds only its own layers). One `train_batch` call is one optimizer
step over `gradient_accumulation_steps` micro-batches, scheduled across the stages by
--schedule (1f1b, gpipe, zb-h1). With 4 processes the same script runs pp 2 x dp 2.
docs/pipeline.md describes the schedules and what each stage holds.
"""

import argparse

import torch

import meshspeed
from meshspeed import comm
from meshspeed.data import ByteWindows, RepeatingLoader, stdlib_corpus
from meshspeed.models import GPTConfig
from meshspeed.models.gpt_pipe import GPTPipe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages (default 2)")
    parser.add_argument("--schedule", default="1f1b", help="1f1b, gpipe or zb-h1 (default 1f1b)")
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step (default 4)")
    parser.add_argument("--print-every", type=int, default=5,
                        help="the library prints a step line every N steps (steps_per_print; default 5)")
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # DeepSpeed launchers
    args = parser.parse_args()

    torch.set_num_threads(1)
    meshspeed.init_distributed()
    cfg = GPTConfig(vocab_size=256, max_seq_len=64, n_layer=4, n_head=4, d_model=64)
    net = GPTPipe(cfg, num_stages=args.stages)  # each rank builds only its stage's layers
    train_set, _ = ByteWindows(stdlib_corpus(200_000), seq_len=64).split(0.98)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": args.print_every,  # rank 0 prints "[meshspeed] step N, loss X, ..."
        "gradient_accumulation_steps": args.micro_batches,  # micro-batches in flight per step
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 1},
        "pipeline": {"schedule": args.schedule},
    }
    engine, _, loader, _ = meshspeed.initialize(model=net, model_parameters=net.parameters(),
                                                training_data=train_set, config=config)
    rank0 = comm.get_rank() == 0
    if rank0:
        print(engine.mesh, flush=True)
    batches = iter(RepeatingLoader(loader))  # yields (ids, targets) micro-batches
    for step in range(1, args.steps + 1):
        loss = engine.train_batch(batches)  # reads --micro-batches of them; the mean loss on every rank
    if rank0 and args.steps % args.print_every:  # the last step fell between the library's lines
        print(f"final loss {loss.item():.4f} after {step} steps", flush=True)


if __name__ == "__main__":
    main()
