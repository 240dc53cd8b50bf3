"""`deepspeed.runtime.checkpoint_engine`: DeepSpeed's pluggable file writers, for code that
saves or loads its own files through one (`PipelineModule.save_state_dict(dir,
checkpoint_engine=TorchCheckpointEngine())`).

meshspeed's `engine.save_checkpoint` does not go through a checkpoint engine: it writes
its own layout with its own writer (meshspeed/checkpoint/writer.py; `checkpoint.async_save`
is its asynchronous mode). Only the torch.save writer is here; DeepSpeed's Nebula,
fast (io_uring) and decoupled writers have no meshspeed counterpart.
"""

from meshspeed.compat.deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointCommitInfo,
    CheckpointEngine,
)
from meshspeed.compat.deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import (
    TorchCheckpointEngine,
)

__all__ = ["CheckpointCommitInfo", "CheckpointEngine", "TorchCheckpointEngine"]
