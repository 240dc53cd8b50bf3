"""Named random-number-generator states, as Megatron's and DeepSpeed's `get_cuda_rng_tracker()`.

A tensor-parallel model needs two streams of randomness: one that every rank of a tp group
shares (dropout on replicated activations must drop the same elements everywhere) and one
that differs per tp rank (dropout on a rank's own slice of the hidden features). The
default generator is the shared one; the tracker holds the others by name, and
`fork(name)` runs a block on one of them, then puts the default generator back.

Note [which generator the tracker holds]
The states belong to the device's generator: the CUDA generator of the current device
when CUDA is available (where dropout of CUDA tensors draws from), the host generator
otherwise. So on a CPU-only machine `fork()` swaps `torch.get_rng_state()`, and the same
code draws from CUDA's generator on a GPU machine. States are byte tensors that are never
written in place, so a shallow copy of the dict is a snapshot (`get_states`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"  # the name Megatron and DeepSpeed use
_MODEL_PARALLEL_OFFSET = 2718  # Megatron's published convention: tp seed = seed + 2718 + tp rank


def uses_cuda() -> bool:
    """Whether the tracked generator is CUDA's (Note [which generator the tracker holds])."""
    return torch.cuda.is_available()


def device_rng_state() -> torch.Tensor:
    """The tracked generator's state (a copy)."""
    return torch.cuda.get_rng_state() if uses_cuda() else torch.get_rng_state()


def set_device_rng_state(state: torch.Tensor) -> None:
    if uses_cuda():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def seed_device_rng(seed: int) -> None:
    """Seed only the tracked generator (`torch.manual_seed` would also reseed the others)."""
    if uses_cuda():
        torch.cuda.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


class RNGStatesTracker:
    """Generator states by name; `fork(name)` draws from one and then restores the default."""

    def __init__(self) -> None:
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: set[int] = set()

    def reset(self) -> None:
        """Forget every named state and seed."""
        self._states, self._seeds = {}, set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A snapshot of every named state (Note [which generator the tracker holds])."""
        return dict(self._states)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace every named state by `states` (as `get_states` returned them)."""
        self._states = dict(states)

    def add(self, name: str, seed: int) -> None:
        """A new state `name`, as the generator would be after `manual_seed(seed)`."""
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"get_cuda_rng_tracker().add({name!r}, seed): the seed must be an int, "
                            f"got {seed!r}")
        if name in self._states:
            raise ValueError(f"get_cuda_rng_tracker().add({name!r}, {seed}): a state named {name!r} "
                             "exists already; call reset() first or pick another name")
        if seed in self._seeds:
            raise ValueError(f"get_cuda_rng_tracker().add({name!r}, {seed}): seed {seed} is used by "
                             "another state already; two streams with one seed would draw the "
                             "same numbers, pick another seed")
        before = device_rng_state()
        seed_device_rng(seed)
        self._states[name] = device_rng_state()
        set_device_rng_state(before)
        self._seeds.add(seed)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Inside the block the generator draws from state `name`; on exit `name` keeps
        where it got to and the generator is back where it was before the block."""
        if name not in self._states:
            raise KeyError(f"get_cuda_rng_tracker().fork({name!r}): no state named {name!r}; "
                           "add it with get_cuda_rng_tracker().add(name, seed) or call "
                           "model_parallel_cuda_manual_seed(seed)")
        before = device_rng_state()
        set_device_rng_state(self._states[name])
        try:
            yield
        finally:
            self._states[name] = device_rng_state()
            set_device_rng_state(before)


CudaRNGStatesTracker = RNGStatesTracker  # DeepSpeed's name

_TRACKER = RNGStatesTracker()


def get_cuda_rng_tracker() -> RNGStatesTracker:
    """The process's tracker (one per process, as in DeepSpeed)."""
    return _TRACKER


def seed_model_parallel(seed: int, tp_rank: int) -> None:
    """Seed the default generator with `seed` (the same on every rank of a tp group) and
    state "model-parallel-rng" with `seed + 2718 + tp_rank` (different per tp rank)."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"model_parallel_cuda_manual_seed(seed): the seed must be an int, got {seed!r}")
    _TRACKER.reset()
    seed_device_rng(seed)
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + _MODEL_PARALLEL_OFFSET + tp_rank)
