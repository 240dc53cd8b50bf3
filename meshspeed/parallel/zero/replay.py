"""Build a model without holding it: record how each tensor gets its values, then replay
the record one tensor at a time (the engine of `zero.Init`).

Note [recorded construction]
While the recorder is active, every tensor that construction creates is a meta tensor (no
memory), and every aten operation that creates or writes one is remembered, per storage,
in the order it ran: the op, its arguments (other recorded tensors by reference, as
storage + size/stride/offset), and for random ops the generator state just before it.
A storage's history therefore says exactly how the ordinary CPU build would have filled
it, including the constructor's writes, `reset_parameters`, and initialisation that runs
after construction over the whole model (Hugging Face's `post_init` / `_init_weights`).
`value_of(tensor)` replays one storage's history into real memory: the ops run again on
the CPU, each random op with its recorded generator state, so the values are bit for bit
those of the ordinary build.

Random numbers: for the states to be the ordinary build's, the generator must advance as
it would have. A random op is therefore also run for real when it is recorded, on a
scratch tensor of the target's size that is dropped right after (one tensor's memory for
a moment); afterwards the generator is exactly where the ordinary build leaves it.

Memory: an op that overwrites a whole storage without reading it (`normal_`, `fill_`,
`copy_`, ...) starts a new version of the storage's history; replay starts from the last
version, so a weight drawn in the constructor and redrawn by `post_init` costs one draw,
and nothing but the tensor being replayed (and what it is computed from) is ever real.

Uninitialised memory is never exposed: a storage born by `torch.empty` and not completely
written before it is read (or before it is asked for) raises `UninitialisedError`; the
caller names the parameter. Operations that need values while building (`.item()`,
`bool(t)`) get them by replaying what they read.

Real tensors that construction mixes in (values given as Python data, `torch.tensor(...)`)
stay real and are kept by reference in the record; they are assumed not to change before
the end of the context. This uses torch's dispatch-mode extension point; no torch
function is patched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

aten = torch.ops.aten
META = torch.device("meta")
CPU = torch.device("cpu")

# ops whose output holds no values yet
_UNINITIALISED = {aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty, aten.new_empty_strided}
# in-place ops that write every element of `self` without reading it
_OVERWRITES = {aten.fill_, aten.zero_, aten.normal_, aten.uniform_, aten.random_, aten.exponential_,
               aten.cauchy_, aten.log_normal_, aten.geometric_, aten.bernoulli_, aten.copy_}
# ops that turn a tensor's values into Python values (answered by replaying the tensor)
_READ_OUT = {aten._local_scalar_dense, aten.is_nonzero, aten.equal}


class UninitialisedError(RuntimeError):
    """A recorded tensor would expose memory that construction never wrote."""


@dataclass(frozen=True)
class _Ref:
    """A recorded (meta) tensor in a step's arguments: its storage and how it views it."""

    key: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @classmethod
    def of(cls, t: torch.Tensor) -> _Ref:
        return cls(_key(t), t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())


@dataclass
class _Step:
    seq: int
    func: Any  # an aten OpOverload
    args: tuple
    kwargs: dict
    rng: tuple[torch.Generator, torch.Tensor] | None  # generator, its state before the op
    written: tuple[_Ref, ...] = ()  # the arguments it writes (in place / out=)
    blind: tuple[_Ref, ...] = ()  # the written arguments whose old values it does not read
    out: tuple[int, _Ref] | None = None  # creation: output index and its view of the storage


@dataclass
class _Version:
    start: int  # from this step on, the storage's content is this version's
    create: _Step | None  # the op that produced the storage (None: overwritten whole)
    defined: bool  # every byte holds a value from the start
    writes: list[_Step] = field(default_factory=list)


@dataclass
class _History:
    storage: torch.UntypedStorage  # the meta storage, kept alive so its key is not reused
    nbytes: int
    versions: list[_Version]


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


_IS_META = torch.Tensor.is_meta.__get__  # the truth, past _Recorded's answer


def _is_meta(x) -> bool:
    return isinstance(x, torch.Tensor) and _IS_META(x)


class _Recorded(torch.Tensor):
    """A tensor built under the recorder: a meta tensor that says it is not one, so that
    code which skips meta tensors (`torch.nn.init.trunc_normal_`, `orthogonal_`,
    `dirac_`, `sparse_`) does what it does in the ordinary build, and the recorder sees
    it. Only `is_meta` / `is_cpu` differ; operations run on the meta tensor (and are
    recorded) as for any tensor. `device` stays meta (overriding it too was seen to make
    torch's random ops on these meta tensors draw from the CPU generator), so a model that
    tests `weight.device.type == "meta"` itself still takes its meta path under Init."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def is_meta(self) -> bool:
        return False

    @property
    def is_cpu(self) -> bool:
        return True


def _as_recorded(x):
    if _is_meta(x) and type(x) is torch.Tensor:
        return torch.Tensor._make_subclass(_Recorded, x)
    return x


def _ref_or_value(x):
    return _Ref.of(x) if _is_meta(x) else x


class Recorder(TorchDispatchMode):
    """While active: tensors created are meta, and how they get their values is recorded."""

    def __init__(self):
        super().__init__()
        self.histories: dict[int, _History] = {}
        self.seq = 0
        self.held_bytes = 0  # real bytes alive for replays now
        self.peak_bytes = 0
        self._scratch: torch.UntypedStorage | None = None

    # -- recording --------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        args, kwargs = _on_meta(func, args, kwargs)
        flat, _ = tree_flatten((args, kwargs))
        if not any(_is_meta(x) or (isinstance(x, torch.device) and x.type == "meta") for x in flat):
            return func(*args, **kwargs)  # real tensors only: not ours
        self.seq += 1
        if func.overloadpacket in _READ_OUT:
            return self._run(self._step(func, args, kwargs, None))
        rng = _generator_state(func, args, kwargs)
        step = self._step(func, args, kwargs, rng)
        self._classify_writes(step, func, args, kwargs)
        if rng is not None:  # advance the generator exactly as the ordinary build would
            self._run(step, scratch=True)
        meta_args, meta_kwargs = tree_map(_meta_twin, (args, kwargs))
        out = func(*meta_args, **meta_kwargs)
        self._note_writes(step)
        self._note_outputs(step, out)
        inputs = {id(x) for x in flat if isinstance(x, torch.Tensor)}  # in place: returned as given
        return tree_map(lambda t: t if id(t) in inputs else _as_recorded(t), out)

    def _step(self, func, args, kwargs, rng) -> _Step:
        return _Step(self.seq, func, tree_map(_ref_or_value, args), tree_map(_ref_or_value, kwargs), rng)

    def _classify_writes(self, step: _Step, func, args, kwargs) -> None:
        """Which arguments the op writes, and which of them it does not read first."""
        written = []
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
            tensors = [t for t in tree_flatten(value)[0] if _is_meta(t)]
            # out= arguments (keyword-only) are written, never read; so is the `self` of
            # an overwriting in-place op
            unread = arg.kwarg_only or (func.overloadpacket in _OVERWRITES and arg.name == "self")
            written += [(_Ref.of(t), unread) for t in tensors]
        step.written = tuple(ref for ref, _ in written)
        step.blind = tuple(ref for ref, unread in written if unread and not self._reads(step, ref))

    def _note_writes(self, step: _Step) -> None:
        for ref in step.written:
            history = self.histories.get(ref.key)
            if history is None:
                continue  # a meta tensor from outside: replaying it fails with a clear error
            if ref in step.blind and _covers(ref, history.nbytes):  # the old values are dead
                history.versions.append(_Version(step.seq, None, True, [step]))
            else:
                history.versions[-1].writes.append(step)

    def _reads(self, step: _Step, target: _Ref) -> bool:
        """Whether an argument other than `target` reads the target's storage."""
        flat, _ = tree_flatten((step.args, step.kwargs))
        refs = [x for x in flat if isinstance(x, _Ref)]
        return sum(r.key == target.key for r in refs) > 1

    def _note_outputs(self, step: _Step, out) -> None:
        for i, t in enumerate(tree_flatten(out)[0]):
            if not _is_meta(t) or _key(t) in self.histories:
                continue  # a view of (or the same storage as) a recorded input
            storage = t.untyped_storage()
            created = _Step(step.seq, step.func, step.args, step.kwargs, step.rng, out=(i, _Ref.of(t)))
            defined = step.func.overloadpacket not in _UNINITIALISED
            self.histories[_key(t)] = _History(storage, storage.nbytes(), [_Version(step.seq, created, defined)])

    # -- replay -----------------------------------------------------------------------------
    def value_of(self, t: torch.Tensor, unwritten_as_zeros: bool = False, transient: bool = False) -> torch.Tensor:
        """The real value of a recorded tensor at the end of the record (a CPU tensor).
        Raises UninitialisedError if part of it was never written, unless
        `unwritten_as_zeros` (then those elements are zeros). A `transient` value lives in
        a buffer the next transient value reuses (a parameter about to be sliced)."""
        ref = _Ref.of(t)
        into = self._scratch_storage(self.histories[ref.key].nbytes) if transient and ref.key in self.histories \
            else None
        storage, mask = self._materialize(ref.key, self.seq + 1, into)
        try:
            if mask is not None and unwritten_as_zeros:
                raw = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
                raw[~mask] = 0
                mask = None
            _check_written(mask, ref, "is asked for")
            return _view(storage, ref)
        finally:
            if into is None:
                self._release(storage)

    def is_recorded(self, t: torch.Tensor) -> bool:
        return _is_meta(t) and _key(t) in self.histories

    def _materialize(self, key: int, upto: int, into: torch.UntypedStorage | None = None):
        """The storage `key` as it was just before step `upto` (built in `into` if given),
        and a byte mask of what is written (None when every byte is)."""
        history = self.histories.get(key)
        if history is None:
            raise UninitialisedError("a meta tensor created outside zero.Init is used to build the model; "
                                     "create it inside the context (or as a real tensor)")
        version = [v for v in history.versions if v.start < upto][-1]
        if into is None:
            storage = torch.empty(history.nbytes, dtype=torch.uint8, device=CPU).untyped_storage()
            self._hold(history.nbytes)
        else:
            storage = into
            self._hold(0)
        mask = None if version.defined else torch.zeros(into.nbytes() if into is not None else history.nbytes,
                                                        dtype=torch.bool)
        create = version.create
        if create is not None and create.func.overloadpacket not in _UNINITIALISED:
            index, ref = create.out
            produced = tree_flatten(self._run(create))[0][index]
            _view(storage, ref).copy_(produced)
        for step in version.writes:
            if step.seq < upto:
                self._run(step, key=key, storage=storage, mask=mask)
        return storage, mask

    def _run(self, step: _Step, key: int | None = None, storage=None, mask=None, scratch: bool = False):
        """Run a recorded op on real tensors; `key`'s references resolve to `storage`."""
        held = []

        def real(x):
            if isinstance(x, torch.device) and x.type == "meta":
                return CPU
            if not isinstance(x, _Ref):
                return x
            if x.key == key:
                if x not in step.blind:
                    _check_written(mask, x, f"is read by {step.func}")
                return _view(storage, x)
            if scratch and x in step.blind and x.key in self.histories:  # old values unused
                return _view(self._scratch_storage(self.histories[x.key].nbytes), x)
            got, got_mask = self._materialize(x.key, step.seq)
            held.append(got)
            if x not in step.blind:
                _check_written(got_mask, x, f"is read by {step.func}")
            return _view(got, x)

        try:
            args, kwargs = tree_map(real, (step.args, step.kwargs))
            if "pin_memory" in kwargs:
                kwargs["pin_memory"] = False
            if step.rng is None or scratch:
                out = step.func(*args, **kwargs)
                if scratch:  # the values go right away; count them while they live
                    n = sum(t.untyped_storage().nbytes() for t in tree_flatten(out)[0]
                            if isinstance(t, torch.Tensor))
                    self._hold(n)
                    self.held_bytes -= n
            else:
                generator, state = step.rng
                current = generator.get_state()
                generator.set_state(state)
                try:
                    out = step.func(*args, **kwargs)
                finally:
                    generator.set_state(current)
            if mask is not None:
                for ref in step.written:
                    if ref.key == key:
                        _mask_view(mask, ref).fill_(True)
            return out
        finally:
            for s in held:
                self._release(s)

    def _scratch_storage(self, nbytes: int) -> torch.UntypedStorage:
        """One buffer, reused by every random op's scratch run while recording (freeing
        and reallocating one per op would leave the heap fragmented, see
        Note [a fixed mmap threshold for CPU training] in meshspeed/process/malloc.py)."""
        if self._scratch is None or self._scratch.nbytes() < nbytes:
            self.held_bytes -= 0 if self._scratch is None else self._scratch.nbytes()
            self._scratch = None
            self._scratch = torch.empty(nbytes, dtype=torch.uint8, device=CPU).untyped_storage()
            self._hold(nbytes)
        return self._scratch

    def release_scratch(self) -> None:
        if self._scratch is not None:
            self.held_bytes -= self._scratch.nbytes()
            self._scratch = None

    def _hold(self, nbytes: int) -> None:
        self.held_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def _release(self, storage: torch.UntypedStorage) -> None:
        self.held_bytes -= storage.nbytes()


def _on_meta(func, args, kwargs):
    """Factories build on the meta device; so does anything computed from a meta tensor."""
    names = [a.name for a in func._schema.arguments]
    if "device" not in names:
        return args, kwargs
    inputs = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
    if inputs and not any(_is_meta(x) for x in inputs):
        return args, kwargs  # an op on real tensors (data given as Python values, say)
    i = names.index("device")
    if i < len(args):
        args = (*args[:i], META, *args[i + 1 :])
    elif not inputs or kwargs.get("device") is not None:
        kwargs["device"] = META
    return args, kwargs


def _meta_twin(x):
    # a real tensor mixed with meta ones (data given as a Python list, say): the meta run
    # only needs its shape; the record keeps the real tensor
    if isinstance(x, torch.Tensor) and not _is_meta(x) and x.dim() > 0:
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=META)
    return x


def _generator_state(func, args, kwargs):
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return None
    flat = tree_flatten((args, kwargs))[0]
    generator = next((x for x in flat if isinstance(x, torch.Generator)), None) or torch.default_generator
    return generator, generator.get_state()


def _covers(ref: _Ref, nbytes: int) -> bool:
    """Whether the view writes every byte of its storage exactly once."""
    numel = 1
    for n in ref.size:
        numel *= n
    if ref.offset != 0 or numel * ref.dtype.itemsize != nbytes:
        return False
    expected = 1
    for size, stride in sorted(zip(ref.size, ref.stride), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _view(storage: torch.UntypedStorage, ref: _Ref) -> torch.Tensor:
    return torch.empty(0, dtype=ref.dtype, device=CPU).set_(storage, ref.offset, ref.size, ref.stride)


def _mask_view(mask: torch.Tensor, ref: _Ref) -> torch.Tensor:
    """The bytes of `mask` (one per storage byte) that the view `ref` covers."""
    width = ref.dtype.itemsize
    return torch.empty(0, dtype=torch.bool).set_(
        mask.untyped_storage(), ref.offset * width, (*ref.size, width), (*(s * width for s in ref.stride), 1))


def _check_written(mask, ref: _Ref, what: str) -> None:
    if mask is not None and not bool(_mask_view(mask, ref).all()):
        raise UninitialisedError(f"a tensor created with torch.empty {what} before all of it was written")
