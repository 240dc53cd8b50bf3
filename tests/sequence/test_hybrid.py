"""hybrid_attention (USP: all-to-all inside pairs, the ring across them) on 4 gloo ranks
as a 2 x 2 sequence mesh, against attention of the whole sequence on one process: outputs
and input gradients (fp32, 1e-5), causal and not, contiguous and load-balanced, with and
without grouped-query heads (one kv head: replicated for the all-to-all); and the
load-balanced layout's equal block counts."""

from __future__ import annotations

import functools

from torch.testing import assert_close

from meshspeed.sequence.hybrid import hybrid_attention
from meshspeed.sequence.ring import BlockCounter
from meshspeed.sequence.sharding import SequenceLayout
from meshspeed.testing import run_distributed
from tests.sequence.test_ring import TOL, _reference, _whole

U = 2  # all-to-all degree; ring degree = 4 / U


def _cases() -> dict:
    import torch.distributed as dist

    from meshspeed.sequence.groups import hybrid_groups
    from meshspeed.topology import ParallelDims, build_topology

    rank = dist.get_rank()
    ug, rg = hybrid_groups(build_topology(ParallelDims(4, cp=4)), U)
    failures, counts = [], {}
    for causal in (True, False):
        for balanced in (False, True):
            for per_chunk, h_q, h_kv in ((1, 4, 4), (3, 4, 2), (2, 4, 1)):
                layout = SequenceLayout(8 * per_chunk, 4, balanced)
                chunks = [sum((layout.chunks(j * U + i) for i in range(U)), ()) for j in range(4 // U)]
                Q, K, V, dO = _whole(layout.seq_len, h_q, h_kv)
                leaves = [t.clone().requires_grad_() for t in (Q, K, V)]
                ref = _reference(*leaves, causal)
                ref.backward(dO)
                shard = functools.partial(layout.shard, rank=rank, dim=2)
                q, k, v = (shard(t).float().requires_grad_() for t in (Q, K, V))
                with BlockCounter() as blocks:
                    out = hybrid_attention(q, k, v, ug, rg, causal=causal, chunk_ids=chunks)
                out.backward(shard(dO).float())
                name = f"S={layout.seq_len} heads={h_q}/{h_kv} causal={causal} balanced={balanced}"
                for what, g, w in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad),
                                      (ref.detach(), *(t.grad for t in leaves))):
                    try:
                        assert_close(g.double(), shard(w), **TOL)
                    except AssertionError as err:
                        failures.append(f"{name}: {what}: {err}")
                counts[(causal, balanced, per_chunk)] = dict(blocks.forward)
    return {"failures": failures, "counts": counts}


def test_hybrid_equals_whole_attention_and_balances_the_ring():
    results = run_distributed(_cases, world_size=4, timeout=300)
    failures = [f for r in results for f in r["failures"]]
    assert not failures, "\n".join(failures[:8])
    work = lambda c: c.get("full", 0) + c.get("diagonal", 0)
    for key in results[0]["counts"]:
        per_rank = [work(r["counts"][key]) for r in results]
        causal, balanced, _ = key
        if balanced or not causal:
            assert len(set(per_rank)) == 1, (key, per_rank)  # every rank the same work
        else:
            assert len(set(per_rank)) > 1, (key, per_rank)  # the later ring member works more
