"""Pipeline parallelism: layers cut into stages (module.py, partition.py), micro-batch
schedules as data (schedule.py), the runtime that executes one stage's schedule
(runtime.py, p2p.py, weight_grad.py) and what it recorded (timeline.py). The engine that
composes them with data parallelism and ZeRO is meshspeed/engine/pipeline.py."""

from meshspeed.parallel.pipeline.module import (
    LayerSpec,
    PipelineModule,
    TiedLayerSpec,
    split_sequential,
)

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec", "split_sequential"]
