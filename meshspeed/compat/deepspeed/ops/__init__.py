"""`meshspeed.ops`: DeepSpeed's import paths for its op classes (`deepspeed.ops.adam`).

meshspeed has no compiled ops of its own; each name here is a class from the package that
owns it (optimizers: `meshspeed.optim`), under the path DeepSpeed scripts import it from.
"""
