"""The `gradient_compression` section: meshspeed's own key (DeepSpeed has none like it).

Owned by `meshspeed/parallel/data` (stage 0). Each gradient bucket is compressed before
it is exchanged, instead of being all-reduced in full precision:

    topk   the ceil(topk_ratio * n) largest |g| of the bucket, as (int32 index, fp32 value)
    int8   one signed byte per element, one fp32 max-abs scale per `chunk_size` elements
    int4   two signed nibbles per byte, one fp32 scale per `chunk_size` elements

With `error_feedback` each rank keeps what compression lost and adds it to the next
step's gradient (Seide et al. 2014, "1-bit SGD"; Lin et al. 2018, "Deep Gradient
Compression"; Karimireddy et al. 2019, "Error Feedback Fixes SignSGD"). The first
`warmup_steps` optimizer steps reduce in full precision. `exchange` "all_gather" sends
every rank's whole payload to every rank; "two_hop" (int8/int4) keeps the all-reduce's
2(N-1)/N factor by summing quantized shards in between. docs/compression.md, "Compressed
gradients in data parallelism", has the bytes per step.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from meshspeed.config.base import NonNegInt, PositiveInt, StrictModel

Ratio = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]


class GradientCompressionConfig(StrictModel):
    method: Literal["topk", "int8", "int4"]
    topk_ratio: Ratio | None = None  # topk only: fraction of each bucket sent; default 0.01
    chunk_size: PositiveInt | None = None  # int8/int4 only: elements per scale; default 256
    error_feedback: bool = True  # carry what compression lost into the next step
    warmup_steps: NonNegInt = 0  # optimizer steps reduced uncompressed first
    # int8/int4: "all_gather" every rank's whole payload (one hop, overlaps backward), or
    # "two_hop": all-to-all of quantized shards, sum, requantize, all-gather (bytes do not
    # grow with the data-parallel size; a second quantization, with its own residual)
    exchange: Literal["all_gather", "two_hop"] = "all_gather"

    @model_validator(mode="after")
    def _method_keys(self):
        if self.method != "topk" and self.topk_ratio is not None:
            raise ValueError(f'topk_ratio is for method "topk"; method is "{self.method}" (drop it)')
        if self.method == "topk" and self.chunk_size is not None:
            raise ValueError('chunk_size is for methods "int8" and "int4"; method is "topk" (drop it)')
        if self.method == "topk" and self.exchange == "two_hop":
            raise ValueError('exchange "two_hop" is for methods "int8" and "int4"; top-k payloads '
                             'of different ranks hold different indices (use "all_gather")')
        if self.method == "int4" and self.chunk_size is not None and self.chunk_size % 2:
            raise ValueError(f"chunk_size must be even for int4 (two values per byte), got {self.chunk_size}")
        return self

    @property
    def ratio(self) -> float:
        return 0.01 if self.topk_ratio is None else self.topk_ratio

    @property
    def chunk(self) -> int:
        return 256 if self.chunk_size is None else self.chunk_size
