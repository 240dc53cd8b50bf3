"""``from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology`` and co."""

from meshspeed.topology.process import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
)

__all__ = ["PipeDataParallelTopology", "PipeModelDataParallelTopology", "ProcessTopology"]
