"""A Hugging Face `transformers` model built from its config (random weights, nothing
downloaded), trained with tensor parallelism and ZeRO.

    meshspeed run --nproc-per-node 2 examples/hf_model.py --steps 20 --tp 2

`initialize` takes the `transformers` model as it is: with "tensor_parallel" it splits the
Llama's attention and MLP projections over the tp ranks (AutoTP; Llama, Mistral, Qwen2 and
GPT-2 families), and the loop is Hugging Face's own calling form,
`engine(input_ids=..., labels=...).loss`. To start from trained weights, use
`AutoModelForCausalLM.from_pretrained(...)` instead of `from_config` (ZeRO-3 builds it
partitioned inside `meshspeed.zero.Init`).
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import meshspeed
from meshspeed import comm
from meshspeed.data import ByteWindows, RepeatingLoader, stdlib_corpus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (default 2)")
    parser.add_argument("--stage", type=int, default=1, choices=[0, 1, 2, 3], help="ZeRO stage (default 1)")
    parser.add_argument("--print-every", type=int, default=5,
                        help="the library prints a step line every N steps (steps_per_print; default 5)")
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # DeepSpeed launchers
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)  # every rank builds the same weights before they are split
    meshspeed.init_distributed()
    llama = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(llama)  # byte-level vocabulary: token id = byte
    train_set, _ = ByteWindows(stdlib_corpus(200_000), seq_len=64).split(0.98)
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "steps_per_print": args.print_every,  # rank 0 prints "[meshspeed] step N, loss X, ..."
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": args.stage},
        "tensor_parallel": {"autotp_size": args.tp},
    }
    engine, _, loader, _ = meshspeed.initialize(model=model, model_parameters=model.parameters(),
                                                training_data=train_set, config=config)
    rank0 = comm.get_rank() == 0
    if rank0:
        print(engine.mesh, flush=True)
        q = model.model.layers[0].self_attn.q_proj.weight
        print(f"{type(model).__name__}: q_proj holds {tuple(q.shape)} on each rank (whole: (64, 64))",
              flush=True)
    batches = iter(RepeatingLoader(loader))
    for step in range(1, args.steps + 1):
        ids, _ = next(batches)  # transformers shifts the labels itself
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()  # every --print-every steps the library prints the step's loss
    if rank0 and args.steps % args.print_every:  # the last step fell between the library's lines
        print(f"final loss {loss.item():.4f} after {step} steps", flush=True)


if __name__ == "__main__":
    main()
