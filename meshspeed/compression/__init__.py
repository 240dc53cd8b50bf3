"""Model compression. For now DeepSpeed's `compression.helper` module-path utilities only."""
