"""ZeRO-Inference: a model's decoder layers partitioned across ranks (or offloaded to host
memory or NVMe) and gathered layer by layer, with prefetch, while the model runs.

    zi = partition_for_inference(model, {"stage": 3, "offload_param": {"device": "cpu"},
                                         "prefetch_layers": 1}, group)
    logits = model(input_ids)          # or model.generate(...): the hooks do the gathering
    zi.peak_resident_bytes             # the most weight bytes held at once
    zi.close()

Units. Each decoder layer is one unit: its parameters are laid out in one flat buffer
(meshspeed/parallel/zero/flat.py's `FlatLayout`, padded to a multiple of the ranks) and
each rank keeps its 1/N range of it, the shard. Everything else (embeddings, final norm,
lm_head, tied or not) is one more unit that stays whole on every rank: it is used at both
ends of every forward, so partitioning it would gather it twice per token for little
memory in a deep model.

Where the shard lives (`offload_param.device`): "none" on the compute device; "cpu" in
host memory (pinned if asked and the accelerator can use it); "nvme" in one file per unit
under `nvme_path`, read into a staging buffer when needed (meshspeed/offload's swap
engine and per-rank swap directory). The parameters' storage is freed and each parameter
points at an empty placeholder, as stage-3 training does (Note [freeing storage, not
swapping tensors] in flat.py), so code holding the parameter objects keeps working.

Note [gather on forward, release after]
A forward pre-hook on the unit's module gathers the unit (all-gather of the shards; with
one rank a copy from host or file) and points the parameters at the full buffer; the
forward hook frees that buffer again. The pre-hook then starts the next `prefetch_layers`
units in module order so their transfer overlaps this layer's compute: with shards in
memory their all-gathers are launched (async); with shards on NVMe the file reads are
started, and a unit whose read was started one layer earlier has its all-gather launched
(reads are what is slow there). Prefetch never wraps past the last layer: a gather left in
flight after a forward would hold a unit between calls, and collectives must be issued in
the same order on every rank. Hooks count nested calls, so a wrapper module attached to
the same unit (`attach`) and the layer inside it gather once. Because hooks fire on every
forward, `model(x)` and Hugging Face `generate()` both work; every rank must run the same
forwards (the all-gathers are collectives). The gathered buffer is freed after forward, so
backward through a partitioned model is not supported (training uses ZeRO-3 proper).

Note [what peak_resident_bytes counts]
Bytes of weights held at any moment: the whole non-layer unit, the shards held in memory
(device or host; none for NVMe), the full buffers of units gathered or being gathered,
staging buffers of NVMe reads (kept for reuse, never more than were in use at once), and,
on an accelerator with several ranks, device copies of host shards while their all-gather
is in flight (one rank copies from the host straight into the full buffer). Host and
device bytes are summed: on the CPU they are the same memory. With L equal layers of F
full bytes, shard bytes s = F/N (padded) and staging bytes S (s rounded up to 4 KiB),
the schedule above gives exactly, on the CPU, for L >= prefetch + 2:
    "none" / "cpu": replicated + L*s + (1 + prefetch) * F
    "nvme":         replicated + max(1, prefetch) * (F + S)
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from meshspeed import comm
from meshspeed.inference.config import ZeroInferenceConfig
from meshspeed.offload.aio import SwapEngine
from meshspeed.offload.hostmem import ALIGN, host_empty, round_up
from meshspeed.offload.swapdir import SwapDir
from meshspeed.parallel.zero.flat import FlatLayout
from meshspeed.parallel.zero.lifecycle import LifecycleError
from meshspeed.process.malloc import release_free_heap, tune_host_allocator

__all__ = ["ZeroInference", "ZeroInferenceConfig", "find_decoder_layers", "partition_for_inference"]

# -- where a unit's shard lives ----------------------------------------------------------------


class _Meter:
    """Weight bytes held now and at most (Note [what peak_resident_bytes counts])."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    def add(self, nbytes: int) -> None:
        self.now += nbytes
        self.peak = max(self.peak, self.now)

    def sub(self, nbytes: int) -> None:
        self.now -= nbytes


class _MemoryHome:
    """Shards kept in memory: on the compute device ("none") or the host ("cpu")."""

    reads = False  # no read phase: the gather can start at once

    def __init__(self, device: torch.device, host: bool, pin: bool, meter: _Meter):
        self.device, self.host, self.pin, self.meter = device, host, pin, meter
        self.shards: dict[int, torch.Tensor] = {}
        self._copies: dict[int, torch.Tensor] = {}  # device copies of host shards in flight

    def keep(self, i: int, shard: torch.Tensor) -> None:
        if self.host and shard.device.type != "cpu":
            kept = host_empty(shard.numel(), shard.dtype, pin=self.pin)
            kept.copy_(shard)
        elif self.host and self.pin:  # already on the host: pin it if asked (and possible)
            kept = host_empty(shard.numel(), shard.dtype, pin=True)
            kept.copy_(shard)
        else:
            kept = shard
        self.shards[i] = kept
        self.meter.add(_nbytes(kept))

    def start(self, i: int) -> None:
        pass

    def ready(self, i: int, on_device: bool) -> torch.Tensor:
        shard = self.shards[i]
        if shard.device == self.device or not on_device:
            return shard
        copy = shard.to(self.device, non_blocking=True)
        self._copies[i] = copy
        self.meter.add(_nbytes(copy))
        return copy

    def done(self, i: int) -> None:
        copy = self._copies.pop(i, None)
        if copy is not None:
            self.meter.sub(_nbytes(copy))

    def close(self) -> None:
        pass


class _NvmeHome:
    """Shards in files `unit<i>.shard` of this rank's swap directory; a read goes into an
    aligned host staging buffer (O_DIRECT-sized, aio.py Note [O_DIRECT where it fits]).
    Freed staging buffers are kept for the next read, never more than were in use at once."""

    reads = True

    def __init__(self, device: torch.device, nvme_path: str, rank: int, pin: bool, meter: _Meter):
        self.device, self.pin, self.meter = device, pin, meter
        self.swap = SwapDir(nvme_path, rank)
        self.dir = self.swap.sub("zero_inference")
        self.engine = SwapEngine()
        self.numel: dict[int, int] = {}
        self.dtype: dict[int, torch.dtype] = {}
        self._free: list[torch.Tensor] = []
        self._reading: dict[int, tuple] = {}  # unit -> (request, staging buffer)
        self._held: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # staging, device copy

    def path(self, i: int) -> str:
        return f"{self.dir}/unit{i}.shard"

    def keep(self, i: int, shard: torch.Tensor) -> None:
        self.numel[i], self.dtype[i] = shard.numel(), shard.dtype
        buf = self._take(i)
        self._typed(buf, i).copy_(shard.reshape(-1))
        self.engine.write(buf, self.path(i)).wait()
        self._give_back(buf)

    def start(self, i: int) -> None:
        buf = self._take(i)
        self._reading[i] = (self.engine.read(buf, self.path(i)), buf)

    def ready(self, i: int, on_device: bool) -> torch.Tensor:
        request, buf = self._reading.pop(i)
        request.wait()
        shard = self._typed(buf, i)
        copy = None
        if shard.device != self.device and on_device:
            copy = shard.to(self.device, non_blocking=True)
            self.meter.add(_nbytes(copy))
        self._held[i] = (buf, copy)
        return shard if copy is None else copy

    def done(self, i: int) -> None:
        buf, copy = self._held.pop(i)
        if copy is not None:
            self.meter.sub(_nbytes(copy))
        self._give_back(buf)

    def close(self) -> None:
        for i in list(self._reading):
            self._reading.pop(i)[0].wait()
        self.engine.close()
        self._free.clear()
        self.swap.close()

    def _staging_bytes(self, i: int) -> int:
        return round_up(self.numel[i] * torch.empty((), dtype=self.dtype[i]).element_size(), ALIGN)

    def _take(self, i: int) -> torch.Tensor:
        nbytes = self._staging_bytes(i)
        for k, buf in enumerate(self._free):
            if buf.numel() == nbytes:
                return self._free.pop(k)
        self.meter.add(nbytes)
        return host_empty(nbytes, torch.uint8, pin=self.pin, align=ALIGN)

    def _give_back(self, buf: torch.Tensor) -> None:
        self._free.append(buf)

    def _typed(self, buf: torch.Tensor, i: int) -> torch.Tensor:
        es = torch.empty((), dtype=self.dtype[i]).element_size()
        return buf[: self.numel[i] * es].view(self.dtype[i])


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# -- one unit --------------------------------------------------------------------------------


class UnitState(enum.Enum):
    SHARDED = "sharded"  # only the shard is held; parameters point at a placeholder
    READING = "reading"  # the shard is being read from its file (NVMe)
    GATHERING = "gathering"  # the all-gather (or copy) into the full buffer is in flight
    WHOLE = "whole"  # the full buffer is resident and the parameters are views of it


class _Unit:
    """One decoder layer's parameters: its flat layout, full buffer and lifecycle."""

    def __init__(self, index: int, name: str, params: list[nn.Parameter], group, world: int,
                 rank: int, home, meter: _Meter):
        self.index, self.name, self.params = index, name, params
        self.group, self.world, self.home, self.meter = group, world, home, meter
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) != 1:
            raise ValueError(f"unit {name}: its parameters have several dtypes/devices "
                             f"{sorted(map(str, kinds))}; cast the model to one dtype and device first")
        self.dtype, self.device = next(iter(kinds))
        self.shapes = [p.shape for p in params]
        self.layout = FlatLayout(tuple(p.numel() for p in params), world)
        es = torch.empty((), dtype=self.dtype).element_size()
        self.full_bytes = self.layout.padded_numel * es
        self.shard_bytes = self.layout.shard_numel * es
        shard = torch.zeros(self.layout.shard_numel, dtype=self.dtype, device=self.device)
        for span, p in zip(self.layout.spans(rank), params):
            shard[span.offset : span.offset + span.numel].copy_(
                p.detach().reshape(-1)[span.start : span.start + span.numel])
        home.keep(index, shard)
        # allocated, never touched, then emptied: views need the buffer's size
        self.flat = torch.empty(self.layout.padded_numel, dtype=self.dtype, device=self.device)
        self.views = [self.flat[o : o + n].view(s)
                      for o, n, s in zip(self.layout.offsets, self.layout.numels, self.shapes)]
        self._placeholder = torch.empty(0, dtype=self.dtype, device=self.device)
        self.flat.untyped_storage().resize_(0)
        for p in params:
            p.data = self._placeholder  # Note [freeing storage, not swapping tensors], flat.py
        self.state = UnitState.SHARDED
        self.in_use = 0  # forwards of modules attached to this unit running now
        self._work = None
        self._copied = None  # a CUDA event: the host-to-device copy of a gather has finished

    def start(self) -> None:
        """SHARDED -> READING (NVMe) or straight on to GATHERING."""
        self._expect(UnitState.SHARDED, "started")
        if self.home.reads:
            self.home.start(self.index)
            self.state = UnitState.READING
        else:
            self.launch()

    def launch(self) -> None:
        """-> GATHERING: allocate the full buffer, all-gather (or copy) the shards into it."""
        if self.state is UnitState.SHARDED and self.home.reads:
            self.start()
        if self.state not in (UnitState.SHARDED, UnitState.READING):
            raise LifecycleError(f"unit {self.name}: gather launched while {self.state.value}")
        # one rank copies straight from host memory; an all-gather needs its input on the device
        src = self.home.ready(self.index, on_device=self.world > 1)
        self.flat.untyped_storage().resize_(self.full_bytes)
        self.meter.add(self.full_bytes)
        if self.world == 1:
            self.flat.copy_(src, non_blocking=True)
        else:
            self._work = comm.all_gather_into_tensor(self.flat, src, group=self.group, async_op=True)
        if src.device.type == "cpu" and self.device.type == "cuda":
            # the asynchronous copy reads a host buffer that `done` may hand to the next read
            self._copied = torch.cuda.Event()
            self._copied.record()
        self.state = UnitState.GATHERING

    def finish(self) -> None:
        """-> WHOLE: wait for the gather, point the parameters at the full buffer."""
        if self.state is not UnitState.GATHERING:
            self.launch()
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        self.home.done(self.index)
        for p, view in zip(self.params, self.views):
            p.data = view
        self.state = UnitState.WHOLE

    def release(self) -> None:
        """WHOLE or in flight -> SHARDED: free the full buffer."""
        if self.in_use:
            raise LifecycleError(f"unit {self.name}: released while its module's forward runs")
        if self.state is UnitState.SHARDED:
            return
        if self.state is UnitState.READING:
            self.finish()  # a read in flight is simply completed (and its buffer returned)
        elif self.state is UnitState.GATHERING:
            self.finish()
        self.flat.untyped_storage().resize_(0)
        self.meter.sub(self.full_bytes)
        for p in self.params:
            p.data = self._placeholder
        self.state = UnitState.SHARDED

    def _expect(self, state: UnitState, what: str) -> None:
        if self.state is not state:
            raise LifecycleError(f"unit {self.name}: {what} while {self.state.value}, "
                                 f"expected {state.value}")


# -- the model ----------------------------------------------------------------------------------


class ZeroInference:
    """The partitioned model's units and hooks (made by `partition_for_inference`).

    `units[i]` is decoder layer i; `replicated_bytes` the whole non-layer parameters.
    `peak_resident_bytes` / `resident_bytes`: Note [what peak_resident_bytes counts]."""

    def __init__(self, model: nn.Module, layers: Sequence[nn.Module], config: ZeroInferenceConfig,
                 group, names: Sequence[str]):
        self.module = model
        self.config = config
        self.group = group
        initialized = comm.is_initialized()
        if group is not None and not initialized:
            raise ValueError("a process group was passed but torch.distributed is not initialized; "
                             "initialize it first (meshspeed.init_distributed) or pass group=None for one process")
        self.world = comm.get_world_size(group) if initialized else 1
        self.rank = comm.get_rank(group) if initialized else 0
        self.meter = _Meter()
        layer_params = [list(layer.parameters()) for layer in layers]
        owner: dict[int, str] = {}
        for name, params in zip(names, layer_params):
            if not params:
                raise ValueError(f"layer {name} has no parameters; pass as layers only modules that hold weights")
            for p in params:
                if id(p) in owner:
                    raise ValueError(f"a parameter of {name} is shared with {owner[id(p)]}; "
                                     "units cannot share parameters (keep shared weights outside the layers)")
                owner[id(p)] = name
        self.replicated = [p for p in model.parameters() if id(p) not in owner]
        self.replicated_bytes = sum(_nbytes(p) for p in self.replicated)
        self.meter.add(self.replicated_bytes)
        device = layer_params[0][0].device
        if device.type == "cpu":
            tune_host_allocator()  # freed unit buffers go back to the OS (meshspeed/process/malloc.py)
        if config.device == "nvme":
            global_rank = comm.get_rank() if initialized else 0
            self.home = _NvmeHome(device, config.nvme_path, global_rank, config.pin_memory, self.meter)
        else:
            self.home = _MemoryHome(device, config.device == "cpu", config.pin_memory, self.meter)
        self.units = [_Unit(i, name, params, group, self.world, self.rank, self.home, self.meter)
                      for i, (name, params) in enumerate(zip(names, layer_params))]
        self.meter.peak = self.meter.now  # partitioning held one unit's source at a time
        if device.type == "cpu":
            release_free_heap()  # the freed weights below the mmap threshold, back to the OS
        self._handles: list = []
        for i, layer in enumerate(layers):
            self.attach(layer, i)
        self.closed = False

    @property
    def peak_resident_bytes(self) -> int:
        return self.meter.peak

    @property
    def resident_bytes(self) -> int:
        return self.meter.now

    def reset_peak(self) -> None:
        self.meter.peak = self.meter.now

    def attach(self, module: nn.Module, unit_index: int) -> None:
        """Gather unit `unit_index` whenever `module`'s forward runs (a wrapper of the layer,
        or any module that uses the unit's parameters). Nested attached calls gather once."""
        if not 0 <= unit_index < len(self.units):
            raise IndexError(f"unit_index {unit_index} is out of range: the model has "
                             f"{len(self.units)} layer units (0..{len(self.units) - 1})")
        self._handles.append(module.register_forward_pre_hook(lambda m, a: self._before(unit_index)))
        self._handles.append(module.register_forward_hook(lambda m, a, o: self._after(unit_index),
                                                          always_call=True))

    def _before(self, i: int) -> None:
        """Note [gather on forward, release after]."""
        unit = self.units[i]
        if unit.state is not UnitState.WHOLE:
            unit.finish()
        unit.in_use += 1
        ahead = self.units[i + 1 : i + 1 + self.config.prefetch_layers]
        for nxt in ahead:  # reads started one layer ago move on to their all-gather first
            if nxt.state is UnitState.READING:
                nxt.launch()
        for nxt in ahead:
            if nxt.state is UnitState.SHARDED:
                nxt.start()

    def _after(self, i: int) -> None:
        unit = self.units[i]
        unit.in_use -= 1
        if unit.in_use == 0:
            unit.release()

    def release_all(self) -> None:
        """Complete anything in flight and free every full buffer (after a partial forward)."""
        for unit in self.units:
            unit.in_use = 0
            unit.release()

    def close(self) -> None:
        """Remove the hooks and this rank's shard files. The model is unusable afterwards
        (its layers' parameters stay placeholders)."""
        if self.closed:
            return
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.release_all()
        self.home.close()
        self.closed = True


def find_decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's decoder layers: the nn.ModuleList of same-type blocks holding the most
    parameters (`transformer.h` of HF GPT-2, `model.layers` of Llama, `layers` of GPT)."""
    best, best_size = None, 0
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0 and len({type(m) for m in mod}) == 1:
            size = sum(p.numel() for p in mod.parameters())
            if size > best_size:
                best, best_size = (name, mod), size
    if best is None:
        raise ValueError(f"found no nn.ModuleList of repeated blocks in {type(model).__name__}; "
                         "pass layers=[...] (its decoder layers) to partition_for_inference")
    return best


def partition_for_inference(model: nn.Module, config: Mapping | ZeroInferenceConfig | None = None,
                            group=None, *, layers: Sequence[nn.Module] | None = None) -> ZeroInference:
    """Partition `model`'s decoder layers (or `layers`, one unit each) across `group` (the
    default group when initialized, else this process alone) and offload them as `config`
    (the inference config's `zero` section) says; returns the handle of units and hooks.
    The model is changed in place; run it as before (Note [gather on forward, release after])."""
    cfg = config if isinstance(config, ZeroInferenceConfig) else \
        ZeroInferenceConfig.from_dict({"stage": 3} if config is None else config)
    if layers is None:
        prefix, layers = find_decoder_layers(model)
        names = [f"{prefix}.{i}" for i in range(len(layers))]
    else:
        layers = list(layers)
        if not layers:
            raise ValueError("layers is empty; pass the model's decoder layers (or None to find them)")
        where = {id(m): n for n, m in model.named_modules()}
        names = [where.get(id(m), f"layers[{i}]") for i, m in enumerate(layers)]
    return ZeroInference(model, list(layers), cfg, group, names)
