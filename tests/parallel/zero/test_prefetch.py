"""Stage-3 fetching (Note [prefetch follows the last observed order]) with fake units that
record the calls the Fetcher makes: no tensors, no process group."""

from types import SimpleNamespace

import pytest

from meshspeed.parallel.zero.lifecycle import ParamState
from meshspeed.parallel.zero.prefetch import Fetcher, OrderTrace, Pass

F, B = Pass.FORWARD, Pass.BACKWARD


# -- OrderTrace ------------------------------------------------------------------------------
def run_pass(trace: OrderTrace, order: list[int]) -> list[list[int]]:
    trace.start()
    upcoming = [trace.record(i) for i in order]
    return upcoming


def test_first_pass_predicts_nothing():
    t = OrderTrace()
    t.start()
    assert not t.following
    assert [t.record(i) for i in (0, 1, 2)] == [[], [], []]
    assert not t.ends_with(2)
    t.finish()
    assert t.previous == [0, 1, 2]


def test_repeated_order_predicts_the_rest_of_the_record():
    t = OrderTrace()
    run_pass(t, [0, 1, 2, 3])
    t.finish()
    t.start()
    assert t.following
    assert t.record(0) == [1, 2, 3]
    assert not t.ends_with(0)
    assert t.record(1) == [2, 3]
    assert not t.ends_with(3)  # last in the record, but it has not run yet
    assert t.record(2) == [3]
    assert not t.ends_with(2)
    assert t.record(3) == []
    assert t.ends_with(3)
    assert not t.ends_with(2)
    assert t.following


def test_order_change_switches_prediction_off_for_the_rest_of_the_pass():
    t = OrderTrace()
    run_pass(t, [0, 1, 2, 3])
    t.finish()
    # diverges at position 1; position 2 and 3 match the record again but stay off
    assert run_pass(t, [0, 2, 2, 3]) == [[1, 2, 3], [], [], []]
    assert not t.following
    assert not t.ends_with(3)
    t.finish()
    # the new record is the pass just taken
    assert t.previous == [0, 2, 2, 3]
    assert run_pass(t, [0, 2, 2, 3]) == [[2, 2, 3], [2, 3], [3], []]
    assert t.ends_with(3)


def test_longer_pass_than_record_stops_following():
    t = OrderTrace()
    run_pass(t, [0, 1])
    t.finish()
    assert run_pass(t, [0, 1, 2]) == [[1], [], []]
    assert not t.following
    assert not t.ends_with(2)
    t.finish()
    assert t.previous == [0, 1, 2]


def test_shorter_pass_is_not_the_end_of_the_record():
    t = OrderTrace()
    run_pass(t, [0, 1, 2])
    t.finish()
    assert run_pass(t, [0, 1]) == [[1, 2], [2]]
    assert t.following  # nothing contradicted the record yet ...
    assert not t.ends_with(1)  # ... but the recorded pass went on after unit 1
    t.finish()
    assert run_pass(t, [0, 1]) == [[1], []]
    assert t.ends_with(1)


def test_empty_pass_clears_the_record():
    t = OrderTrace()
    run_pass(t, [0, 1])
    t.finish()
    run_pass(t, [])
    t.finish()
    t.start()
    assert not t.following
    assert t.record(0) == []


def test_start_without_finish_keeps_the_old_record():
    t = OrderTrace()
    run_pass(t, [0, 1, 2])
    t.finish()
    run_pass(t, [2, 1])  # abandoned (e.g. an exception in forward): never finished
    assert run_pass(t, [0, 1, 2]) == [[1, 2], [2], []]


# -- Fetcher ---------------------------------------------------------------------------------
class FakeUnit:
    """What Fetcher touches on a stage-3 FlatUnit, with the same state transitions."""

    def __init__(self, index, numel, calls, shard_params=True):
        self.index = index
        self.layout = SimpleNamespace(numel=numel)
        self.shard_params = shard_params
        self.state = ParamState.SHARDED if shard_params else ParamState.WHOLE
        self.calls = calls
        self.ready = True  # its shard's writer is done (ready_to_gather)

    def ready_to_gather(self):
        return self.ready

    def gather(self):
        self.calls.append(("gather", self.index))
        if self.state is not ParamState.WHOLE:
            self.state = ParamState.WHOLE

    def gather_async(self):
        self.calls.append(("prefetch", self.index))
        assert self.state is ParamState.SHARDED, "prefetch of a unit that is not sharded"
        self.state = ParamState.GATHERING

    def release(self):
        self.calls.append(("release", self.index))
        if not self.shard_params:
            raise RuntimeError("release() is only valid for sharded params")
        self.state = ParamState.SHARDED

    def gathered_bytes(self):
        if not self.shard_params or self.state is ParamState.SHARDED:
            return 0
        return 4 * self.layout.numel


def make(numels, prefetch_numel=10**9, max_live_numel=10**9, max_ahead=1, persistent=()):
    calls = []
    units = [FakeUnit(i, n, calls, shard_params=i not in persistent) for i, n in enumerate(numels)]
    return Fetcher(units, prefetch_numel, max_live_numel, max_ahead=max_ahead), units, calls


def forward(fetcher, order, keep=()):
    """What the stage-3 hooks do around each unit: fetch before, release after."""
    fetcher.start(F)
    for i in order:
        fetcher.fetch(i, F)
        if i not in keep:
            fetcher.release(i)
    fetcher.finish(F)


def states(units):
    return [u.state for u in units]


def test_first_pass_gathers_on_demand_only():
    fetcher, units, calls = make([10, 10, 10])
    forward(fetcher, [0, 1, 2])
    assert calls == [("gather", 0), ("release", 0), ("gather", 1), ("release", 1),
                     ("gather", 2), ("release", 2)]
    assert states(units) == [ParamState.SHARDED] * 3


def test_second_pass_prefetches_one_ahead():
    fetcher, units, calls = make([10, 10, 10])
    forward(fetcher, [0, 1, 2])
    calls.clear()
    fetcher.start(F)
    fetcher.fetch(0, F)
    assert calls == [("gather", 0), ("prefetch", 1)]
    assert states(units) == [ParamState.WHOLE, ParamState.GATHERING, ParamState.SHARDED]
    fetcher.release(0)
    fetcher.fetch(1, F)  # completes the prefetch of 1, launches 2
    assert calls[-2:] == [("gather", 1), ("prefetch", 2)]
    fetcher.release(1)
    fetcher.fetch(2, F)
    assert calls[-1] == ("gather", 2)  # nothing after the last unit
    fetcher.release(2)
    assert [c for c in calls if c[0] == "prefetch"] == [("prefetch", 1), ("prefetch", 2)]


def test_a_unit_whose_shard_is_still_being_written_is_not_prefetched():
    """(Note [the update that runs into the next forward]: a prefetch would wait for the
    optimizer's update of its shard; the unit is gathered when it is due instead.)"""
    fetcher, units, calls = make([10] * 4, max_ahead=3)
    forward(fetcher, range(4))
    calls.clear()
    units[2].ready = False
    fetcher.start(F)
    fetcher.fetch(0, F)
    assert calls == [("gather", 0), ("prefetch", 1)]  # stops at 2, so 3 is not fetched before it
    units[2].ready = True
    fetcher.fetch(1, F)
    assert calls[2:] == [("gather", 1), ("prefetch", 2), ("prefetch", 3)]


def test_max_ahead_bounds_the_units_prefetched():
    fetcher, _units, calls = make([10] * 5, max_ahead=2)
    forward(fetcher, range(5))
    calls.clear()
    fetcher.start(F)
    fetcher.fetch(0, F)
    assert calls == [("gather", 0), ("prefetch", 1), ("prefetch", 2)]
    fetcher.fetch(1, F)
    assert calls[3:] == [("gather", 1), ("prefetch", 3)]  # 2 is already on its way


def test_already_gathered_unit_is_not_prefetched_again():
    fetcher, units, calls = make([10, 10, 10])
    forward(fetcher, [0, 1, 2])
    units[1].state = ParamState.WHOLE
    calls.clear()
    fetcher.start(F)
    fetcher.fetch(0, F)
    assert calls == [("gather", 0)]


def test_prefetch_budget_in_elements():
    fetcher, _units, calls = make([10, 30, 10], prefetch_numel=29)
    forward(fetcher, [0, 1, 2])
    calls.clear()
    fetcher.start(F)
    fetcher.fetch(0, F)  # unit 1 (30) exceeds the budget (29)
    assert calls == [("gather", 0)]
    fetcher.release(0)
    fetcher.fetch(1, F)  # unit 2 (10) fits
    assert calls[2:] == [("gather", 1), ("prefetch", 2)]


def test_prefetch_budget_is_shared_by_the_units_ahead():
    fetcher, units, calls = make([1, 10, 10, 10], prefetch_numel=25, max_ahead=3)
    forward(fetcher, range(4))
    calls.clear()
    fetcher.start(F)
    fetcher.fetch(0, F)  # 10 + 10 fit in 25, a third 10 does not
    assert calls == [("gather", 0), ("prefetch", 1), ("prefetch", 2)]
    assert units[3].state is ParamState.SHARDED


def test_budget_equal_to_unit_size_prefetches_it():
    fetcher, _units, calls = make([10, 30], prefetch_numel=30)
    forward(fetcher, [0, 1])
    calls.clear()
    fetcher.start(F)
    fetcher.fetch(0, F)
    assert calls == [("gather", 0), ("prefetch", 1)]


@pytest.mark.parametrize("max_live, prefetched", [(39, False), (40, True)])
def test_max_live_numel_counts_the_running_unit(max_live, prefetched):
    fetcher, _units, calls = make([10, 30], max_live_numel=max_live)
    forward(fetcher, [0, 1])
    calls.clear()
    fetcher.start(F)
    fetcher.fetch(0, F)  # unit 0 whole (10) + unit 1 (30) must stay within max_live
    assert (("prefetch", 1) in calls) is prefetched
    assert fetcher.live_numel() == (40 if prefetched else 10)


def test_max_live_numel_counts_units_kept_whole_but_not_persistent_ones():
    # unit 0 is persistent (never sharded) and large: it does not count as live
    fetcher, units, calls = make([1000, 10, 10, 10], max_live_numel=25, persistent={0})
    forward(fetcher, [1, 2, 3], keep={1})  # unit 1 stays whole (e.g. the root)
    assert fetcher.live_numel() == 10
    calls.clear()
    fetcher.start(F)
    fetcher.fetch(1, F)  # live 10 + unit 2 (10) <= 25: prefetched despite unit 0's 1000
    assert calls == [("prefetch", 2)]  # unit 1 is already whole: not gathered again
    fetcher.fetch(2, F)  # live 1 + 2 (20) + unit 3 (10) > 25: not prefetched
    assert calls[1:] == [("gather", 2)]
    assert units[3].state is ParamState.SHARDED
    fetcher.release(2)
    fetcher.fetch(3, F)
    assert fetcher.live_numel() == 20


def test_order_change_gathers_on_demand_and_release_all_drops_the_wrong_guess():
    fetcher, units, calls = make([10, 10, 10])
    forward(fetcher, [0, 1, 2])
    calls.clear()
    fetcher.start(F)
    fetcher.fetch(0, F)  # prefetches 1, which will not run next
    fetcher.release(0)
    fetcher.fetch(2, F)  # differs from the record: on demand, prefetch off
    fetcher.release(2)
    fetcher.fetch(1, F)
    fetcher.release(1)
    assert calls == [("gather", 0), ("prefetch", 1), ("release", 0), ("gather", 2),
                     ("release", 2), ("gather", 1), ("release", 1)]
    fetcher.finish(F)
    # the next pass follows the new record [0, 2, 1]
    calls.clear()
    fetcher.start(F)
    fetcher.fetch(0, F)
    assert calls == [("gather", 0), ("prefetch", 2)]
    fetcher.release(0)
    fetcher.fetch(1, F)  # diverges: 2 stays gathering until release_all
    fetcher.release(1)
    fetcher.finish(F)
    assert units[2].state is ParamState.GATHERING
    calls.clear()
    fetcher.release_all()
    assert calls == [("release", 2)]
    assert states(units) == [ParamState.SHARDED] * 3


def test_release_skips_sharded_units():
    fetcher, _units, calls = make([10, 10])
    fetcher.release(0)
    assert calls == []
    fetcher.fetch(0, F)
    fetcher.release(0)
    fetcher.release(0)
    assert calls == [("gather", 0), ("release", 0)]


def test_release_all_releases_gathered_and_gathering_sharded_units_only():
    fetcher, units, calls = make([10, 10, 10, 10], persistent={3})
    units[0].state = ParamState.WHOLE
    units[1].state = ParamState.GATHERING
    fetcher.release_all()
    assert calls == [("release", 0), ("release", 1)]
    assert states(units) == [ParamState.SHARDED] * 3 + [ParamState.WHOLE]
    calls.clear()
    fetcher.release_all()
    assert calls == []


def test_forward_and_backward_keep_separate_records():
    fetcher, _units, calls = make([10, 10, 10])
    forward(fetcher, [0, 1, 2])
    fetcher.start(B)
    for i in (2, 1, 0):
        fetcher.fetch(i, B)
        fetcher.release(i)
    fetcher.finish(B)
    calls.clear()
    fetcher.start(B)
    fetcher.fetch(2, B)
    assert calls == [("gather", 2), ("prefetch", 1)]  # backward's order, not forward's
    fetcher.release(2)
    fetcher.release_all()
    calls.clear()
    forward(fetcher, [0])
    assert calls[:2] == [("gather", 0), ("prefetch", 1)]


def test_last_in_forward_follows_the_forward_record():
    fetcher, _units, _calls = make([10, 10, 10])
    forward(fetcher, [0, 1, 2])
    assert not fetcher.last_in_forward(2)  # the first pass had nothing to follow
    fetcher.start(F)
    for i in (0, 1, 2):
        fetcher.fetch(i, F)
        assert fetcher.last_in_forward(i) is (i == 2)
    # the backward record does not change the answer
    fetcher.start(B)
    fetcher.fetch(0, B)
    assert fetcher.last_in_forward(2)


def test_peak_gathered_bytes_is_the_high_water_mark_at_fetch():
    fetcher, _units, _calls = make([10, 20, 30, 5])
    assert fetcher.peak_gathered_bytes == 0
    forward(fetcher, [0, 1, 2, 3])
    assert fetcher.peak_gathered_bytes == 4 * 30  # one unit whole at a time
    forward(fetcher, [0, 1, 2, 3])
    # 0 whole + 1 arriving, 1 + 2 (the peak: 4*(20+30)), 2 + 3, 3 alone
    assert fetcher.peak_gathered_bytes == 4 * 50
    forward(fetcher, [3])  # lower watermarks never lower the peak
    assert fetcher.peak_gathered_bytes == 4 * 50


def test_peak_counts_units_kept_whole():
    fetcher, _units, _calls = make([10, 20, 30], persistent={2})
    forward(fetcher, [0, 1], keep={0, 1})  # persistent unit 2 holds no gathered bytes
    assert fetcher.peak_gathered_bytes == 4 * 30
