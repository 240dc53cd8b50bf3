"""`layer_reduction`: start a shallower student from chosen layers of a teacher.

The student is a model built with `keep_number_layer` layers in its `module_name_prefix`
list (for GPT: `GPTConfig(n_layer=keep_number_layer)`, prefix "layers"). Student layer i
receives teacher layer `teacher_layer[i]`, and each module of `other_module_name`
(embeddings, final norm, head) is copied whole. Everything copied is the modules' state:
parameters and persistent buffers, matched by name and shape (DeepSpeed copied parameters
only, pairing them by position). Knowledge distillation itself is the training script's.
"""

from __future__ import annotations

import torch
from torch import nn

from meshspeed.compression.helper import recursive_getattr
from meshspeed.config.compression import LayerReduction

_WHERE = "compression_training.layer_reduction"


def _module(model: nn.Module, name: str, who: str, key: str) -> nn.Module:
    try:
        found = recursive_getattr(model, name)
    except AttributeError:
        found = None
    if not isinstance(found, nn.Module):
        # a config value naming nothing: ValueError, like every other config mistake here
        raise ValueError(f"{_WHERE}.{key}: the {who} has no module '{name}'")  # noqa: TRY004
    return found


@torch.no_grad()
def _copy(student: nn.Module, teacher: nn.Module, s_name: str, t_name: str) -> None:
    s_state, t_state = student.state_dict(), teacher.state_dict()
    if list(s_state) != list(t_state):
        raise ValueError(f"{_WHERE}: student '{s_name}' and teacher '{t_name}' hold different "
                         f"tensors ({sorted(set(s_state) ^ set(t_state))[:4]}); the student must "
                         "be the teacher's architecture with fewer layers")
    for key, value in s_state.items():
        if value.shape != t_state[key].shape:
            raise ValueError(f"{_WHERE}: '{s_name}.{key}' is {tuple(value.shape)} in the student and "
                             f"{tuple(t_state[key].shape)} in the teacher")
        value.copy_(t_state[key])


def student_initialization(student: nn.Module, teacher: nn.Module, cfg: LayerReduction) -> None:
    """Copy the chosen teacher layers (and other modules) into `student`, in place."""
    prefix = cfg.module_name_prefix
    s_layers = _module(student, prefix, "student", "module_name_prefix")
    t_layers = _module(teacher, prefix, "teacher", "module_name_prefix")
    if len(s_layers) != cfg.keep_number_layer:
        raise ValueError(f"{_WHERE}.keep_number_layer is {cfg.keep_number_layer} but the student's "
                         f"'{prefix}' has {len(s_layers)} layers; build the student with "
                         "keep_number_layer layers")
    for i, t in enumerate(cfg.teacher_layer):
        if t >= len(t_layers):
            raise ValueError(f"{_WHERE}.teacher_layer: layer {t} does not exist; the teacher's "
                             f"'{prefix}' has layers 0..{len(t_layers) - 1}")
        _copy(s_layers[i], t_layers[t], f"{prefix}.{i}", f"{prefix}.{t}")
    for name in cfg.other_module_name:
        _copy(_module(student, name, "student", "other_module_name"),
              _module(teacher, name, "teacher", "other_module_name"), name, name)
