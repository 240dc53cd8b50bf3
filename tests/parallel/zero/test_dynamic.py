"""Stage 3 under changing execution order, unused blocks, and user-modified parameters."""

import torch
from torch import nn

import meshspeed
from meshspeed import comm
from meshspeed.models.gpt import GPT, GPTConfig
from meshspeed.testing import run_distributed
from meshspeed.zero import GatheredParameters

CFG = GPTConfig(vocab_size=64, max_seq_len=16, n_layer=3, n_head=2, d_model=32)


class SkippingGPT(GPT):
    """Runs a different subset and order of blocks on every call (the same on all ranks),
    so the prefetch order recorded in one step is wrong in the next."""

    plans = ([0, 1, 2], [2, 0], [1], [0, 2, 1])

    def __init__(self, cfg):
        super().__init__(cfg)
        self.calls = 0

    def forward(self, idx, targets):
        order = self.plans[self.calls % len(self.plans)]
        self.calls += 1
        x = self.tok_emb(idx)
        for i in order:
            x = self.layers[i](x)
        logits = self.lm_head(self.norm(x))
        return nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def _data(steps, world):
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, CFG.vocab_size, (steps, world * 2, CFG.max_seq_len + 1), generator=g)


def _reference(steps, world):
    torch.manual_seed(0)
    model = SkippingGPT(CFG)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for batch in _data(steps, world):
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        # meshspeed (like DeepSpeed) gives a parameter that no rank used a zero gradient,
        # so momentum and weight decay keep acting on it; torch DDP would leave it alone
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _distributed(steps, prefetch):
    world, rank = comm.get_world_size(), comm.get_rank()
    torch.manual_seed(0)
    model = SkippingGPT(CFG)
    engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "stage3_prefetch_bucket_size": prefetch}})
    losses = []
    for batch in _data(steps, world):
        rows = batch[rank * 2:(rank + 1) * 2]
        loss = engine(rows[:, :-1], rows[:, 1:])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        comm.all_reduce(total, op="avg")
        losses.append(total.item())
    with GatheredParameters(list(engine.module.parameters())):
        state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return losses, state, engine.memory_breakdown()["gathered_params"]


def test_changing_order_and_unused_blocks_match_reference():
    ref_losses, ref_state = _reference(8, 2)
    for prefetch in (10**9, 0):
        losses, state, gathered = run_distributed(_distributed, world_size=2, args=(8, prefetch))[0]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for name in ref_state:
            torch.testing.assert_close(state[name], ref_state[name], rtol=1e-5, atol=1e-6)
        assert gathered == 0  # prefetched-but-unused blocks were released


def _modify(stage, precision):
    torch.manual_seed(0)
    model = GPT(CFG)
    config = {"train_micro_batch_size_per_gpu": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    weight = engine.module.layers[1].mlp.w2.weight
    with GatheredParameters([weight], modifier_rank=0):
        # only rank 0's edit counts; the others' must be overwritten
        weight.data.fill_(0.5 if comm.get_rank() == 0 else -7.0)
    tokens = torch.randint(0, 64, (2, 17))
    engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
    engine.step()  # lr 0: masters -> params round trip must keep the edit
    with GatheredParameters([weight]):
        seen = weight.detach().float().clone()
    masters = [s.master for s in engine.strategy.owned_slices() if s.name == "layers.1.mlp.w2.weight"]
    return seen, masters[0].detach().clone()


def test_gathered_parameters_modifier_rank_updates_every_copy():
    for stage in (0, 1, 3):
        for precision in ("fp32", "bf16"):
            for seen, master in run_distributed(_modify, world_size=2, args=(stage, precision)):
                assert torch.all(seen == 0.5), (stage, precision)
                assert torch.all(master == 0.5), (stage, precision)


def _released_and_state_dict():
    torch.manual_seed(0)
    model = GPT(CFG)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
        "zero_optimization": {"stage": 3}})
    weight = engine.module.layers[0].attn.wq.weight
    outside = weight.numel()
    try:  # a released parameter fails like an empty tensor, never reads freed memory
        weight @ torch.ones(CFG.d_model)
        error = None
    except RuntimeError as err:
        error = str(err)
    state = engine.state_dict()
    twin = GPT(CFG)
    engine.load_state_dict(twin.state_dict())
    reloaded = engine.state_dict()
    return outside, error, state, reference, reloaded, twin.state_dict()


def test_released_parameters_are_empty_and_state_dict_is_whole():
    outside, error, state, reference, reloaded, twin = run_distributed(_released_and_state_dict, world_size=2)[1]
    assert outside == 0 and error is not None
    for name, value in reference.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0)
        torch.testing.assert_close(reloaded[name], twin[name], rtol=0, atol=0)
