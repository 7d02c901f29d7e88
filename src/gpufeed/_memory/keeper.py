"""Where pinned slot rings live between epochs, and after they are closed.

NOTE [ Slot lifetime ] (e) in ``_memory/ring.py``: registering a ring costs time in proportion
to its size, and unregistering it must wait for the copies that may still read it. So a loader
without persistent workers, which starts new workers every epoch, keeps its pinned ring in a
:class:`RingKeeper` from one epoch to the next instead of closing it:

    epoch end (iterator closes) ──► workers stopped for good? ──yes──► ring.reclaim(), kept
                                                                  no──► close_ring(ring)
    next iter(loader)           ──► keeper.take(...) fits? ──yes──► the same ring, registered
                                                            no──► close_ring(it), a new ring
    loader collected            ──► close_ring(kept ring)

A kept ring serves one iterator at a time (a second one alive at once builds its own). It fits
when the worker kind (shared or private memory), the device and the budget asked for are the
same; batches that grew are the ring's own business.

``close_ring`` unregisters what it can at once; a ring with slots the user holds, or behind a
pending fence, waits in ``_closing`` until each is released and past its fence
(``reap_closed``, run without blocking whenever a ring is taken or closed). So kept batches
stay page-locked as long as the user holds them, as stock's pinned batches do, and memory is
never unmapped while registered.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Any

from . import pinning as _pinning
from .region import reserve_for
from .ring import SlotRing

logger = logging.getLogger(__name__)

_closing: list[SlotRing] = []  # closed rings with slots still registered
_reaping = threading.Lock()  # taken without blocking: a reap inside a reap skips


def _after_fork() -> None:
    global _reaping
    _closing.clear()  # the parent's registrations, not ours
    _reaping = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


def reap_closed() -> None:
    """Unregister the released and fenced slots of closed rings, never blocking; one caller
    at a time, on any thread (a collection may close a loader's ring anywhere)."""
    if not _reaping.acquire(blocking=False):
        return  # another reap runs (on another thread, or this one further up)
    try:
        _pinning.retry_stranded()
        for ring in list(_closing):
            try:
                done = ring.reap(wait=False)
            except Exception as e:  # tried again at the next reap
                logger.debug("closed slot ring not reaped yet: %s", e)
                continue
            if done:
                _forget(ring)
    finally:
        _reaping.release()


def _forget(ring: SlotRing) -> None:
    if ring in _closing:
        _closing.remove(ring)


def close_ring(ring: SlotRing) -> None:
    """Close ``ring`` for good; what it cannot unregister yet waits in ``_closing``."""
    if not ring.close() and ring not in _closing:
        _closing.append(ring)
    reap_closed()


def _close_kept(box: list[SlotRing]) -> None:
    """The keeper's finalizer: its loader is gone, so is the use of its ring."""
    while box:
        try:
            close_ring(box.pop())
        except Exception as e:  # at interpreter exit CUDA may be gone already
            logger.debug("kept slot ring not closed: %s", e)


class RingKeeper:
    """A loader's pinned ring between two epochs: at most one, referred to by nothing the
    loader's iterators keep but this keeper, so no cycle keeps a loader's memory alive. A
    loader's copies and pickles get an empty keeper of their own."""

    def __init__(self) -> None:
        self._box: list[SlotRing] = []
        self._pid = os.getpid()
        self._fin = weakref.finalize(self, _close_kept, self._box)
        self._fin.atexit = False

    def take(self, *, shared: bool, device: int | None, budget: int | None) -> SlotRing | None:
        """The kept ring if it fits these settings, else None (and it is closed). A forked
        child forgets the parent's ring: its registrations and workers are the parent's."""
        if os.getpid() != self._pid:
            self._box.clear()
            self._pid = os.getpid()
        reap_closed()
        if not self._box:
            return None
        ring = self._box.pop()
        fits = (ring.pin and not ring.closed and ring.region is not None
                and ring.region.shared == shared and ring.user_budget == budget
                and (device is None or ring.device in (None, device)))
        if fits:
            return ring
        close_ring(ring)
        return None

    def keep(self, ring: SlotRing) -> None:
        """Keep ``ring`` for the next epoch (its workers have stopped; see ``reclaim``)."""
        if not self._fin.alive:  # collected with its loader already (a garbage cycle)
            close_ring(ring)
            return
        ring.reclaim()
        if self._box:  # two iterators of one loader ended: keep the last one
            close_ring(self._box.pop())
        self._box.append(ring)

    @property
    def kept(self) -> SlotRing | None:
        return self._box[0] if self._box else None

    def __reduce__(self) -> tuple[Any, ...]:
        return (RingKeeper, ())


def ring_for(keeper: RingKeeper | None, *, budget: int | None, shared: bool, pin: bool,
             device: int | None, slots_hint: int) -> SlotRing:
    """The ring ``keeper`` kept where it fits these settings, else a new one; either way
    sized for ``slots_hint`` slots."""
    kept = keeper.take(shared=shared, device=device, budget=budget) if keeper is not None else None
    ring = kept or SlotRing(reserve=reserve_for(budget), budget=budget, shared=shared, pin=pin,
                            slots_hint=slots_hint, device=device)
    ring.set_slots_hint(slots_hint)
    return ring


def end_ring(keeper: RingKeeper | None, ring: SlotRing, *, workers_stopped: bool) -> None:
    """An iterator is done with ``ring``: ``keeper`` keeps a pinned one once no worker can
    write a slot any more (``workers_stopped``), else it is closed."""
    if keeper is not None and ring.pin and workers_stopped:
        keeper.keep(ring)
    else:
        close_ring(ring)
