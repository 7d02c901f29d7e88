"""Per-sample generators: ``gpufeed.random.sample_generator()``, ``sample_rng()``,
``sample_random()``.

A fetcher (``_host/fetch.py``) opens a :class:`SampleScope` around every batch it fetches and
moves it from sample to sample; the three functions read the scope of the calling thread and
return a generator seeded from the sample being fetched, so a random transform drawn from them
gives the same values whoever fetches the sample: 0, 1 or 8 workers, threads or processes, after
a resume. They take no lock and touch no global state: thread workers draw from them in
parallel, and the training loop's own draws cannot change them (NOTE [ Seeding and threads ] in
``_order/seeding.py`` says why the global generators cannot offer this under threads).

What a sample's seed is (:meth:`SampleScope.seed_of`): ``sample_seed(base, epoch, index)``, where
``base`` is the loader's ``seed=`` or, without one, a seed drawn when iteration starts from the
loader's ``generator`` (else torch's global generator), as torch draws its workers' base seed:
``torch.manual_seed`` then governs it. Each library's generator gets its own hash of that seed,
so the three streams are unrelated to one another and to the global generators' per-sample
seeding. Iterable datasets have no index: the scope numbers each worker's samples in the order
the worker fetches them, and mixes the worker's id into ``base``.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .seeding import _mix, batch_seed, sample_seed

__all__ = [
    "RandomStateWarning",
    "SampleScope",
    "current_scope",
    "sample_generator",
    "sample_random",
    "sample_rng",
    "stream_base",
]

_local = threading.local()
# A different hash of the sample's seed per library: torch and numpy's legacy generator are both
# MT19937, and the global generators are seeded from the sample's seed itself.
_TORCH, _NUMPY, _RANDOM = 0x7A3B9C1D5E6F, 0x1F2E3D4C5B6A, 0x5A5A3C3C9696


class RandomStateWarning(UserWarning):
    """gpufeed saw random draws it cannot make reproducible: a dataset that draws from a global
    generator in thread workers, or a ``state_dict()`` without ``seed=``, whose resume replays
    the order but not the random transforms."""


class SampleScope:
    """The sample a thread is fetching, which the per-sample generators are seeded from.

    One per fetcher (a worker, or the main process with ``num_workers=0``); ``open`` makes it
    the calling thread's scope for one batch, ``at``/``at_batch`` move it, ``close`` restores
    whatever scope was open before (a dataset may itself iterate a loader). ``seed_globals``
    and ``probe`` say how the fetcher runs user code that a source calls itself (an image
    source's ``transform=``): whether it may seed the global generators per sample, given a
    per-sample seed (never in thread workers: NOTE [ Seeding and threads ]), and the check
    of the task for global draws (``_host/random_watch.py``), if any.
    """

    __slots__ = ("_numpy", "_prev", "_random", "_torch", "base", "batch", "epoch", "index",
                 "probe", "seed_globals")

    def __init__(self, *, seed_globals: bool = False) -> None:
        self.base = self.epoch = 0
        self.index: Any = None
        self.batch: Sequence[Any] | None = None
        self._torch: torch.Generator | None = None
        self._numpy: np.random.Generator | None = None
        self._random: random.Random | None = None
        self._prev: SampleScope | None = None
        self.seed_globals = seed_globals
        self.probe: Any = None

    def open(self, base: int, epoch: int) -> None:
        self._prev = getattr(_local, "scope", None)
        _local.scope = self
        self.base, self.epoch = base, epoch
        self.at_batch(None)

    def close(self) -> None:
        _local.scope, self._prev = self._prev, None

    def at(self, index: Any) -> None:
        """Sample ``index`` is being fetched now (its generators are made when first asked)."""
        self.index = index
        self._torch = self._numpy = self._random = None

    def at_batch(self, indices: Sequence[Any] | None) -> None:
        """A whole batch is being fetched or collated (``__getitems__``, a batch source,
        ``collate_fn``): generators asked for without an index come from ``batch_seed``."""
        self.batch = indices
        self.at(None)

    def seed_of(self, index: Any) -> int:
        return sample_seed(self.base, self.epoch, index)

    def current_seed(self) -> int:
        if self.index is not None:
            return self.seed_of(self.index)
        return batch_seed(self.base, self.epoch, self.batch if self.batch is not None else ())


def stream_base(base: int, worker_id: int) -> int:
    """The base of worker ``worker_id``'s samples of an iterable dataset (no index: each worker
    numbers its own samples, so the worker goes into the base)."""
    return _mix(base ^ _mix(worker_id + 1))


def current_scope() -> SampleScope | None:
    """The scope of the sample this thread is fetching, or None outside a gpufeed fetch."""
    return getattr(_local, "scope", None)


def _global_seed() -> int:
    """Outside a fetch: one draw from torch's global generator (a stock worker seeds it)."""
    return int(torch.empty((), dtype=torch.int64).random_().item())


def _seed(index: int | None, tag: int) -> tuple[int, SampleScope | None]:
    scope = current_scope()
    if scope is None:
        return _mix(_global_seed() ^ tag), None
    if index is not None:
        return _mix(scope.seed_of(index) ^ tag), None
    return _mix(scope.current_seed() ^ tag), scope


def sample_generator(index: int | None = None) -> torch.Generator:
    """A CPU ``torch.Generator`` for the sample being fetched: pass it as ``generator=``.

    Call it in ``__getitem__`` (or ``__getitems__``, ``__iter__``, ``collate_fn``) of a dataset
    read by ``gpufeed.DataLoader``: its draws depend only on the loader's seed, the epoch and
    the sample's index, so they are the same for any ``num_workers`` and ``worker_type``, after
    a resume (with ``seed=``), and whatever the training loop draws meanwhile; they follow
    ``torch.manual_seed`` without ``seed=``. Thread workers draw from it in parallel, without a
    lock. Within one sample every call returns the same generator, so successive draws continue
    one stream; the next sample gets a fresh one. Do not keep it past the sample.

    Args:
        index: the dataset index of another sample of the batch being fetched, e.g. in
            ``__getitems__(indices)``: a fresh generator for that sample, the one its
            ``__getitem__`` would get. None (default): the sample being fetched; in
            ``__getitems__`` or ``collate_fn``, one generator for the whole batch.

    Outside a gpufeed fetch (the stock DataLoader, ``dataset[i]`` by hand) it returns a fresh
    generator seeded by one draw from torch's global generator, so the same dataset code runs
    anywhere. Cost: making and seeding the generator, a few microseconds per sample that asks
    for it, less than seeding the three global generators; nothing for one that does not
    (``python -m bench.seeding``; figures in docs/guides/randomness.md).
    """
    seed, scope = _seed(index, _TORCH)
    if scope is not None and scope._torch is not None:
        return scope._torch
    gen = torch.Generator()
    gen.manual_seed(seed)
    if scope is not None:
        scope._torch = gen
    return gen


def sample_rng(index: int | None = None) -> np.random.Generator:
    """A ``numpy.random.Generator`` (PCG64) for the sample being fetched.

    The numpy counterpart of :func:`sample_generator`, with the same rules (``index``, one
    generator per sample, the fallback outside a gpufeed fetch): ``numpy.random.default_rng``
    of the sample's seed. Cost: numpy's seeding, about three times torch's.
    """
    seed, scope = _seed(index, _NUMPY)
    if scope is not None and scope._numpy is not None:
        return scope._numpy
    gen = np.random.default_rng(seed)
    if scope is not None:
        scope._numpy = gen
    return gen


def sample_random(index: int | None = None) -> random.Random:
    """A ``random.Random`` for the sample being fetched (code written for Python's ``random``:
    ``rnd = gpufeed.random.sample_random(); rnd.random()``).

    The counterpart of :func:`sample_generator`, with the same rules; about as cheap.
    """
    seed, scope = _seed(index, _RANDOM)
    if scope is not None and scope._random is not None:
        return scope._random
    gen = random.Random(seed)
    if scope is not None:
        scope._random = gen
    return gen
