"""Running scripts written for DeepSpeed, unchanged: `meshspeed run --deepspeed-compat`.

alias.py   `import deepspeed` -> meshspeed in the launched processes (Note [the deepspeed alias])
child.py   what each launched process runs first: DeepSpeed's per-rank `--local_rank=N`
           argument and environment, then the script

Scripts that change their import line (`import meshspeed as deepspeed`) need none of this.
"""
