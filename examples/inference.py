"""Inference: `init_inference`, `generate` with a KV cache, and the continuous-batching `Server`.

    python examples/inference.py --checkpoint ckpt          # the model zero3_checkpoint.py saved
    python examples/inference.py                            # random weights: the text is noise
    meshspeed run --nproc-per-node 2 examples/inference.py --tp 2 --checkpoint ckpt

`meshspeed.init_inference(model, tensor_parallel={"tp_size": N}, dtype=..., checkpoint=...)`
takes DeepSpeed's keys; `checkpoint` reads a meshspeed (or DeepSpeed-layout, Hugging Face,
safetensors) checkpoint straight into each rank's shard, whatever ZeRO stage or world size
wrote it. `engine.generate` prefills a batch of prompts and decodes over a KV cache;
`Server` admits requests as others finish (continuous batching over a paged cache).
docs/inference.md lists the keys, the caches, sampling and quantization. After the
checkpoint example's few steps the text is mostly spaces and common letters; a model
trained longer (`--steps 2000`) writes something closer to Python.
"""

import argparse

import torch

import meshspeed
from meshspeed import comm
from meshspeed.inference import Server
from meshspeed.models import GPT, GPTConfig

PROMPTS = [b"def ", b"import os\n", b"class Foo(", b"    return "]


def text(tokens) -> str:
    return bytes(tokens).decode("utf-8", errors="replace")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default=None, metavar="DIR",
                        help="a checkpoint folder of examples/zero3_checkpoint.py (default: random weights)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (launch that many processes)")
    parser.add_argument("--new-tokens", type=int, default=24, help="tokens to generate per prompt (default 24)")
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # DeepSpeed launchers
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    if args.tp > 1:
        meshspeed.init_distributed()
    # the shape examples/zero3_checkpoint.py trains
    model = GPT(GPTConfig(vocab_size=256, max_seq_len=64, n_layer=2, n_head=4, d_model=64))
    engine = meshspeed.init_inference(model, tensor_parallel={"tp_size": args.tp}, dtype="fp32",
                                      max_out_tokens=64, checkpoint=args.checkpoint)
    rank0 = args.tp == 1 or comm.get_rank() == 0

    # generate: a batch of prompts of different lengths, greedy
    prompts = [list(p) for p in PROMPTS]
    # out: (prompts, longest prompt + new tokens), shorter prompts left-padded
    out = engine.generate(prompts, max_new_tokens=args.new_tokens)
    if rank0:
        if engine.load_stats is not None:
            print(f"loaded {args.checkpoint}: {engine.load_stats.tensors} tensors, "
                  f"{engine.load_stats.bytes_read:,} bytes read by this rank")
        print("--- engine.generate (greedy) ---")
        for prompt, row in zip(prompts, out.tolist()):
            print(f"{text(prompt)!r} -> {text(row[-args.new_tokens:])!r}")

    # Server: requests join the running batch as others finish; max_batch 2 makes them queue
    server = Server(engine.module_or_runner, max_batch=2, max_tokens=64)
    for i, prompt in enumerate(prompts):
        server.submit(prompt, max_new_tokens=args.new_tokens // (i + 1), do_sample=True, top_k=20, seed=i)
    finished = server.run_until_done()
    if rank0:
        print("--- Server (sampled, top-k 20; in the order they finished) ---")
        for request in finished:
            print(f"request {request.id}: {text(request.prompt.tolist())!r} -> {text(request.tokens)!r}")
        print(f"server: {server.stats}")


if __name__ == "__main__":
    main()
