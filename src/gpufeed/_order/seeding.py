"""Per-sample random state: random transforms that do not depend on who fetched the sample.

Before each ``__getitem__(index)`` the loader seeds torch's CPU generator, numpy's global (legacy)
``RandomState`` and Python's ``random`` from :func:`sample_seed` ``(seed, epoch, index)``. The bytes
of a sample therefore depend only on those three numbers: the same for 0, 1, 2 or 4 workers,
thread or process workers, and after a resume.

Cost, measured with ``python -m gpufeed.benchmarks.seeding`` (median of 5 runs, 10,000 samples
in batches of 64) on the 2-core development VM (Python 3.11, torch 2.13, numpy 2.4), other jobs
running: 10-15 us per sample (the hash and three re-seeds) plus 0.1-0.2 ms per batch (saving and
restoring the three global states; numpy's dominates), 13-17 us per sample in all. A
``__getitem__`` that decodes an image costs milliseconds, so this is noise there; for tiny
samples read one by one it can be a visible share. Opt out with the loader's
``deterministic=False`` (the stock behaviour: each worker seeded once).

What is *not* covered: CUDA generators (``__getitem__`` should not use the GPU), explicit
``torch.Generator`` / ``numpy.random.Generator`` objects owned by the dataset (seed those from
:func:`sample_seed` yourself), and batched fetches (``__getitems__``): those see one state per
batch, from :func:`batch_seed`, which is still independent of workers because the batch plan is.
Iterable datasets have no sample index: they keep the stock per-worker seeding.

NOTE [ Seeding and threads ]: the three generators are process-global, so threads cannot have
their own. Per-thread generators would leave the user's ``torch.rand``/``np.random``/``random``
calls unseeded, so instead every seeded fetch holds one process-wide lock for the whole batch:
seed, call ``__getitem__``, re-seed, ... and finally restore the states saved on entry. Thread
workers that use seeding therefore run their ``__getitem__`` calls one at a time (collation and
everything else still overlaps); use process workers when random transforms must run in parallel.
Restoring on exit keeps the caller's own random stream untouched when loading happens in the main
process (``num_workers=0``). The training thread's own draws made *while* a thread worker holds
the lock are not protected (they may be replayed after the restore); give the training step its
own ``torch.Generator`` if that matters. The lock is re-created in a forked child.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

import numpy as np
import torch

__all__ = [
    "batch_seed",
    "fetch_seeded",
    "resolve_seed",
    "sample_seed",
    "seed_globals",
    "seeded",
]

T = TypeVar("T")
_M64 = (1 << 64) - 1
_lock = threading.RLock()


def _reset_lock() -> None:
    global _lock
    _lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_lock)


def _mix(x: int) -> int:
    """SplitMix64 finalizer: a cheap, well-spread 64-bit hash of a 64-bit integer."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 64-bit seed that depends only on ``(seed, epoch, index)`` (about 1 us).

    Neighbouring inputs give unrelated outputs (``(0, 1, 0)`` and ``(1, 0, 0)`` differ), unlike
    the ``seed + epoch`` sum the samplers use for their permutations.
    """
    return _mix(_mix(_mix(seed & _M64) ^ (epoch & _M64)) ^ (index & _M64))


def batch_seed(seed: int, epoch: int, indices: Sequence[int]) -> int:
    """Seed for a batched fetch: from the batch's first index and its size."""
    first = indices[0] if len(indices) else 0
    return _mix(sample_seed(seed, epoch, first) ^ len(indices))


def seed_globals(value: int) -> None:
    """Seed torch's CPU generator, numpy's global ``RandomState`` and ``random`` from ``value``.

    Each library gets different bits, so their streams are not copies of one another (torch and
    numpy both use MT19937). Callers that share the process with other threads should hold the
    seeding lock, as :func:`seeded` does.
    """
    torch.default_generator.manual_seed(value & _M64)
    np.random.seed(value >> 32)
    random.seed(_mix(value))


class _Reseed:
    """Callable handed out by :func:`seeded`: ``reseed(index)`` before each ``__getitem__``."""

    __slots__ = ("epoch", "seed")

    def __init__(self, seed: int, epoch: int) -> None:
        self.seed = seed
        self.epoch = epoch

    def __call__(self, index: int) -> None:
        seed_globals(sample_seed(self.seed, self.epoch, index))

    def batch(self, indices: Sequence[int]) -> None:
        """Seed once for a batched fetch (``__getitems__``)."""
        seed_globals(batch_seed(self.seed, self.epoch, indices))


@contextmanager
def seeded(seed: int, epoch: int) -> Iterator[_Reseed]:
    """Hold the seeding lock, save the global states, yield ``reseed``; restore them on exit.

    Usage, once per batch (see NOTE [ Seeding and threads ])::

        with seeded(seed, epoch) as reseed:
            for i in indices:
                reseed(i)
                samples.append(dataset[i])
    """
    with _lock:
        torch_state = torch.default_generator.get_state()
        numpy_state = np.random.get_state()
        random_state = random.getstate()
        try:
            yield _Reseed(seed, epoch)
        finally:
            torch.default_generator.set_state(torch_state)
            np.random.set_state(numpy_state)
            random.setstate(random_state)


def fetch_seeded(
    get: Callable[[int], T], indices: Sequence[int], *, seed: int, epoch: int
) -> list[T]:
    """``[get(i) for i in indices]`` with each call seeded from ``(seed, epoch, i)``.

    Args:
        get: usually ``dataset.__getitem__``.
        indices: the dataset indices of one batch (what the sampler produced, not positions).
        seed: the loader's base seed (an int >= 0).
        epoch: the epoch the batch belongs to, as counted by the loader's sampler.
    """
    out: list[T] = []
    with seeded(seed, epoch) as reseed:
        for index in indices:
            reseed(index)
            out.append(get(index))
    return out


def resolve_seed(seed: int | None, generator: torch.Generator | None, *, distributed: bool) -> int:
    """The base seed of per-sample random state and of gpufeed's samplers.

    ``seed`` if given; else the ``generator``'s ``initial_seed()``; else 0 in a distributed run
    (all ranks must agree, as with ``DistributedSampler``); else one drawn from torch's default
    generator (so ``torch.manual_seed`` governs it). The loader records it in its state.
    """
    if seed is not None:
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"seed must be an int >= 0 (or None), got {seed!r}")
        return seed
    if generator is not None:
        return int(generator.initial_seed())
    if distributed:
        return 0
    return int(torch.empty((), dtype=torch.int64).random_().item())
