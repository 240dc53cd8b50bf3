"""Long-context training: each sequence split over the mesh's context-parallel (cp) axis.

    layer.py         DistributedAttention: DeepSpeed-Ulysses (all-to-all heads <-> sequence)
    ring.py          Ring Attention: K/V blocks circulate, log-sum-exp merge, causal skipping
    hybrid.py        both on a 2-D sequence mesh, ulysses x ring (USP)
    sharding.py      which tokens each rank holds (contiguous or load-balanced chunks)
    all_to_all.py    the differentiable all-to-all Ulysses is built on
    block_attention.py  attention of one query block against one key/value block, with its
                     log-sum-exp, forward and backward (the ring's kernel)
"""
