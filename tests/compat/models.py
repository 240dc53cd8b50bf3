"""Tiny models the DeepSpeed-compatibility tests build: Hugging Face GPT-2, OPT and Llama from
configs (random weights, nothing downloaded, dropout off so that runs compare exactly) and
meshspeed's reference GPT."""

from __future__ import annotations

import contextlib

import torch

KINDS = ["gpt2", "opt", "llama", "gpt", "inits"]
VOCAB = 64


class Inits(torch.nn.Module):
    """torch.nn.init's functions the way model code calls them, including those that look
    at the values they draw (trunc_normal_ redraws until in bounds, orthogonal_ is a QR),
    parameters made from random factories, partial and `.data` writes, a value read back
    with `.item()`, and buffers computed while building."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.a = nn.Parameter(torch.empty(16, 8))
        self.b = nn.Parameter(torch.empty(8, 8))
        self.c = nn.Parameter(torch.empty(4, 4, 3))
        self.d = nn.Parameter(torch.randn(6, 5) * 0.1)
        self.e = nn.Embedding(10, 4, padding_idx=2)
        self.lstm = nn.LSTM(4, 4)
        nn.init.trunc_normal_(self.a, std=0.5, a=-0.4, b=0.4)
        nn.init.orthogonal_(self.b)
        nn.init.kaiming_normal_(self.c, mode="fan_out")
        nn.init.xavier_uniform_(self.e.weight)
        self.e.weight.data[3].uniform_(-1, 1)
        scale = float(self.a.detach().abs().max().item())  # a value read while building
        with torch.no_grad():
            self.d.mul_(scale)
        self.register_buffer("freqs", 1.0 / (100.0 ** (torch.arange(0, 8, 2).float() / 8)))
        self.register_buffer("mask", torch.tril(torch.ones(4, 4)).bool(), persistent=False)


def build(kind: str) -> torch.nn.Module:
    if kind == "inits":
        return Inits()
    if kind == "gpt":
        from meshspeed.models.gpt import GPT, GPTConfig

        return GPT(GPTConfig(vocab_size=VOCAB, max_seq_len=16, n_layer=2, n_head=2, d_model=32,
                             tie_embeddings=True))
    import transformers as hf

    ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    if kind == "gpt2":
        return hf.GPT2LMHeadModel(hf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB,
                                                n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                                                attn_pdrop=0.0, **ids))
    if kind == "opt":
        return hf.OPTForCausalLM(hf.OPTConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                              ffn_dim=64, vocab_size=VOCAB, max_position_embeddings=16,
                                              word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0, **ids))
    if kind == "llama":
        return hf.LlamaForCausalLM(hf.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                                  num_key_value_heads=1, intermediate_size=64, vocab_size=VOCAB,
                                                  max_position_embeddings=16, **ids))
    raise ValueError(kind)


def loss(kind: str, model, batch: torch.Tensor) -> torch.Tensor:
    """Next-token loss on `batch` (B, T + 1), however the model takes its inputs."""
    if kind == "gpt":
        return model(batch[:, :-1], batch[:, 1:])
    return model(input_ids=batch, labels=batch).loss


def batches(steps: int, micro: int = 2, seq: int = 9, seed: int = 5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (micro, seq), generator=g) for _ in range(steps)]


@contextlib.contextmanager
def one_thread():
    """The ranks compute on one thread; a one-process reference must too, to sum in the
    same order (exact comparisons)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
