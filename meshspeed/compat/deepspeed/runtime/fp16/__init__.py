"""`deepspeed.runtime.fp16`: DeepSpeed's mixed-precision optimizer wrappers' package (the
loss scaler is meshspeed/optim/loss_scaler.py; Note [DeepSpeed's optimizer wrappers])."""
