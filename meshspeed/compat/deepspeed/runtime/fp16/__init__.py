"""`deepspeed.runtime.fp16`: DeepSpeed's half-precision optimizer wrappers' package path."""
