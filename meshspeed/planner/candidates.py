"""The candidate space: every layout of the degrees, ZeRO stage, offload, checkpointing and
micro-batch the model and the batch allow; each refusal says why."""

from __future__ import annotations

from collections.abc import Iterator

from meshspeed.planner.cost import Candidate
from meshspeed.planner.model_spec import PlanModel


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def why_not(model: PlanModel, c: Candidate, global_batch: int, seq_len: int,
            gpus_per_node: int) -> str | None:
    """None when the layout can run; else the first reason it cannot."""
    s = model.shape
    kv_heads = s.n_head if s.n_kv_head is None else s.n_kv_head
    if c.tp > gpus_per_node:
        return f"tp {c.tp} would span nodes (a node has {gpus_per_node} devices)"
    if s.n_head % c.tp or kv_heads % c.tp:
        return f"tp {c.tp} does not divide the {s.n_head} query / {kv_heads} key-value heads"
    if s.ffn % c.tp:
        return f"tp {c.tp} does not divide the MLP width {s.ffn}"
    if s.n_layer % c.pp:
        return f"pp {c.pp} does not divide the {s.n_layer} layers"
    if c.cp > 1 and ((s.n_head // c.tp) % c.cp or seq_len % c.cp):
        return f"cp {c.cp} (Ulysses) does not divide the {s.n_head // c.tp} heads per tp rank or seq_len {seq_len}"
    if c.ep > 1 and (not model.num_experts or model.num_experts % c.ep or c.dp % c.ep):
        return f"ep {c.ep} needs an MoE model whose {model.num_experts} experts and dp {c.dp} it divides"
    if global_batch % (c.dp * c.micro_batch):
        return f"micro-batch {c.micro_batch} x dp {c.dp} does not divide the global batch {global_batch}"
    if c.offload and c.stage == 0:
        return "optimizer offload needs ZeRO stage >= 1"
    return None


def enumerate_candidates(model: PlanModel, gpus: int, global_batch: int, seq_len: int,
                         gpus_per_node: int = 8, stages=(0, 1, 2, 3), offloads=(None, "cpu"),
                         checkpointing=(False, True), max_tp: int | None = None) -> Iterator[Candidate]:
    """Every valid candidate: tp * cp * dp * pp == gpus, ep | dp, micro-batch | batch/dp."""
    for tp in divisors(gpus):
        if max_tp is not None and tp > max_tp:
            continue
        for pp in divisors(gpus // tp):
            for cp in divisors(gpus // (tp * pp)):
                dp = gpus // (tp * pp * cp)
                if global_batch % dp:
                    continue
                for ep in divisors(dp) if model.num_experts else (1,):
                    for mb in divisors(global_batch // dp):
                        for stage in stages:
                            for off in offloads:
                                for ck in checkpointing:
                                    c = Candidate(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, stage=stage,
                                                  offload=off, checkpointing=ck, micro_batch=mb,
                                                  grad_accum=global_batch // (dp * mb))
                                    if why_not(model, c, global_batch, seq_len, gpus_per_node) is None:
                                        yield c
