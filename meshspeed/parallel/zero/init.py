"""`meshspeed.zero.Init`: build a model whose parameters are partitioned as they are created.

    torch.manual_seed(seed)
    with meshspeed.zero.Init():
        model = GPT2LMHeadModel(config)   # no rank ever holds the whole model

Note [partitioned construction]
The model is built exactly as it would be without the context (same code, same order),
but on the meta device, while a recorder (replay.py, Note [recorded construction])
remembers how each tensor gets its values: constructor writes, `reset_parameters`, and
initialisation that runs over the whole model after construction (Hugging Face's
`post_init`, the reference GPT's `init_weights`). On exit, each parameter in turn is
replayed into real memory, this rank's slice of it is kept (init_shards.py) and the
full tensor is dropped; buffers are replayed whole. Random ops are replayed with the
generator states the ordinary build would have had, so:

- the parameters and buffers are bit for bit those of the same model built without the
  context after the same `torch.manual_seed`, and the CPU generator ends where that
  build leaves it;
- every rank builds rank 0's model: rank 0's generator state is broadcast on entry
  (DeepSpeed broadcasts rank 0's values too), so the slices fit together even if the
  ranks were seeded differently; `seed=` seeds the generator on entry;
- peak memory is this rank's slices plus one tensor being replayed (and what it is
  computed from);
- nothing uninitialised is exposed: the unwritten parts of a parameter or buffer are
  zeros, and a parameter that construction never (completely) writes must be written in a
  `GatheredParameters(..., modifier_rank=r)` block before `meshspeed.initialize`, which
  raises naming it otherwise (Note [initialised after the build] in init_shards.py).

No torch class or function is patched: the recorder is a dispatch mode, the models
created are found through torch's module registration hooks, and parameters keep their
identity (their contents are swapped with `torch.utils.swap_tensors`), so ties and
registrations made during construction (`register_external_parameter`) hold.

`Init(module=model)` partitions a model built before instead (rank 0's values).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils.weak import WeakIdKeyDictionary

from meshspeed import comm
from meshspeed.parallel.zero.init_shards import InitShards, is_partitioned
from meshspeed.parallel.zero.init_spill import ChunkFile, nvme_path_from, offload_param_of
from meshspeed.parallel.zero.replay import Recorder, UninitialisedError, _is_meta
from meshspeed.process.distributed import init_distributed
from meshspeed.process.malloc import release_free_heap, tune_host_allocator
from meshspeed.process.progress import progress


class Init:
    """Partition parameters as modules are built (see Note [partitioned construction])."""

    def __init__(self, module: nn.Module | None = None, data_parallel_group=None,
                 config_dict_or_path=None, config=None, enabled: bool = True,
                 dtype: torch.dtype | None = None, remote_device=None, pin_memory: bool = False,
                 mpu=None, seed: int | None = None, **_deepspeed_options):
        self.group = data_parallel_group
        self.enabled = enabled
        if remote_device not in (None, "none", "cpu", "nvme"):
            raise ValueError(f"zero.Init: remote_device {remote_device!r} is not one of None, "
                             "\"cpu\" or \"nvme\"")
        # "nvme": chunks go to a file as they are cut (Note [building straight to NVMe]);
        # unset, it follows the config's offload_param.device, as in DeepSpeed
        config = config_dict_or_path if config_dict_or_path is not None else config
        offload = offload_param_of(config)
        if remote_device is None:
            remote_device = offload.device if offload is not None else None
        self._spill_dir = nvme_path_from(offload) if remote_device == "nvme" and enabled else None
        self.dtype = dtype
        self.seed = seed
        self.peak_materialized_bytes = 0
        self._recorder: Recorder | None = None
        # modules seen while building, by identity and held weakly: an id() could be
        # reused by a later module once a temporary one is collected, and would then mark
        # a root as somebody's child (and leave it unpartitioned)
        self._parents: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._children: WeakIdKeyDictionary = WeakIdKeyDictionary()
        if module is not None and enabled:
            self._partition_built(module)

    @torch.no_grad()
    def _partition_built(self, module: nn.Module) -> None:
        """`Init(module=m)`: partition a model built before, from rank 0's values."""
        _ensure_distributed()
        shards = InitShards(self.group, self._spill())
        for p in module.parameters():
            if not is_partitioned(p):
                comm.broadcast(p.data, src=0, group=self.group)
                shards.adopt(p, p.detach(), self.dtype or p.dtype)

    def __enter__(self):
        if not self.enabled or _recording():
            self.enabled = False  # nested in another Init: the outer one partitions
            return self
        _ensure_distributed()
        # the replay frees a full tensor per parameter: with glibc's adaptive mmap threshold
        # those below 32 MiB would pile up in its heaps (Note [a fixed mmap threshold for
        # CPU training]); initialize sets the same threshold
        tune_host_allocator()
        if self.seed is not None:
            torch.manual_seed(self.seed)
        if comm.get_world_size(self.group) > 1:  # every rank builds rank 0's model
            torch.set_rng_state(comm.broadcast_object(torch.get_rng_state(), src=0, group=self.group))
        self._handles = [
            module_hooks.register_module_module_registration_hook(self._on_submodule),
            module_hooks.register_module_parameter_registration_hook(self._on_tensor),
            module_hooks.register_module_buffer_registration_hook(self._on_tensor),
        ]
        self._recorder = Recorder()
        self._recorder.__enter__()
        return self

    def _on_submodule(self, module, name, submodule):
        self._parents[module] = True
        if submodule is not None:
            self._children[submodule] = True

    def _on_tensor(self, module, name, tensor):
        self._parents[module] = True

    def __exit__(self, exc_type, exc, tb):
        if not self.enabled:
            return False
        recorder, self._recorder = self._recorder, None
        recorder.__exit__(exc_type, exc, tb)
        for h in self._handles:
            h.remove()
        try:
            if exc_type is None:
                shards = InitShards(self.group, self._spill())
                for root in [m for m in list(self._parents.keys()) if m not in self._children]:
                    self._materialize(root, recorder, shards)
        finally:
            recorder.release_scratch()
            self.peak_materialized_bytes = recorder.peak_bytes
            if self._spill_dir is not None:
                # the replay's freed temporaries stay in glibc's heaps otherwise (0.5 GiB
                # resident after building a 0.49B model, 0.08 GiB after the trim)
                release_free_heap()
            self._parents.clear()
            self._children.clear()
        return False

    def _spill(self):
        if self._spill_dir is None:
            return None
        return ChunkFile(self._spill_dir, comm.get_rank())

    @torch.no_grad()
    def _materialize(self, root: nn.Module, recorder: Recorder, shards: InitShards) -> None:
        named = list(root.named_parameters())
        with progress(len(named), "zero.Init: building the parameters", unit="tensor") as bar:
            for name, p in named:
                self._materialize_param(root, recorder, shards, name, p)
                bar.update()
        replaced: dict[int, torch.Tensor] = {}
        for module in root.modules():
            for bname, b in list(module._buffers.items()):
                if b is None:
                    continue
                if id(b) not in replaced:
                    value = recorder.value_of(b, unwritten_as_zeros=True) if recorder.is_recorded(b) else b
                    if self.dtype is not None and value.is_floating_point():
                        value = value.to(self.dtype)
                    replaced[id(b)] = value
                module._buffers[bname] = replaced[id(b)]

    def _materialize_param(self, root: nn.Module, recorder: Recorder, shards: InitShards, name: str,
                           p: nn.Parameter) -> None:
        if is_partitioned(p):
            return  # shared with a root built before
        if _is_meta(p) and not recorder.is_recorded(p):
            raise UninitialisedError(f"zero.Init: parameter {name!r} of {type(root).__name__} is a meta "
                                     "tensor created outside the context; it has no values to partition")
        pending = None
        try:
            full = recorder.value_of(p, transient=True) if _is_meta(p) else p.detach()
        except UninitialisedError as err:  # Note [initialised after the build] in init_shards.py
            pending = f"not written while the model is built under zero.Init ({err})"
            full = recorder.value_of(p, transient=True, unwritten_as_zeros=True)
        if _is_meta(p):
            p = _make_real(root, p, full.dtype)
        shards.adopt(p, full, self.dtype or full.dtype, pending=pending)


def _make_real(root: nn.Module, p: nn.Parameter, dtype: torch.dtype) -> nn.Parameter:
    """A CPU parameter in place of the meta one: the same object where torch allows it
    (ties and registrations made while building hold), else a new one in every module
    that holds it."""
    real = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=p.requires_grad)
    real.__dict__.update({k: v for k, v in p.__dict__.items() if k != "_is_param"})  # set while building
    try:
        torch.utils.swap_tensors(p, real)
        return p
    except RuntimeError:  # something holds a weak reference to it, or another alias
        for m in root.modules():
            for name, q in m._parameters.items():
                if q is p:
                    m._parameters[name] = real
        return real


def _ensure_distributed() -> None:
    if not comm.is_initialized():
        init_distributed()


def _recording() -> bool:
    return any(isinstance(m, Recorder) for m in _get_current_dispatch_mode_stack())
