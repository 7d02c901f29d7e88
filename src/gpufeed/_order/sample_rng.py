"""Per-sample generators: ``gpufeed.random.sample_generator()``, ``sample_rng()``,
``sample_random()``.

A fetcher (``_host/fetch.py``) opens a :class:`SampleScope` around every batch and moves it from
sample to sample; the three functions return a generator seeded from the calling thread's
sample, so a random transform drawn from them gives the same values whoever fetches the sample
(0, 1 or 8 workers, threads or processes) and after a resume. No lock, no global state: thread
workers draw in parallel, and the loop's draws cannot change them (NOTE [ Seeding and threads ]
in ``_order/seeding.py``).

A sample's seed is ``sample_seed(base, epoch, index)``: ``base`` is the loader's ``seed=`` or,
without one, drawn when iteration starts from the loader's ``generator`` (else torch's global
one), as torch draws its workers' base seed, so ``torch.manual_seed`` governs it. Each library
gets its own hash of that seed, so the three streams are unrelated to one another and to the
global generators' per-sample seeding (torch's and numpy's legacy generator are both MT19937,
and the global generators are seeded from the sample's seed itself). Iterable datasets have no
index: each worker numbers its samples in the order it fetches them and mixes its id into
``base`` (:func:`stream_base`).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import numpy as np
import torch

from .seeding import _mix, batch_seed, epoch_key, seed_in

G = TypeVar("G")
_local = threading.local()
# Each library's tag, mixed into the sample's seed (its own hash: see the module docstring).
_TORCH, _NUMPY, _RANDOM = 0x7A3B9C1D5E6F, 0x1F2E3D4C5B6A, 0x5A5A3C3C9696


class RandomStateWarning(UserWarning):
    """gpufeed saw random draws it cannot make reproducible: a dataset that draws from a global
    generator in thread workers, or a ``state_dict()`` without ``seed=``, whose resume replays
    the order but not the random transforms."""


class SampleScope:
    """The sample a thread is fetching, which the per-sample generators are seeded from.

    One per fetcher (a worker, or the main process with ``num_workers=0``): ``open`` makes it
    the calling thread's scope for one batch, ``at``/``at_batch`` move it, ``close`` restores
    the scope open before (a dataset may itself iterate a loader). For user code a source calls
    itself (an image source's ``transform=``): ``seed_globals``, whether the fetcher may seed
    the global generators per sample (never in thread workers: NOTE [ Seeding and threads ]),
    and ``probe``, its check for global draws (``_host/random_watch.py``), if any.

    Made once: the epoch's ``epoch_key`` (in ``open``) and the torch and Python generator
    objects (numpy's is made per sample). ``at`` only names the sample; a generator is
    re-seeded at its first request (:meth:`made`), as a new one of that seed would be, so a
    sample that asks for none costs nothing.
    """

    __slots__ = ("_made", "_own", "_prev", "base", "batch", "epoch", "index", "key", "probe",
                 "seed_globals")

    def __init__(self, *, seed_globals: bool = False) -> None:
        self.base = self.epoch = 0
        self.key = epoch_key(0, 0)
        self.index: Any = None
        self.batch: Sequence[Any] = ()
        self._made: _Made | None = None
        # The torch and Python generators, re-seeded per sample (by library tag).
        self._own: dict[int, Any] = {}
        self._prev: SampleScope | None = None
        self.seed_globals = seed_globals
        self.probe: Any = None

    def open(self, base: int, epoch: int) -> None:
        self._prev = getattr(_local, "scope", None)
        _local.scope = self
        if base != self.base or epoch != self.epoch:
            self.base, self.epoch = base, epoch
            self.key = epoch_key(base, epoch)
        self.at_batch(None)

    def close(self) -> None:
        _local.scope, self._prev = self._prev, None

    def at(self, index: Any) -> None:
        """Sample ``index`` is being fetched now (its generators are made when first asked)."""
        self.index = index
        self._made = None

    def at_batch(self, indices: Sequence[Any] | None) -> None:
        """A whole batch is being fetched or collated (``__getitems__``, a batch source,
        ``collate_fn``): generators asked without an index come from ``batch_seed``."""
        self.batch = indices if indices is not None else ()
        self.index = None
        self._made = None

    def seed_of(self, index: Any) -> int:
        return seed_in(self.key, index)

    def made(self) -> _Made:
        """The current sample's (or batch's) seed and the generators made from it so far."""
        made = self._made
        if made is None:
            if self.index is not None:
                seed = seed_in(self.key, self.index)
            else:
                seed = batch_seed(self.base, self.epoch, self.batch)
            made = self._made = _Made(seed, {})
        return made

    def reseeded(self, tag: int, make: Callable[[], G], reseed: Callable[[G, int], Any]) -> G:
        """The current sample's generator of library ``tag``: the scope's own (``make()`` once),
        re-seeded by ``reseed(gen, seed)`` at the sample's first request."""
        made = self.made()
        gen = made.gens.get(tag)
        if gen is None:
            gen = self._own.get(tag)
            if gen is None:
                gen = self._own[tag] = make()
            reseed(gen, _mix(made.seed ^ tag))
            made.gens[tag] = gen
        return gen


class _Made(NamedTuple):
    """One sample's seed and its generators (by library tag), each made at its first request."""

    seed: int
    gens: dict[int, Any]


def stream_base(base: int, worker_id: int) -> int:
    """The base of worker ``worker_id``'s samples of an iterable dataset (each worker numbers
    its own samples)."""
    return _mix(base ^ _mix(worker_id + 1))


def current_scope() -> SampleScope | None:
    """The scope of the sample this thread is fetching, or None outside a gpufeed fetch."""
    return getattr(_local, "scope", None)


def _fresh_seed(index: int | None, tag: int) -> int:
    """The seed of a generator outside a fetch (one draw from torch's global generator, which a
    stock worker seeds), or of another sample's (``index``)."""
    scope = current_scope()
    if scope is None:
        return _mix(int(torch.empty((), dtype=torch.int64).random_().item()) ^ tag)
    return _mix(scope.seed_of(index) ^ tag)


def sample_generator(index: int | None = None) -> torch.Generator:
    """A CPU ``torch.Generator`` for the sample being fetched: pass it as ``generator=``.

    Call it in ``__getitem__`` (or ``__getitems__``, ``__iter__``, ``collate_fn``) of a dataset
    read by ``gpufeed.DataLoader``: its draws depend only on the loader's seed, the epoch and
    the sample's index, so they are the same for any ``num_workers`` and ``worker_type``, after
    a resume (with ``seed=``), and whatever the training loop draws meanwhile; without ``seed=``
    they follow ``torch.manual_seed``. Thread workers draw from it in parallel, without a lock.
    Within one sample every call returns the same generator (successive draws continue one
    stream); the next sample's starts from its own seed (the same object, re-seeded: do not
    keep it past the sample).

    Args:
        index: the dataset index of another sample of the batch being fetched, e.g. in
            ``__getitems__(indices)``: a fresh generator for that sample, the one its
            ``__getitem__`` would get. None (default): the sample being fetched; in
            ``__getitems__`` or ``collate_fn``, one generator for the whole batch.

    Outside a gpufeed fetch (the stock DataLoader, ``dataset[i]`` by hand) it returns a fresh
    generator seeded by one draw from torch's global generator, so the same dataset code runs
    anywhere. Cost: seeding the generator, a few microseconds per sample that asks for it,
    less than seeding the three global generators; nothing for one that does not
    (``python -m bench.seeding``; figures in docs/guides/randomness.md).
    """
    scope = current_scope()
    if scope is None or index is not None:
        gen = torch.Generator()
        gen.manual_seed(_fresh_seed(index, _TORCH))
        return gen
    return scope.reseeded(_TORCH, torch.Generator, torch.Generator.manual_seed)


def sample_rng(index: int | None = None) -> np.random.Generator:
    """A ``numpy.random.Generator`` (PCG64) for the sample being fetched.

    The numpy counterpart of :func:`sample_generator`, with the same rules (``index``, one
    generator per sample, the fallback outside a gpufeed fetch): ``numpy.random.default_rng``
    of the sample's seed. Cost: numpy's seeding, about three times torch's.
    """
    scope = current_scope()
    if scope is None or index is not None:
        return np.random.default_rng(_fresh_seed(index, _NUMPY))
    # Made per sample: a PCG64 cannot be re-seeded in place.
    made = scope.made()
    gen = made.gens.get(_NUMPY)
    if gen is None:
        gen = made.gens[_NUMPY] = np.random.default_rng(_mix(made.seed ^ _NUMPY))
    return gen


def sample_random(index: int | None = None) -> random.Random:
    """A ``random.Random`` for the sample being fetched (code written for Python's ``random``:
    ``rnd = gpufeed.random.sample_random(); rnd.random()``).

    The counterpart of :func:`sample_generator`, with the same rules; about as cheap.
    """
    scope = current_scope()
    if scope is None or index is not None:
        return random.Random(_fresh_seed(index, _RANDOM))
    return scope.reseeded(_RANDOM, random.Random, random.Random.seed)
