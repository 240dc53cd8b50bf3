"""`meshspeed.ops`: DeepSpeed's import paths for its op classes (`deepspeed.ops.adam`) and
its op builders (`deepspeed.ops.op_builder`, `deepspeed.ops.__compatible_ops__`).

meshspeed has no compiled ops of its own; each name here is a class from the package that
owns it (optimizers: `meshspeed.optim`), under the path DeepSpeed scripts import it from.
The builders say which ops meshspeed has: Note [builders tell the truth].
"""

from meshspeed.compat.deepspeed.ops.op_builder import compatible_ops as _compatible_ops

__compatible_ops__ = _compatible_ops()
