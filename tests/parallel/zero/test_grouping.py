"""Which parameters travel together: buckets (stages 1-2) and module units (stage 3)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from meshspeed.parallel.zero.grouping import bucket_units, module_units


def flat(sizes):
    """A module whose parameters have the given element counts, registered in order."""
    m = nn.Module()
    for i, n in enumerate(sizes):
        m.register_parameter(f"p{i}", nn.Parameter(torch.zeros(n)))
    return m


def names(unit):
    return [n for n, _ in unit.params]


# -- bucket_units ----------------------------------------------------------------------------
def test_buckets_run_in_reverse_registration_order():
    plan = bucket_units(flat([4, 4, 4, 4, 4]), bucket_numel=8)
    assert [u.name for u in plan.units] == ["bucket0", "bucket1", "bucket2"]
    assert [names(u) for u in plan.units] == [["p4", "p3"], ["p2", "p1"], ["p0"]]
    assert all(not u.shard_params and u.module is None for u in plan.units)
    assert plan.root is None


def test_oversized_parameter_gets_a_bucket_of_its_own():
    plan = bucket_units(flat([3, 3, 100, 3, 2]), bucket_numel=10)
    assert [names(u) for u in plan.units] == [["p4", "p3"], ["p2"], ["p1", "p0"]]


def test_bucket_that_exactly_fills_is_closed():
    plan = bucket_units(flat([5, 5, 5]), bucket_numel=10)
    assert [names(u) for u in plan.units] == [["p2", "p1"], ["p0"]]


def test_tied_parameter_is_bucketed_once():
    m = nn.Sequential(nn.Embedding(6, 4), nn.Linear(4, 6, bias=False))
    m[1].weight = m[0].weight
    plan = bucket_units(m, bucket_numel=1000)
    assert [names(u) for u in plan.units] == [["0.weight"]]


@settings(deadline=None, max_examples=60)
@given(sizes=st.lists(st.integers(1, 50), min_size=1, max_size=12), bound=st.integers(1, 80))
def test_buckets_partition_the_reversed_parameters(sizes, bound):
    m = flat(sizes)
    plan = bucket_units(m, bound)
    expected = list(reversed(list(m.named_parameters())))
    got = [item for u in plan.units for item in u.params]
    assert [n for n, _ in got] == [n for n, _ in expected]
    assert all(a is b for (_, a), (_, b) in zip(got, expected))
    totals = [sum(p.numel() for _, p in u.params) for u in plan.units]
    for u, total in zip(plan.units, totals):
        assert total <= bound or len(u.params) == 1
    # greedy: a bucket is closed only when the next parameter would not fit
    for u, total in zip(plan.units[1:], totals[:-1]):
        assert total + u.params[0][1].numel() > bound


# -- module_units ----------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, d=4):
        super().__init__()
        self.lin = nn.Linear(d, d)  # weight 16, bias 4
        self.norm = nn.LayerNorm(d)  # weight 4, bias 4


class Net(nn.Module):
    def __init__(self, n_layer=2, tie=False):
        super().__init__()
        self.emb = nn.Embedding(10, 4)  # 40
        self.layers = nn.ModuleList(Block() for _ in range(n_layer))
        self.head = nn.Linear(4, 10, bias=False)  # 40
        if tie:
            self.head.weight = self.emb.weight


def by_name(plan):
    return {u.name: u for u in plan.units}


def assert_partition(plan, model):
    """Every parameter of the model is in exactly one unit."""
    got = [p for u in plan.units for _, p in u.params]
    assert len(got) == len({id(p) for p in got})
    assert {id(p) for p in got} == {id(p) for p in model.parameters()}


def test_one_unit_per_block_then_embedding_and_head_then_persistent():
    model = Net()
    plan = module_units(model, persistence_threshold=4)
    # Note [the root unit split]: the embedding and the head are units of their own
    assert [u.name for u in plan.units] == ["layers.0", "layers.1", "emb", "head", "persistent"]
    units = by_name(plan)
    assert names(units["layers.0"]) == ["layers.0.lin.weight"]
    assert names(units["layers.1"]) == ["layers.1.lin.weight"]
    assert names(units["emb"]) == ["emb.weight"]
    assert names(units["head"]) == ["head.weight"]
    assert units["emb"].module is model.emb and units["head"].module is model.head
    assert plan.root is None
    assert names(units["persistent"]) == [
        "layers.0.lin.bias", "layers.0.norm.weight", "layers.0.norm.bias",
        "layers.1.lin.bias", "layers.1.norm.weight", "layers.1.norm.bias"]
    assert units["layers.0"].module is model.layers[0]
    assert units["layers.1"].module is model.layers[1]
    assert units["persistent"].module is None
    assert [u.shard_params for u in plan.units] == [True, True, True, True, False]
    assert units["layers.0"].params[0][1] is model.layers[0].lin.weight
    assert_partition(plan, model)


def test_threshold_is_inclusive_and_zero_keeps_everything_sharded():
    model = Net()
    plan = module_units(model, persistence_threshold=16)  # lin.weight (16) now persists
    assert [u.name for u in plan.units] == ["emb", "head", "persistent"]  # empty blocks dropped
    assert len(by_name(plan)["persistent"].params) == 2 * 4
    plan = module_units(model, persistence_threshold=0)
    assert [u.name for u in plan.units] == ["layers.0", "layers.1", "emb", "head"]
    assert names(by_name(plan)["layers.0"]) == [
        "layers.0.lin.weight", "layers.0.lin.bias", "layers.0.norm.weight", "layers.0.norm.bias"]
    assert_partition(plan, model)


def test_tied_weights_appear_once_in_root():
    model = Net(tie=True)
    plan = module_units(model, persistence_threshold=4)
    # one Parameter registered by two modules: the root (Note [the root unit split])
    assert [u.name for u in plan.units] == ["layers.0", "layers.1", "root", "persistent"]
    assert names(by_name(plan)["root"]) == ["emb.weight"]
    assert by_name(plan)["root"].module is model
    assert_partition(plan, model)


def test_parameters_of_the_model_itself_stay_in_root():
    model = Net()
    model.pos = nn.Parameter(torch.zeros(8, 4))  # used by the model's own forward
    plan = module_units(model, persistence_threshold=4)
    assert names(by_name(plan)["root"]) == ["pos"]
    assert names(by_name(plan)["emb"]) == ["emb.weight"]
    assert_partition(plan, model)


def test_a_module_reused_under_two_names_is_one_unit():
    model = Net()
    model.head2 = model.head  # one module called twice: its hooks bracket both calls
    plan = module_units(model, persistence_threshold=4)
    assert names(by_name(plan)["head"]) == ["head.weight"]
    assert plan.root is None
    assert_partition(plan, model)


def test_external_use_moves_an_outside_parameter_to_root():
    model = Net()
    plan = module_units(model, persistence_threshold=4, external=[(model.head, model.emb.weight)])
    assert names(by_name(plan)["root"]) == ["emb.weight"]
    assert "emb" not in by_name(plan)
    plan = module_units(model, persistence_threshold=4, external=[(model.emb, model.emb.weight)])
    assert names(by_name(plan)["emb"]) == ["emb.weight"]  # a use inside its own module


def test_parameter_shared_by_two_blocks_stays_in_root():
    model = Net(n_layer=3)
    model.layers[2].lin = model.layers[0].lin  # blocks 0 and 2 share one Linear
    plan = module_units(model, persistence_threshold=0)
    units = by_name(plan)
    assert names(units["root"]) == ["layers.0.lin.weight", "layers.0.lin.bias"]
    assert names(units["emb"]) == ["emb.weight"]
    assert names(units["layers.0"]) == ["layers.0.norm.weight", "layers.0.norm.bias"]
    assert names(units["layers.1"]) == [
        "layers.1.lin.weight", "layers.1.lin.bias", "layers.1.norm.weight", "layers.1.norm.bias"]
    assert names(units["layers.2"]) == ["layers.2.norm.weight", "layers.2.norm.bias"]
    assert_partition(plan, model)


def test_parameter_shared_by_a_block_and_the_root_stays_in_root():
    model = Net()
    model.emb = nn.Linear(4, 4, bias=False)  # registered before the blocks, run before them
    model.emb.weight = model.layers[0].lin.weight
    plan = module_units(model, persistence_threshold=4)
    units = by_name(plan)
    assert_partition(plan, model)
    assert names(units["root"]) == ["emb.weight"]
    assert names(units["head"]) == ["head.weight"]
    assert "layers.0" not in units  # its one sharded parameter went to root


def test_nested_module_lists():
    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(4, 4, bias=False) for _ in range(2))

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = nn.Module()
            self.encoder.layers = nn.ModuleList(Inner() for _ in range(2))
            self.out = nn.Linear(4, 4, bias=False)

    model = Outer()
    plan = module_units(model, persistence_threshold=0)
    # the outermost ModuleList's elements are the units; lists inside them are not split
    assert [u.name for u in plan.units] == ["encoder.layers.0", "encoder.layers.1", "out"]
    units = by_name(plan)
    assert names(units["encoder.layers.1"]) == [
        "encoder.layers.1.experts.0.weight", "encoder.layers.1.experts.1.weight"]
    assert units["encoder.layers.1"].module is model.encoder.layers[1]
    assert names(units["out"]) == ["out.weight"]
    assert_partition(plan, model)


def test_model_without_blocks_is_one_unit_per_module():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    plan = module_units(model, persistence_threshold=4)
    assert [u.name for u in plan.units] == ["0", "1", "persistent"]
    assert names(plan.units[0]) == ["0.weight"]
    assert names(plan.units[1]) == ["1.weight"]
    assert names(plan.units[2]) == ["0.bias", "1.bias"]
