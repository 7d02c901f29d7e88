"""Per-sample random state: random transforms that do not depend on who fetched the sample.

Two mechanisms, both from :func:`sample_seed` ``(seed, epoch, index)``:

- the per-sample generators (``gpufeed.random.sample_generator()``, ``sample_rng()``,
  ``sample_random()``; ``_order/sample_rng.py``), for every kind of worker and without workers,
  with or without ``seed=``; gpufeed's own sources draw from the same seeds;
- with ``seed=``, in process workers and with ``num_workers=0``: before each
  ``__getitem__(index)`` the loader seeds torch's CPU generator, numpy's global (legacy)
  ``RandomState`` and Python's ``random``, so that datasets written against the global
  generators (torchvision's transforms) give the same bytes for 0, 1, 2 or 4 process workers
  and after a resume. Thread workers never touch them (NOTE [ Seeding and threads ]).

Cost of the global seeding, measured with ``python -m bench.seeding`` (median of 5
runs, 10,000 samples in batches of 64) on the 2-core development VM (Python 3.11, torch 2.13,
numpy 2.4), other jobs running: 10-15 us per sample (the hash and three re-seeds) plus 0.1-0.2 ms
per batch (saving and restoring the three global states; numpy's dominates), 13-17 us per
sample in all. A ``__getitem__`` that decodes an image costs milliseconds, so this is noise
there; for tiny samples read one by one it can be a visible share. Opt out with the loader's
``deterministic=False`` (the stock behaviour: each worker seeded once).

What is *not* covered: CUDA generators (``__getitem__`` should not use the GPU), explicit
generators the dataset owns (seed them from :func:`sample_seed`, or use the per-sample ones),
and batched fetches (``__getitems__``): those see one global state per batch, from
:func:`batch_seed`, which is still independent of workers because the batch plan is (and
``sample_generator(index=i)`` gives each sample its own). Iterable datasets have no sample
index: the global generators keep the stock per-worker seeding.

NOTE [ Seeding and threads ]
----------------------------
torch's, numpy's and Python's global generators are one per process. A process worker owns
its process, and with ``num_workers=0`` the loader fetches in the caller's thread, so there a
seeded fetch seeds them before each sample (``seeded``: under a lock against the program's other
threads, restoring the caller's states on exit, so its own random stream is untouched). Thread
workers share them with each other and with the training loop, and no lock can make a draw there
reproducible: the loop draws (CPU dropout, a ``torch.rand``) without taking it, between a
worker's re-seed and the sample's draw. The earlier design did take one, around every seeded
batch: 502 of 1,000 samples still differed from process workers' when the loop drew, and 4
thread workers on a 5 ms sample ran at 192 samples/s instead of 766 (``__getitem__`` one at a
time). So thread workers never seed, save, restore or lock the global generators, with or
without ``seed=``. What is reproducible under threads, and parallel:

- the per-sample generators, seeded from the sample alone, no lock, no global state; without
  ``seed=`` their base is drawn when iteration starts, as torch draws its workers' base seed,
  so ``torch.manual_seed`` governs them and the loop's draws do not;
- gpufeed's sources (``sample_seeds`` in ``_sources/protocol.py``), which draw from the same
  per-sample seeds (``ImageFolder``'s crops and flips).

Draws from the global generators in thread workers are whatever the interleaving of threads
makes them, as in any multi-threaded PyTorch program. A dataset seen making them gets one
``RandomStateWarning`` per loader, naming the fix (the per-sample generators, or process
workers): ``_host/random_watch.py`` checks sampled calls into user code while the loop waits.
Measured (``bench.seeding``; figures in docs/guides/randomness.md): thread workers
run as fast with ``seed=`` as without. The lock of ``seeded`` is re-created in a forked child.
"""

from __future__ import annotations

import operator
import os
import random
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import numpy as np
import torch

__all__ = [
    "as_index",
    "batch_seed",
    "epoch_key",
    "fetch_seeded",
    "resolve_seed",
    "sample_seed",
    "seed_globals",
    "seed_in",
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
    """Seed torch's CPU generator, numpy's global ``RandomState`` and ``random`` from ``value``.

    Each library gets different bits, so their streams are not copies of one another (torch and
    numpy both use MT19937). Callers that share the process with other threads should hold the
    seeding lock, as :func:`seeded` does.
    """
    torch.default_generator.manual_seed(value & _M64)
    np.random.seed(value >> 32)
    random.seed(_mix(value))


class _Reseed:
    """Callable handed out by :func:`seeded`: ``reseed(index)`` before each ``__getitem__``
    (the epoch's share of the seed made once, when the block opens)."""

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
