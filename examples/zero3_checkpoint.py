"""ZeRO-3 training with checkpoints: train, save, stop; then resume where it stopped.

    meshspeed run --nproc-per-node 2 examples/zero3_checkpoint.py --steps 40 --save-dir ckpt
    meshspeed run --nproc-per-node 2 examples/zero3_checkpoint.py --steps 40 --save-dir ckpt --resume

A small byte-level GPT learns the Python standard library's own source (on every machine,
no download). ZeRO stage 3 shards parameters, gradients and optimizer state over the ranks.
The first command saves a checkpoint every --save-every steps and at the end; the second
loads the latest one (weights, optimizer, LR schedule and the data loader's position) and
trains --steps more, so its step numbers and loss carry on from the first run's.
`python examples/zero3_checkpoint.py ...` runs the same thing as a one-process world.
"""

import argparse

import torch

import meshspeed
from meshspeed import comm
from meshspeed.data import ByteWindows, RepeatingLoader, stdlib_corpus
from meshspeed.models import GPT, GPTConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps this run (default 40)")
    parser.add_argument("--save-dir", default="ckpt", help="checkpoint folder (default ckpt)")
    parser.add_argument("--save-every", type=int, default=20, help="save every N steps (default 20)")
    parser.add_argument("--resume", action="store_true", help="load the latest checkpoint in --save-dir first")
    parser.add_argument("--print-every", type=int, default=5,
                        help="the library prints a step line every N steps (steps_per_print; default 5)")
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # DeepSpeed launchers
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    meshspeed.init_distributed()
    model = GPT(GPTConfig(vocab_size=256, max_seq_len=64, n_layer=2, n_head=4, d_model=64))
    train_set, _ = ByteWindows(stdlib_corpus(200_000), seq_len=64).split(0.98)
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "steps_per_print": args.print_every,  # rank 0 prints "[meshspeed] step N, loss X, ..."
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 3e-3}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 3},
    }
    engine, _, loader, _ = meshspeed.initialize(model=model, model_parameters=model.parameters(),
                                                training_data=train_set, config=config)
    if args.resume:
        path, _ = engine.load_checkpoint(args.save_dir)  # the tag in <save-dir>/latest
        if comm.get_rank() == 0:
            print(f"resumed from {path} at step {engine.global_steps}", flush=True)

    batches = iter(RepeatingLoader(loader))  # batches of (ids, targets), each (micro, seq_len)
    last = engine.global_steps + args.steps
    while engine.global_steps < last:
        ids, targets = next(batches)
        loss = engine(ids, targets)
        engine.backward(loss)
        engine.step()
        step = engine.global_steps  # the library prints loss and lr every --print-every steps
        if step % args.save_every == 0 or step == last:
            engine.save_checkpoint(args.save_dir)  # every rank writes its shards
    if comm.get_rank() == 0:
        if args.steps and step % args.print_every:  # the last step fell between the library's lines
            print(f"final loss {loss.item():.4f} after {step} steps", flush=True)
        print(f"saved {args.save_dir} at step {engine.global_steps}", flush=True)


if __name__ == "__main__":
    main()
