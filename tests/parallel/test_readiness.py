"""ReadinessTracker on a real module and a real backward, in one process."""

import torch
from torch import nn

from meshspeed.parallel.readiness import ReadinessTracker


class Net(nn.Module):
    """a -> b -> out, and a branch used only when asked."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(3, 4)
        self.b = nn.Linear(4, 4)
        self.out = nn.Linear(4, 1)
        self.branch = nn.Linear(4, 4)

    def forward(self, x, use_branch=True):
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h))
        if use_branch:
            h = h + self.branch(h)
        return self.out(h).sum()


class Recorder:
    """on_ready callback: which unit fired, and whether its grads were all there then."""

    def __init__(self, units):
        self.units = units
        self.fired = []
        self.complete = []

    def __call__(self, unit):
        self.fired.append(unit)
        self.complete.append(all(p.grad is not None for p in self.units[unit] if p.requires_grad))


def setup(net, units):
    rec = Recorder(units)
    return ReadinessTracker(units, rec), rec


def step(net, tracker, armed=True, **kw):
    tracker.arm(armed)
    net(torch.randn(2, 3), **kw).backward()
    tracker.flush()


def test_each_unit_fires_once_when_all_its_params_have_grads():
    net = Net()
    units = [list(net.a.parameters()), list(net.b.parameters()),
             list(net.branch.parameters()) + list(net.out.parameters())]
    tracker, rec = setup(net, units)
    tracker.arm(True)
    net(torch.randn(2, 3)).backward()
    # backward reaches out and branch first, a last
    assert rec.fired == [2, 1, 0]
    assert rec.complete == [True, True, True]
    tracker.flush()  # everything already fired: flush adds nothing
    assert rec.fired == [2, 1, 0]


def test_fires_again_after_rearming_but_not_twice_in_one_window():
    net = Net()
    units = [list(net.a.parameters()), list(net.b.parameters())]
    tracker, rec = setup(net, units)
    tracker.arm(True)
    net(torch.randn(2, 3)).backward()
    net(torch.randn(2, 3)).backward()  # a second backward in the same armed window
    assert rec.fired == [1, 0]
    step(net, tracker)
    assert rec.fired == [1, 0, 1, 0]


def test_not_armed_nothing_fires_and_grads_still_accumulate():
    net = Net()
    units = [list(net.a.parameters()), list(net.b.parameters())]
    tracker, rec = setup(net, units)
    tracker.arm(False)
    net(torch.randn(2, 3)).backward()
    first = net.a.weight.grad.clone()
    net(torch.randn(2, 3)).backward()
    tracker.flush()  # not armed: flush does not fire the units either
    assert rec.fired == []
    assert not torch.equal(net.a.weight.grad, first)  # accumulated silently
    # a fresh tracker is not armed until told so
    tracker2, rec2 = setup(net, units)
    net(torch.randn(2, 3)).backward()
    tracker2.flush()
    assert rec2.fired == []


def test_flush_fires_incomplete_units_in_unit_order_and_disarms():
    net = Net()
    # units 1 and 3 include the unused branch: they cannot complete in backward
    units = [list(net.a.parameters()), [net.b.weight, net.branch.weight],
             list(net.out.parameters()), [net.branch.bias, net.b.bias]]
    tracker, rec = setup(net, units)
    tracker.arm(True)
    net(torch.randn(2, 3), use_branch=False).backward()
    assert rec.fired == [2, 0]
    tracker.flush()
    assert rec.fired == [2, 0, 1, 3]
    assert not tracker.armed
    net(torch.randn(2, 3), use_branch=False).backward()  # disarmed by flush
    assert rec.fired == [2, 0, 1, 3]


def test_frozen_params_are_ignored():
    net = Net()
    net.b.weight.requires_grad_(False)
    units = [[net.b.weight, net.b.bias], list(net.a.parameters())]
    tracker, rec = setup(net, units)
    assert tracker.expected == [1, 2]
    tracker.arm(True)
    net(torch.randn(2, 3)).backward()
    assert rec.fired == [0, 1]  # unit 0 fires on b.bias alone, before a finishes
    assert rec.complete == [True, True]
    assert net.b.weight.grad is None


def test_unit_without_trainable_params_never_fires():
    net = Net()
    for p in net.b.parameters():
        p.requires_grad_(False)
    units = [list(net.a.parameters()), list(net.b.parameters()), []]
    tracker, rec = setup(net, units)
    assert tracker.expected == [2, 0, 0]
    step(net, tracker)
    assert rec.fired == [0]  # neither in backward nor at flush


def test_remove_detaches_the_hooks():
    net = Net()
    units = [list(net.a.parameters())]
    tracker, rec = setup(net, units)
    tracker.remove()
    tracker.arm(True)
    net(torch.randn(2, 3)).backward()
    assert rec.fired == []
    assert net.a.weight.grad is not None
