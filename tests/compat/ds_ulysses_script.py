"""A DeepSpeed-Ulysses training script written for DeepSpeed, NOT edited for meshspeed.

It has the shape of Megatron-DeepSpeed's sequence parallelism with flash attention: the
attention core of each block is `DistributedAttention(local_attention, sequence_group,
scatter_idx=2, gather_idx=1)` over a group the script makes with `dist.new_group`, called
batch-first as `dist_attn(q, k, v, batch_dim_idx=0, rotary_pos_emb=(cos, sin))` with
Megatron's [S, 1, 1, d] rotary table of the whole sequence; grouped-query attention (4
query heads, 2 key/value heads); `deepspeed.add_config_arguments`, `--local_rank`,
`deepspeed.init_distributed`, `deepspeed.initialize(args=..., model=..., model_parameters=...)`,
`engine(...)`, `engine.backward`, `engine.step`. Every rank reads the same batch and keeps
its contiguous slice of the sequence; the config is a plain data-parallel one (the engine
averages the ranks' gradients, which for equal slices is the gradient of the mean loss over
all tokens). The test (tests/compat/test_ulysses_script.py) runs it on two CPU ranks.

What it prints, rank 0:
    LOSS step=<s> loss=<float>     the mean loss over every token of the batch, each step
    PARAMS norm=<float>            the parameters' L2 norm after the last step
"""

import argparse

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.sequence.layer import DistributedAttention
from torch import nn

VOCAB, D_MODEL, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 64, 32, 4, 2, 8, 2
SEQ, BATCH, SEED = 16, 2, 1234


def rotary_table(seq_len):
    """Megatron's rotary embedding: cos and sin of shape [S, 1, 1, HEAD_DIM]."""
    inv = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    angles = torch.arange(seq_len, dtype=torch.float32)[:, None] * inv[None, :]
    emb = torch.cat((angles, angles), dim=-1)[:, None, None, :]
    return emb.cos(), emb.sin()


def apply_rotary(t, cos, sin):
    """t [b, S, h, d] with cos, sin [1, S, 1, d]: rotate-half rotary."""
    x1, x2 = t.chunk(2, dim=-1)
    return t * cos + torch.cat((-x2, x1), dim=-1) * sin


class LocalAttention(nn.Module):
    """Causal attention over the whole sequence, batch-first [b, S, heads, d]."""

    def forward(self, q, k, v):
        rep = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return out.transpose(1, 2)


class UlyssesCore(nn.Module):
    """The attention core under sequence parallelism: DeepSpeed's DistributedAttention."""

    def __init__(self, group):
        super().__init__()
        self.dist_attn = DistributedAttention(LocalAttention(), group, scatter_idx=2, gather_idx=1)

    def forward(self, q, k, v, freqs):
        return self.dist_attn(q, k, v, 0, freqs)


class FullCore(nn.Module):
    """The same core on one process holding the whole sequence (the reference)."""

    def __init__(self):
        super().__init__()
        self.attn = LocalAttention()

    def forward(self, q, k, v, freqs):
        cos, sin = (f.permute(1, 0, 2, 3) for f in freqs)
        return self.attn(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v)


class Block(nn.Module):
    def __init__(self, core):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.qkv = nn.Linear(D_MODEL, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
        self.proj = nn.Linear(HEADS * HEAD_DIM, D_MODEL)
        self.mlp = nn.Sequential(nn.Linear(D_MODEL, 4 * D_MODEL), nn.GELU(), nn.Linear(4 * D_MODEL, D_MODEL))
        self.core = core

    def forward(self, x, freqs):  # x [b, s, D_MODEL]
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
        q, k, v = q.view(b, s, HEADS, HEAD_DIM), k.view(b, s, KV_HEADS, HEAD_DIM), v.view(b, s, KV_HEADS, HEAD_DIM)
        x = x + self.proj(self.core(q, k, v, freqs).reshape(b, s, HEADS * HEAD_DIM))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, make_core):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.blocks = nn.ModuleList([Block(make_core()) for _ in range(LAYERS)])
        self.norm = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB)

    def forward(self, ids, freqs):  # ids [b, s] -> logits [b, s, VOCAB]
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, freqs)
        return self.head(self.norm(x))


def batch(step):
    """(ids, targets), [BATCH, SEQ] each: a learnable next-symbol rule over random ids."""
    ids = torch.randint(VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
    return ids, (ids * 7 + ids.roll(1, dims=1) + 3) % VOCAB


def main():
    parser = argparse.ArgumentParser(description="DeepSpeed-Ulysses, small")
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by the launcher")
    parser.add_argument("--steps", type=int, default=4)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)

    deepspeed.init_distributed(dist_backend="gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    sequence_group = dist.new_group(list(range(world)))  # every rank holds a slice of each sequence

    torch.manual_seed(SEED)
    model = TinyLM(lambda: UlyssesCore(sequence_group))
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())

    freqs = rotary_table(SEQ)
    local = SEQ // world
    for step in range(args.steps):
        ids, targets = batch(step)
        ids, targets = ids[:, rank * local:(rank + 1) * local], targets[:, rank * local:(rank + 1) * local]
        logits = engine(ids, freqs)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"LOSS step={step + 1} loss={float(mean) / world!r}", flush=True)
    norm = torch.cat([p.detach().flatten() for p in engine.module.parameters()]).norm()
    if rank == 0:
        print(f"PARAMS norm={float(norm)!r}", flush=True)


if __name__ == "__main__":
    main()
