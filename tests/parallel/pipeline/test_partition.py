"""DeepSpeed's partition methods (meshspeed/parallel/pipeline/partition.py)."""

import itertools

import pytest
from torch import nn

from meshspeed.parallel.pipeline.module import LayerSpec, TiedLayerSpec
from meshspeed.parallel.pipeline.partition import (
    PartitionError,
    balanced_cuts,
    layer_weights,
    partition,
)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d, bias=False)


class Exploding(nn.Module):
    def __init__(self):
        super().__init__()
        raise AssertionError("built, but only its owner stage may build it")


def test_parameters_are_counted_on_meta_and_balanced():
    layers = [LayerSpec(nn.Embedding, 100, 8)] + [LayerSpec(Block, 8) for _ in range(6)] + [nn.Linear(8, 100)]
    weights = layer_weights(layers, "parameters")
    assert weights == [800] + [64] * 6 + [900]
    # 800 + 4 x 64 = 1056 against 2 x 64 + 900 = 1028: the lightest heaviest stage
    assert partition(layers, 2, "parameters") == [0, 5, 8]
    # ties leave the first stages lighter: under 1F1B they hold the most micro-batches
    assert partition(layers, 3, "uniform") == [0, 2, 5, 8]


def test_type_regex_balances_the_matching_layers():
    layers = [nn.Embedding(10, 4)] + [Block(4) for _ in range(4)] + [nn.LayerNorm(4), nn.Linear(4, 10)]
    assert layer_weights(layers, "type:block") == [0, 1, 1, 1, 1, 0, 0]
    bounds = partition(layers, 2, "type:[Bb]lock")
    assert [sum(layer_weights(layers[a:b], "type:block")) for a, b in itertools.pairwise(bounds)] == [2, 2]


def test_the_cut_minimises_the_heaviest_stage():
    for weights, stages, want in [([1, 1, 1, 1], 2, [0, 2, 4]), ([5, 1, 1, 1, 1, 1], 2, [0, 1, 6]),
                                  ([1, 2, 3, 4, 5], 3, [0, 3, 4, 5]), ([3, 0, 0, 3], 2, [0, 1, 4])]:
        bounds = balanced_cuts(weights, stages)
        heaviest = max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds))
        assert heaviest == max(sum(weights[a:b]) for a, b in itertools.pairwise(want)), (weights, bounds)
        assert all(any(weights[a:b]) for a, b in itertools.pairwise(bounds))


def test_a_spec_is_never_built_to_be_counted_by_uniform_or_type():
    layers = [LayerSpec(Exploding), TiedLayerSpec("emb", Exploding), LayerSpec(Exploding)]
    assert partition(layers, 3, "uniform") == [0, 1, 2, 3]
    assert layer_weights(layers, "type:explod") == [1, 1, 1]


@pytest.mark.parametrize("layers,stages,method,message", [
    ([nn.Linear(2, 2)] * 2, 3, "uniform", "3 pipeline stages for 2 layers"),
    ([nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)], 3, "type:linear", "weighs 2 of the 3 layers, fewer than the 3"),
    ([nn.Linear(2, 2)] * 2, 2, "random", "'random' is not one of"),
])
def test_impossible_partitions_say_why(layers, stages, method, message):
    with pytest.raises(PartitionError, match=message):
        partition(layers, stages, method)
