"""The FLOPs profiler: FLOPs, MACs, parameters and forward latency, per module.

Two ways in, with DeepSpeed's names and return values:

    flops, macs, params = get_model_profile(model, args=[tokens])      # one forward

    prof = FlopsProfiler(model)                                          # any region
    prof.start_profile(); loss = model(x, y); loss.backward(); prof.stop_profile()
    prof.get_total_flops(); prof.print_model_profile(); prof.end_profile()

Note [counting by dispatch]: FLOPs are read from the aten ops that actually run, seen by
a TorchDispatchMode, rather than from formulas per module type: a custom module, a
functional call or a fused attention kernel then needs no rule of its own, and backward
ops (which never pass through a module's forward) are counted too. Module forward hooks
keep a stack of the modules being run; an op is credited to every module on the stack
(a module's figure includes its children's, as in DeepSpeed's table) and to the top one
as its own. Ops run outside any module forward (the backward, an optimizer) count in the
total only. What counts as a FLOP: Note [what counts as a FLOP] in op_flops.py.

Latency is the wall time between a module's forward pre-hook and its forward hook,
summed over calls; on an accelerator the device is synchronised at both ends, which
slows the profiled step but makes the numbers true.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from meshspeed.profiling.op_flops import op_macs
from meshspeed.profiling.report import format_profile, human, param_numel


@dataclass
class ModuleStats:
    """One module's figures over the profiled region (forward passes only)."""

    macs: int = 0  # multiply-adds of its forward, children included
    own_macs: int = 0  # ... of ops it ran itself, outside any child module
    latency: float = 0.0  # seconds in its forward, summed over calls
    calls: int = 0

    @property
    def flops(self) -> int:
        return 2 * self.macs


class _CountOps(TorchDispatchMode):
    """Credits each counted op to the profiler (Note [counting by dispatch])."""

    def __init__(self, profiler: FlopsProfiler) -> None:
        super().__init__()
        self.profiler = profiler

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        macs = op_macs(func, args, kwargs, out)
        if macs:
            self.profiler._credit(macs)
        return out


def _sync(device_type: str) -> None:
    if device_type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize()


class FlopsProfiler:
    """Measures `model` between start_profile() and stop_profile().

    `ds_engine` is accepted for DeepSpeed's signature; the meshspeed engine drives the
    profiler itself (the `flops_profiler` config block). `recompute_fwd_factor` is
    DeepSpeed's knob for activation checkpointing; here a recomputed forward runs its
    ops again and is counted as it runs, so the factor is only checked."""

    def __init__(self, model: nn.Module, ds_engine=None, recompute_fwd_factor: float = 0.0) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"FlopsProfiler(model): expected a torch.nn.Module, got {type(model).__name__}")
        if not 0.0 <= recompute_fwd_factor <= 1.0:
            raise ValueError(f"recompute_fwd_factor={recompute_fwd_factor} must be between 0 and 1")
        self.model = model
        self.stats: dict[nn.Module, ModuleStats] = {}
        self.total_macs = 0  # everything counted, inside modules or not (backward included)
        self.started = False
        self._ignore: tuple[type, ...] = ()
        self._stack: list[nn.Module] = []
        self._starts: list[float] = []
        self._handles: list = []
        self._mode: _CountOps | None = None
        self._device_type = next((p.device.type for p in model.parameters()), "cpu")

    # -- the region -----------------------------------------------------------------------
    def start_profile(self, ignore_list: Sequence[type] | None = None) -> None:
        """Start counting. Modules whose type is in `ignore_list` (and their children)
        are not counted."""
        if self.started:
            raise RuntimeError("FlopsProfiler.start_profile() called twice; call stop_profile() first")
        self.reset_profile()
        self._ignore = tuple(ignore_list or ())
        for module in self.model.modules():
            self._handles.append(module.register_forward_pre_hook(self._enter))
            self._handles.append(module.register_forward_hook(self._leave, always_call=True))
        self._mode = _CountOps(self)
        self._mode.__enter__()
        torch.zeros(1).add_(1)  # the first op in a dispatch mode pays a one-time setup cost:
        self.started = True  # pay it here, not inside the first module's latency

    def stop_profile(self) -> None:
        """Stop counting; the figures stay readable until end_profile()."""
        if not self.started:
            return
        self._mode.__exit__(None, None, None)
        self._mode = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.started = False

    def reset_profile(self) -> None:
        self.stats = {m: ModuleStats() for m in self.model.modules()}
        self.total_macs = 0
        self._stack.clear()
        self._starts.clear()

    def end_profile(self) -> None:
        """Stop and forget the figures."""
        self.stop_profile()
        self.stats = {}
        self.total_macs = 0

    # -- hooks ----------------------------------------------------------------------------
    def _enter(self, module: nn.Module, args) -> None:
        _sync(self._device_type)
        self._stack.append(module)
        self._starts.append(time.perf_counter())

    def _leave(self, module: nn.Module, args, output) -> None:
        if not self._stack or self._stack[-1] is not module:
            return  # a hook registered mid-forward: its pre-hook never ran
        _sync(self._device_type)
        stats = self.stats.setdefault(module, ModuleStats())
        stats.latency += time.perf_counter() - self._starts.pop()
        stats.calls += 1
        self._stack.pop()

    def _credit(self, macs: int) -> None:
        if self._ignore and any(isinstance(m, self._ignore) for m in self._stack):
            return
        self.total_macs += macs
        for module in self._stack:
            self.stats.setdefault(module, ModuleStats()).macs += macs
        if self._stack:
            self.stats[self._stack[-1]].own_macs += macs

    # -- figures (DeepSpeed's accessors) ---------------------------------------------------
    def get_total_flops(self, as_string: bool = False):
        """FLOPs of everything counted: the model's forwards and whatever else ran in the
        region (a backward, recomputed forwards)."""
        return human(2 * self.total_macs, "FLOPs") if as_string else 2 * self.total_macs

    def get_total_macs(self, as_string: bool = False):
        return human(self.total_macs, "MACs") if as_string else self.total_macs

    def get_total_params(self, as_string: bool = False):
        params = sum(param_numel(p) for p in self.model.parameters())
        return human(params, "") if as_string else params

    def get_total_duration(self, as_string: bool = False):
        """Seconds spent in the model's forward passes in the region."""
        seconds = self.stats.get(self.model, ModuleStats()).latency
        return f"{seconds * 1e3:.2f} ms" if as_string else seconds

    def forward_macs(self) -> int:
        """Multiply-adds of the model's forward passes only (the root module's figure)."""
        return self.stats.get(self.model, ModuleStats()).macs

    def module_stats(self) -> dict[str, ModuleStats]:
        """{qualified module name ("" for the model): its figures}. A container that is
        never called itself (an nn.ModuleList) gets the sum of its children's."""
        return {name: self._stats_of(m) for name, m in self.model.named_modules()}

    def _stats_of(self, module: nn.Module) -> ModuleStats:
        own = self.stats.get(module, ModuleStats())
        if own.calls:
            return own
        parts = [self._stats_of(child) for child in module.children()]
        return ModuleStats(macs=sum(p.macs for p in parts), latency=sum(p.latency for p in parts))

    def print_model_profile(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                            detailed: bool = True, output_file: str | None = None) -> str:
        """Print the profile (or append it to `output_file`); returns the text too."""
        text = format_profile(self, profile_step=profile_step, module_depth=module_depth,
                              top_modules=top_modules, detailed=detailed)
        if output_file:
            with open(output_file, "a") as f:
                f.write(text + "\n")
        else:
            print(text)
        return text


def get_model_profile(model: nn.Module, input_shape: Sequence[int] | None = None, args=[], kwargs={},  # noqa: B006
                      print_profile: bool = True, detailed: bool = True, module_depth: int = -1,
                      top_modules: int = 1, warm_up: int = 1, as_string: bool = True,
                      output_file: str | None = None, ignore_modules: Sequence[type] | None = None,
                      mode: str = "forward"):
    """Profile one forward of `model` (or one `model.generate` with mode="generate").

    The input is `model(*args, **kwargs)`, or, with `input_shape`, one tensor of that
    shape filled with ones in the parameters' dtype and device (DeepSpeed's behaviour:
    a model that takes token ids wants `args=[ids]` instead). `warm_up` unprofiled passes
    run first. Runs under torch.no_grad. Returns (flops, macs, params) of the forward,
    as strings when `as_string`."""
    if mode not in ("forward", "generate"):
        raise ValueError(f"get_model_profile(mode={mode!r}): expected 'forward' or 'generate'")
    if input_shape is not None:
        if args or kwargs:
            raise ValueError("get_model_profile: give either input_shape or args/kwargs, not both")
        if not isinstance(input_shape, (tuple, list)) or not all(isinstance(n, int) for n in input_shape):
            raise ValueError(f"get_model_profile(input_shape={input_shape!r}): expected a tuple of ints")
        p = next(model.parameters(), None)
        dtype, device = (p.dtype, p.device) if p is not None else (torch.float32, "cpu")
        args = [torch.ones(tuple(input_shape), dtype=dtype, device=device)]
    elif not args and not kwargs:
        raise ValueError("get_model_profile: give the model's input as input_shape=(...) or args=[...]/kwargs")
    run = model.generate if mode == "generate" else model
    prof = FlopsProfiler(model)
    with torch.no_grad():
        for _ in range(warm_up):
            run(*args, **kwargs)
        prof.start_profile(ignore_list=ignore_modules)
        run(*args, **kwargs)
        prof.stop_profile()
    flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
    if print_profile:
        prof.print_model_profile(profile_step=warm_up, module_depth=module_depth,
                                 top_modules=top_modules, detailed=detailed, output_file=output_file)
    prof.end_profile()
    if as_string:
        return human(flops, "FLOPs"), human(macs, "MACs"), human(params, "")
    return flops, macs, params
