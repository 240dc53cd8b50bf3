"""Inference: `init_inference`, generation with a KV cache, continuous batching, weight-only
quantization, fused kernels and ZeRO-Inference (issue 16). docs/inference.md."""
