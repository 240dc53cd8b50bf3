"""Helpers for the tensor-parallel parity tests: a one-process reference against the same
model split over tp, compared in logical (whole-parameter) form."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from meshspeed.tensor_parallel import apply_tensor_parallel
from meshspeed.topology.degrees import ParallelDims
from meshspeed.topology.mesh import build_topology
from meshspeed.topology.shards import shards_by_name

RTOL = 1e-5


def topology(tp: int):
    return build_topology(ParallelDims(dist.get_world_size(), tp=tp))


def logical_grads(model: torch.nn.Module, group) -> dict[str, torch.Tensor]:
    """Every parameter's gradient in its whole (logical) shape: split ones gathered from
    the tp ranks' pieces, partial ones (sequence-parallel norms) summed over tp."""
    shards = shards_by_name(model)
    partial = set()
    for mod_name, module in model.named_modules():
        for attr in getattr(module, "tp_partial_grads", ()):
            partial.add(f"{mod_name}.{attr}" if mod_name else attr)
    out = {}
    for name, p in model.named_parameters():
        grad = p.grad.detach().clone()
        if name in shards:
            pieces = [None] * dist.get_world_size(group)
            dist.all_gather_object(pieces, (grad, shards[name].to_json()), group=group)
            full = torch.zeros(shards[name].logical_shape)
            for local, shard in pieces:
                type(shards[name]).from_json(shard).logical_into(local, full)
            grad = full
        elif name in partial:
            dist.all_reduce(grad, group=group)
        out[name] = grad
    return out


def compare(ref_loss, ref: dict, loss, got: dict) -> list[str]:
    """Differences beyond RTOL (relative to each tensor's largest entry), as text."""
    bad = []
    if not torch.allclose(loss, ref_loss, rtol=RTOL, atol=0):
        bad.append(f"loss {loss.item()} vs {ref_loss.item()}")
    if set(ref) != set(got):
        bad.append(f"parameter names differ: {sorted(set(ref) ^ set(got))}")
    for name, want in ref.items():
        if name not in got:
            continue
        scale = want.abs().max().clamp_min(1e-30)
        err = (got[name] - want).abs().max() / scale
        if err > RTOL:
            bad.append(f"{name}: relative error {err.item():.2e}")
    return bad


def check_parity(model, run, *, tp: int = 2, plan=None, sequence_parallel=False) -> list[str]:
    """run(model) -> scalar loss. Reference on a deep copy, then the tp model; returns the
    problems found (empty: parity)."""
    ref_model = copy.deepcopy(model)
    ref_loss = run(ref_model)
    ref_loss.backward()
    ref = {n: p.grad.detach().clone() for n, p in ref_model.named_parameters()}
    mesh = topology(tp)
    names = [n for n, _ in model.named_parameters()]
    apply_tensor_parallel(model, mesh, plan, sequence_parallel=sequence_parallel)
    if [n for n, _ in model.named_parameters()] != names:
        return ["parameter names changed by apply_tensor_parallel"]
    loss = run(model)
    loss.backward()
    return compare(ref_loss.detach(), ref, loss.detach(), logical_grads(model, mesh.group("tp")))
