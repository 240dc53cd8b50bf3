"""The tensor-parallel layers, in one place to import from.

linear.py         ColumnParallelLinear, RowParallelLinear (both weight layouts)
embedding.py      VocabParallelEmbedding
cross_entropy.py  vocab_parallel_cross_entropy, VocabParallelCrossEntropy
shared_gather.py  SharedGather: sibling column layers (q/k/v, gate/up) as one node
norms.py          mark_sequence_parallel: norms whose gradients are partial over tp
overlap.py        the linear layers' autograd Functions (communication/GEMM overlap)
"""

from meshspeed.tensor_parallel.cross_entropy import (
    VocabParallelCrossEntropy,
    vocab_parallel_cross_entropy,
)
from meshspeed.tensor_parallel.embedding import VocabParallelEmbedding
from meshspeed.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear
from meshspeed.tensor_parallel.norms import mark_sequence_parallel
from meshspeed.tensor_parallel.shared_gather import SharedGather
from meshspeed.topology.shards import partial_grad_params

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "SharedGather",
    "VocabParallelCrossEntropy",
    "VocabParallelEmbedding",
    "mark_sequence_parallel",
    "partial_grad_params",
    "vocab_parallel_cross_entropy",
]
