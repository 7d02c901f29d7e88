"""Seeing a dataset draw from the global random generators in a thread worker, and saying so.

Thread workers share the global generators (torch's, numpy's, Python's) with each other and
the training loop, unseeded and unlocked (NOTE [ Seeding and threads ] in
``_order/seeding.py``): their draws are not reproducible. A :class:`GlobalDrawWatch` per
loader notices them, and the loader warns once, with the fix.

A thread worker compares the global states (:func:`fingerprint`) before and after one call
into user code (``__getitem__``, ``__getitems__``, an iterable's ``next``, ``collate_fn``),
counting a change only when the main thread waited inside ``next()`` all along (``blocked``,
``leaves`` unchanged; the wait ends before the sampler, which may draw, is asked): the change
came from a worker, or another thread of the program, which the watch cannot tell apart. Per
call, not per task: with several workers the loop takes a batch during almost every task.

Cost, sampled: at most one task every ``CHECK_EVERY_S`` seconds per loader, its first
``CALLS_PER_TASK`` calls while the loop waits, two fingerprints each (about 20 us each);
nothing after ``CLEAN_CALLS`` clean calls or a warning. The loop waits at least for each
epoch's first batches, so a dataset that draws on every sample is seen in its first.

``numpy.random`` is imported here, in the thread that imports gpufeed: numpy 2 imports it on
first use, and a fork by another thread during that import in a thread worker would copy its
module lock, held, into a child whose first ``np.random`` then waits for good. Thread workers
import nothing of gpufeed's own (tests/host/test_thread_imports.py).
"""

from __future__ import annotations

import ctypes
import random
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import numpy.random  # see the module docstring
import torch

from .._order.sample_rng import RandomStateWarning

CHECK_EVERY_S = 0.05
CALLS_PER_TASK = 8
CLEAN_CALLS = 256
_NAMES = ("torch", "numpy", "random")
_MT19937_BYTES = 624 * 4 + 4  # numpy's mt19937_state: uint32 key[624]; int pos
F = TypeVar("F", bound=Callable[..., Any])


def _numpy_state() -> bytes:
    """numpy's global generator's state, read in place where it is the MT19937 whose layout we
    know (``get_state()`` builds a dict and copies the key: about 0.1 ms)."""
    get = getattr(np.random, "get_bit_generator", None)  # numpy >= 1.25
    bitgen = get() if get is not None else None
    if type(bitgen) is np.random.MT19937:
        return ctypes.string_at(bitgen.ctypes.state_address, _MT19937_BYTES)
    legacy: Any = np.random.get_state()
    return legacy[1].tobytes() + repr(legacy[2:]).encode()


def fingerprint() -> tuple[Any, ...]:
    """The three global generators' states, comparable with ``==``."""
    return (bytes(torch.default_generator.get_state().numpy()), _numpy_state(),
            random.getstate())


class GlobalDrawWatch:
    """Per loader: the main thread's waits (``blocked``, ``leaves``) and what the thread
    workers saw (``seen``); :meth:`report` warns once, in the main thread."""

    def __init__(self) -> None:
        self.warned = False
        self._fresh()

    def _fresh(self) -> None:
        self.blocked = False  # the main thread is waiting inside the loader
        self.leaves = 0  # how many times it stopped waiting
        self.seen: set[str] = set()  # global generators a worker was seen drawing from
        self.clean = 0  # checked calls that drew nothing
        self._next_check = 0.0
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:  # a copied loader (pickle, deepcopy) starts afresh
        return {"warned": self.warned}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._fresh()
        self.warned = state["warned"]

    # -- the main thread ------------------------------------------------------------------------
    def wait_begins(self) -> None:
        self.blocked = True

    def wait_ends(self) -> None:
        """Idempotent: every way out of ``next()`` calls it."""
        if self.blocked:
            self.leaves += 1  # first: a worker that reads it afterwards discards its check
            self.blocked = False

    def report(self, stacklevel: int) -> None:
        """Warn once if a worker was seen drawing (in the main thread: its filters apply)."""
        if not self.seen or self.warned:
            return
        self.warned = True
        names = ", ".join(f"{n}'s" if n != "random" else "Python's random" for n in _NAMES
                          if n in self.seen)
        warnings.warn(
            f"a dataset (or collate_fn) read by thread workers drew from {names} global random "
            "generator. Thread workers share the global generators with each other and with "
            "the training loop, so these draws are not reproducible (neither with seed= nor "
            "under torch.manual_seed) and differ from the stock DataLoader's. Draw from "
            "gpufeed.random.sample_generator(), sample_rng() or sample_random() instead (seeded "
            "per sample, the same for any workers), or use worker_type='process', whose workers "
            "seed their own global generators",
            RandomStateWarning, stacklevel=stacklevel + 1,
        )

    # -- a thread worker ------------------------------------------------------------------------
    def task_probe(self) -> TaskProbe | None:
        """A probe for the task about to run, or None (see the module docstring)."""
        if self.warned or self.seen or self.clean >= CLEAN_CALLS or not self.blocked:
            return None
        now = time.monotonic()
        with self._lock:
            if now < self._next_check:
                return None
            self._next_check = now + CHECK_EVERY_S
        return TaskProbe(self)

    def begin(self) -> tuple[int, tuple[Any, ...]] | None:
        leaves = self.leaves
        if not self.blocked:
            return None
        return leaves, fingerprint()

    def end(self, token: tuple[int, tuple[Any, ...]]) -> bool:
        """Whether the call :meth:`begin` started was a check (the loop waited all along)."""
        leaves, old = token
        new = fingerprint()
        if not self.blocked or self.leaves != leaves:  # the loop may have drawn meanwhile
            return False
        changed = [n for n, a, b in zip(_NAMES, old, new, strict=True) if a != b]
        self.seen.update(changed)
        if not changed:
            self.clean += 1
        return True


class TaskProbe:
    """Checks the first ``CALLS_PER_TASK`` calls of one task that run while the loop waits."""

    __slots__ = ("left", "watch")

    def __init__(self, watch: GlobalDrawWatch) -> None:
        self.watch = watch
        self.left = CALLS_PER_TASK

    def wrap(self, fn: F) -> F:
        """``fn``, checked while this probe has calls left."""

        def checked(*args: Any) -> Any:
            token = self.watch.begin() if self.left > 0 else None
            if token is None:
                return fn(*args)
            try:
                return fn(*args)
            finally:
                if self.watch.end(token):
                    self.left -= 1

        return checked  # type: ignore[return-value]
