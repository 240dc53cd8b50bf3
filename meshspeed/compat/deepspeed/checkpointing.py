"""`meshspeed.checkpointing`: DeepSpeed's activation checkpointing API (`deepspeed.checkpointing`).

    import meshspeed as deepspeed
    deepspeed.checkpointing.configure(mpu, deepspeed_config=args.deepspeed_config)
    deepspeed.checkpointing.model_parallel_cuda_manual_seed(1234)
    hidden = deepspeed.checkpointing.checkpoint(block, hidden, mask)

The same names are at DeepSpeed's long path, `meshspeed.runtime.activation_checkpointing
.checkpointing`. What each does: meshspeed/parallel/activation_checkpoint.py (checkpoint),
meshspeed/parallel/non_reentrant.py (non_reentrant_checkpoint),
meshspeed/parallel/activation_setup.py (configure and the config block) and
meshspeed/parallel/rng_tracker.py (the RNG tracker); docs/activation_checkpointing.md.
"""

from meshspeed.parallel.activation_checkpoint import checkpoint
from meshspeed.parallel.activation_setup import (
    configure,
    is_configured,
    model_parallel_cuda_manual_seed,
    partition_activations_in_checkpoint,
    reset,
    set_num_layers,
)
from meshspeed.parallel.non_reentrant import non_reentrant_checkpoint
from meshspeed.parallel.rng_tracker import (
    CudaRNGStatesTracker,
    RNGStatesTracker,
    get_cuda_rng_tracker,
)

__all__ = [
    "CudaRNGStatesTracker",
    "RNGStatesTracker",
    "checkpoint",
    "configure",
    "get_cuda_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "non_reentrant_checkpoint",
    "partition_activations_in_checkpoint",
    "reset",
    "set_num_layers",
]
