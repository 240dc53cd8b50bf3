"""layer_reduction: the student starts from the chosen teacher layers."""

import pytest
import torch
from torch import nn

from meshspeed.compression import init_compression
from tests.compression.models import config, gpt, tokens

torch.set_num_threads(1)

REDUCE = {"enabled": True, "keep_number_layer": 2, "module_name_prefix": "layers",
          "teacher_layer": [1, 3], "other_module_name": ["tok_emb", "norm", "lm_head"]}


def test_student_copies_the_chosen_teacher_layers():
    teacher, student = gpt(seed=0, n_layer=4), gpt(seed=1, n_layer=2)
    init_compression(student, config(layer_reduction=REDUCE), teacher_model=teacher)
    for i, t in enumerate([1, 3]):
        for (name, s), (_, tp) in zip(student.layers[i].named_parameters(),
                                      teacher.layers[t].named_parameters()):
            assert torch.equal(s, tp), name
        assert student.layers[i].attn.wq.weight is not teacher.layers[t].attn.wq.weight
    # the student computes what the teacher computes with only its layers 1 and 3
    teacher.layers = nn.ModuleList([teacher.layers[1], teacher.layers[3]])
    idx = tokens()
    assert torch.equal(student(idx), teacher(idx))


def test_layer_reduction_errors():
    def error(student, teacher, **changes):
        with pytest.raises(ValueError) as info:
            init_compression(student, config(layer_reduction={**REDUCE, **changes}), teacher_model=teacher)
        return str(info.value)

    assert "keep_number_layer is 2 but the student's 'layers' has 4 layers" in error(
        gpt(n_layer=4), gpt(n_layer=4))
    assert "layer 5 does not exist; the teacher's 'layers' has layers 0..3" in error(
        gpt(), gpt(n_layer=4), teacher_layer=[1, 5])
    assert "the student has no module 'blocks'" in error(gpt(), gpt(n_layer=4),
                                                         module_name_prefix="blocks")
    assert "'layers.0.attn_norm.weight' is (16,) in the student and (32,) in the teacher" in error(
        gpt(d_model=16, n_head=2), gpt(n_layer=4), other_module_name=[])
