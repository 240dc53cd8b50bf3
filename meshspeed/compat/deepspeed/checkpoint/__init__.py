"""`deepspeed.checkpoint`: DeepSpeed's checkpoint utilities, over meshspeed.checkpoint."""
