"""client_state and RNG states as JSON + tensors; anything else is refused, never pickled."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from meshspeed.checkpoint.errors import CheckpointError
from meshspeed.checkpoint.jsonable import (
    capture_rng,
    decode_client_state,
    encode_client_state,
    restore_rng,
)


def test_client_state_round_trip():
    state = {"epoch": 3, "best": 0.5, "name": "run", "ok": True, "none": None,
             "hist": [1, 2, (3, 4)], "ema": torch.arange(4.0), "np": np.ones(2), "n": np.int64(7)}
    encoded, tensors = encode_client_state(state)
    back = decode_client_state(encoded, tensors)
    assert back["hist"] == [1, 2, [3, 4]] and back["n"] == 7 and back["epoch"] == 3
    assert torch.equal(back["ema"], torch.arange(4.0))
    assert torch.equal(back["np"], torch.ones(2, dtype=torch.float64))


class Custom:
    pass


@pytest.mark.parametrize("state,where", [
    ({"obj": Custom()}, "client_state['obj']"),
    ({"a": [1, {"b": {1, 2}}]}, "client_state['a'][1]['b']"),
    ({1: "int key"}, "client_state has a key 1"),
])
def test_non_json_values_are_refused_with_their_location(state, where):
    with pytest.raises(CheckpointError) as err:
        encode_client_state(state)
    assert where in str(err.value) and "\n" not in str(err.value)


def test_rng_round_trip():
    info, tensors = capture_rng()
    a = (random.random(), np.random.rand(), torch.rand(3))
    restore_rng(info, tensors.__getitem__)
    b = (random.random(), np.random.rand(), torch.rand(3))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])
    import json
    json.dumps(info)  # JSON-able as it stands
