"""Per-sample random state: random transforms that do not depend on who fetched the sample.

Two mechanisms, both from :func:`sample_seed` ``(seed, epoch, index)``:

- the per-sample generators (``gpufeed.random``; ``_order/sample_rng.py``), for every kind of
  worker and without workers, with or without ``seed=``; gpufeed's own sources draw from the
  same seeds;
- with ``seed=``, in process workers and with ``num_workers=0``: before each
  ``__getitem__(index)`` the loader seeds torch's CPU generator, numpy's global (legacy)
  ``RandomState`` and Python's ``random``, so that datasets written against the global
  generators (torchvision's transforms) give the same bytes for 0, 1, 2 or 4 process workers
  and after a resume. Thread workers never touch them (NOTE [ Seeding and threads ]).

The global seeding costs 13-17 us a sample: noise beside a ``__getitem__`` that decodes an
image, a visible share for tiny samples read one by one. The loader's ``deterministic=False``
opts out (the stock behaviour: each worker seeded once). Measurements:
docs/how-it-works/measurements/order.md#seeding-the-global-generators.

Not covered: CUDA generators (``__getitem__`` should not use the GPU), generators the dataset
owns (seed them from :func:`sample_seed`, or use the per-sample ones), and batched fetches
(``__getitems__``), which see one global state per batch, from :func:`batch_seed` (still
independent of workers, because the batch plan is). Iterable datasets have no sample index:
the global generators keep the stock per-worker seeding.

NOTE [ Seeding and threads ]
----------------------------
torch's, numpy's and Python's global generators are one per process. A process worker owns its
process, and with ``num_workers=0`` the loader fetches in the caller's thread: a seeded fetch
seeds them there before each sample (:func:`seeded`: under a lock against the program's other
threads, restoring the caller's states on exit, so its own random stream is untouched).
Thread workers share them with each other and with the training loop, and no lock makes a draw
there reproducible: the loop draws (CPU dropout, a ``torch.rand``) without taking it, between a
worker's re-seed and the sample's draw, and the lock serialises the workers. So thread workers
never seed, save, restore or lock the global generators, with or without ``seed=``. Under
threads, the per-sample generators and gpufeed's sources (``sample_seeds`` in
``_sources/protocol.py``: ``ImageFolder``'s crops and flips) are reproducible, and parallel.
Measurements: docs/how-it-works/measurements/order.md#seeding-and-threads.

Draws from the global generators in thread workers are whatever the interleaving of threads
makes them, as in any multi-threaded PyTorch program; a dataset seen making them gets one
``RandomStateWarning`` per loader, naming the fix (the per-sample generators, or process
workers): ``_host/random_watch.py`` checks sampled calls into user code while the loop waits.
The lock of :func:`seeded` is re-created in a forked child.
"""

from __future__ import annotations

import operator
import os
import random
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

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


def as_index(index: Any) -> int:
    """``index`` as an int, or a TypeError that says per-sample seeds need one."""
    try:
        return operator.index(index)
    except TypeError:
        raise TypeError(
            f"per-sample seeds need an int sample index, but this sample's index is {index!r}; "
            "pass an int one (e.g. gpufeed.random.sample_generator(index=...)), or turn per-sample "
            "seeding off with deterministic=False") from None


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 64-bit seed that depends only on ``(seed, epoch, index)`` (about 1 us).

    Neighbouring inputs give unrelated outputs (``(0, 1, 0)`` and ``(1, 0, 0)`` differ), unlike
    the ``seed + epoch`` sum the samplers use for their permutations.
    """
    return seed_in(epoch_key(seed, epoch), index)


def epoch_key(seed: int, epoch: int) -> int:
    """The part of :func:`sample_seed` that every sample of an epoch shares: made once per
    batch, then :func:`seed_in` per sample."""
    return _mix(_mix(seed & _M64) ^ (epoch & _M64))


def seed_in(key: int, index: int) -> int:
    """``sample_seed(seed, epoch, index)`` from ``key = epoch_key(seed, epoch)``: one hash."""
    if type(index) is not int:
        index = as_index(index)
    return _mix(key ^ (index & _M64))


def batch_seed(seed: int, epoch: int, indices: Sequence[int]) -> int:
    """Seed for a batched fetch: from the batch's first index and its size."""
    first = indices[0] if len(indices) else 0
    return _mix(sample_seed(seed, epoch, first) ^ len(indices))


def seed_globals(value: int) -> None:
    """Seed torch's CPU generator, numpy's global ``RandomState`` and ``random`` from ``value``,
    each from different bits (torch and numpy both run MT19937: their streams must differ).
    Callers sharing the process with other threads hold the lock, as :func:`seeded` does."""
    torch.default_generator.manual_seed(value & _M64)
    np.random.seed(value >> 32)
    random.seed(_mix(value))


class _Reseed:
    """``reseed(index)`` before each ``__getitem__`` in a :func:`seeded` block (the epoch's
    share of the seed made once)."""

    __slots__ = ("epoch", "key", "seed")

    def __init__(self, seed: int, epoch: int) -> None:
        self.seed = seed
        self.epoch = epoch
        self.key = epoch_key(seed, epoch)

    def __call__(self, index: int) -> None:
        seed_globals(seed_in(self.key, index))

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


def resolve_seed(seed: int | None, generator: torch.Generator | None, *, distributed: bool) -> int:
    """The base seed of per-sample random state and of gpufeed's samplers.

    ``seed`` if given; else the ``generator``'s ``initial_seed()``; else 0 in a distributed run
    (all ranks must agree, as with ``DistributedSampler``); else one drawn from torch's default
    generator (so ``torch.manual_seed`` governs it). The loader records it in its state.
    """
    if seed is not None:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"seed must be an int >= 0 (or None), got {seed!r}")
        if seed < 0:
            raise ValueError(f"seed must be an int >= 0 (or None), got {seed!r}")
        return seed
    if generator is not None:
        return int(generator.initial_seed())
    if distributed:
        return 0
    return int(torch.empty((), dtype=torch.int64).random_().item())
