"""`deepspeed.checkpoint.utils`: DeepSpeed's checkpoint file names, and tensor cloning for
`torch.save`.

The `get_*_ckpt_name_for_rank` functions name the files of DeepSpeed's own checkpoint
layout (`mp_rank_00_model_states.pt`, `zero_pp_rank_0_mp_rank_00_optim_states.pt`, ...):
scripts use them to find those files in a DeepSpeed checkpoint. meshspeed's
`save_checkpoint` writes its own layout (meshspeed/checkpoint/paths.py: `meta.json` and
one `rank-NNNNN.safetensors` per rank), so these paths do not exist in a meshspeed
checkpoint; read one with `deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`.
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["clone_tensors_for_torch_save", "get_layer_ckpt_name_for_rank", "get_model_ckpt_name_for_rank",
           "get_zero_ckpt_name_for_rank"]

MODEL_FILE_PREFIX = "mp_rank_"
MODEL_FILE_SUFFIX = "_model_states.pt"
ZERO_FILE_PREFIX = "zero_pp_rank_"
OPTIM_FILE_SUFFIX = "_optim_states.pt"


def get_model_ckpt_name_for_rank(base_folder: str | os.PathLike, mp_rank_str: str) -> str:
    """DeepSpeed's model-states file of model-parallel rank `mp_rank_str` (already
    zero-padded, e.g. "00") in the tag folder `base_folder`."""
    return os.path.join(base_folder, f"{MODEL_FILE_PREFIX}{mp_rank_str}{MODEL_FILE_SUFFIX}")


def get_zero_ckpt_name_for_rank(base_folder: str | os.PathLike, dp_rank: int, mp_rank: int) -> str:
    """DeepSpeed's ZeRO optimizer-states file of data-parallel rank `dp_rank` and
    model-parallel rank `mp_rank` in the tag folder `base_folder`."""
    name = f"{ZERO_FILE_PREFIX}{dp_rank}_{MODEL_FILE_PREFIX}{mp_rank:02d}{OPTIM_FILE_SUFFIX}"
    return os.path.join(base_folder, name)


def get_layer_ckpt_name_for_rank(base_folder: str | os.PathLike, layer_id: int | str, tp_rank: int) -> str:
    """DeepSpeed's pipeline-layer file of layer `layer_id` (as DeepSpeed formats it, e.g.
    "layer_01") and tensor-parallel rank `tp_rank` in the tag folder `base_folder`."""
    return os.path.join(base_folder, f"{layer_id}-model_{tp_rank:02d}{MODEL_FILE_SUFFIX}")


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = "cpu") -> Any:
    """`item` (a tensor, or lists, tuples and dicts of them) with every tensor detached and
    copied to `device`, so that `torch.save` writes each tensor's own bytes rather than the
    whole storage a view shares (accelerate's `get_state_dict` at ZeRO 0-2)."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    return item
