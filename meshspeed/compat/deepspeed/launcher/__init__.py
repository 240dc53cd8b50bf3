"""`deepspeed.launcher`: DeepSpeed's launcher package; meshspeed's launcher is `meshspeed run`
(meshspeed/launcher/)."""
