"""The slot ring: recycled shared memory that workers collate batches straight into.

NOTE [ Slot lifetime ]
----------------------
One region is reserved per iterator (per loader for a pinned ring, kept across epochs: (e)):
shared memory for process workers (created before they start, so they inherit or receive it),
ordinary memory for thread workers. Slots are carved out of it as needed; the iterator owns
the bookkeeping.

    main: acquire() ──(slot offset, size)──> worker: collate into the slot, send a small
          message (leaf offsets, dtypes, shapes) ──> main: lease() + unpack(), hand batch to user
    user drops the last tensor viewing the batch ──> finalizer ──> release() ──> free list

The user's tensors view one per-batch numpy "base" array that spans the slot, and keep it
alive: its finalizer, which returns the slot to the free list, runs only when the last view
of the batch is gone, so a batch the user keeps (``list(loader)``) is never overwritten. A
device stage holds the host batch until its copy's event has completed: the same guarantee.

Release fences (pinned rings): a registered slot may still be read by a copy the user queued
(``x.cuda(non_blocking=True)`` after ``DataLoader(pin_memory=True)``), so dropping the batch
does not free the slot by itself. PyTorch fences the memory of its own caching host allocator
this way, and records nothing for registered memory:

    hand-out (next())   ──► the consumer's current stream of each device with a context
                            (``hand_out``; not with a device stage, whose copies it orders)
    finalizer, CUDA     ──► one event E on each of: those hand-out streams, and the releasing
    initialised             thread's current stream of every device with a CUDA context;
                            (E, slot) into the ring's Fences (``release_event``)
    acquire() with no   ──► E.query() for each: completed slots join the free list;
    free slot               none: carve a new slot or fall back (never blocks)

(a) Covered: copies queued before the last view went, on the stream current for the loop at
    hand-out or on the releasing thread's current stream, of any device (a model on
    ``cuda:1``, ``nn.DataParallel``'s scatter, whose side streams the current streams wait
    for), whichever thread drops the batch (tests/memory/test_release_devices.py). Not
    covered, the user's to order: a copy on a stream current neither at hand-out nor at the
    drop (``with torch.cuda.stream(s)`` around the copy only): drop the batch inside, or make
    the current stream wait for ``s`` (tests/memory/test_release_sim.py). "Dropped" means the
    last reference went: ``enumerate(loader)`` keeps the batch until the next iteration.
(b) Not fenced: batches a device stage drops after their copy's event
    (``_cuda.copies_complete``), slots of an unregistered ring (a copy from pageable memory
    returns once the bytes are staged), and any release before CUDA is initialised.
(c) A release that cannot record its event (a graph capture in progress, CUDA failing) is
    parked and fenced by the next ``acquire`` that can record one.
(d) A free slot has no pending copy: retiring it (batches grew, the budget shrank) and closing
    the ring unregister free slots without waiting. The CPU waits for the GPU only where memory
    is unregistered while a copy may read it: a device stage's copies in flight
    (``_memory/pinning.py`` rule 3) and a ring collected without ``close``.
(e) Kept slots stay pinned. Closing the ring leaves every slot the user still holds, or
    whose fence is pending, registered and mapped until it is released and past its fence;
    without persistent workers a loader keeps its pinned ring, registered, across epochs
    (both in ``_memory/keeper.py``). Slots the user holds across an epoch end are carried
    outside the next epoch's budget until released.

Cost per batch, Ctrl-C during a release, and a ring that cannot be registered:
``_memory/release.py``.

Growth and fallback: a batch needs ``need`` bytes (learnt from the first batch, and from any
larger one later). With no slot free, a new one is carved within the ring's byte budget; past
it a task gets no slot and the worker allocates ordinary shared memory for that batch (the
stock path). The budget is a cap, not memory mapped up front; the reservation is at most the
physical memory (``reserve_for``), and a ring that carved all of it falls back the same way.
Dispatch never waits for a slot, so keeping every batch cannot deadlock, and a batch is never
truncated: leaves that do not fit its slot are sent the ordinary way.
"""

from __future__ import annotations

import bisect
import collections
import weakref
from typing import Any

import numpy as np

from .._base import cuda as _cuda
from . import pinning as _pinning
from .region import ALIGN, PAGE, align, reserve_region
from .release import Releaser, warn_unpinned


class _Lease(weakref.ref):
    """An unpinned slot's weak reference to its batch, naming the slot (runs no Python)."""
    __slots__ = ("sid",)
    sid: int


class SlotRing:
    """Main-process side of the ring: region, slots, free list, byte budget.

    ``reserve``: bytes of address space to reserve (sparse). ``budget``: the most bytes live
    slots may take (a higher one keeps more held batches in recycled memory, a lower one falls
    back sooner); None: ``slots_hint`` slots of the first batch's size. ``shared``: shared
    memory (process workers). ``pin``: page-lock each slot when it is carved. ``device``: the
    CUDA device registrations and release events run under (None: the current one).
    """

    def __init__(
        self, *, reserve: int, budget: int | None, shared: bool, pin: bool, slots_hint: int,
        device: int | None = None,
    ) -> None:
        self.reserve, self.device, self.slots_hint, self.pin = reserve, device, slots_hint, pin
        self.budget = self.user_budget = None if budget is None else min(budget, reserve)
        self.region = reserve_region(reserve, shared=shared, budget=budget)
        self.region_tensor = self.region.tensor
        self.region_array = self.region.array
        self.slot_bytes = 0  # size of new slots; 0 until the first batch says
        self._extents: list[tuple[int, int]] = [(0, reserve)]  # free (offset, size), sorted
        self._slots: dict[int, tuple[int, int]] = {}  # id -> (offset, size)
        self._pins: dict[int, Any] = {}
        self._free: list[int] = []
        self._next_id = 0
        self.live_bytes = self.grows = self.fallbacks = 0
        self.closed = False
        # Finalizers may run on any thread; deque.append/popleft are atomic.
        self._released: collections.deque[int] = collections.deque()
        # Unpinned leases: slot -> its batch's weak reference, which a dropped batch's
        # callback puts in _dropped (see NOTE [ Ctrl-C and slot releases ]).
        self._leases: dict[int, _Lease] = {}
        self._dropped: collections.deque[_Lease] = collections.deque()
        self._fences = _cuda.Fences()  # (event, slot) of fenced releases; handles hold it
        self._parked: collections.deque[int] = collections.deque()  # see (c)
        self._out: set[int] = set()  # acquired for a worker, not yet leased or released
        self._carried: set[int] = set()  # held by the user since before the epoch began
        self.carried_bytes = 0
        self._handout: dict[int, Any] = {}  # slot -> the consumer's streams at hand-out
        self._releaser = Releaser(self._released, self._fences, self._parked, self._pins,
                                   device, self._handout)

    # -- sizing ---------------------------------------------------------------------------
    def learn(self, need: int) -> None:
        """Record that a batch needed ``need`` bytes; later slots are at least that big."""
        size = align(need, PAGE)
        if size > self.slot_bytes:
            self.slot_bytes = size
            if self.budget is None:
                self.budget = min(self.reserve, self.slots_hint * size)

    def set_slots_hint(self, slots: int, *, lower: bool = False) -> None:
        """Grow a default budget to ``slots`` slots (a budget the user set stays); it shrinks
        only with ``lower`` (the autotuner gave workers back), and ``acquire`` then retires
        free slots while live bytes exceed it."""
        self.slots_hint = slots if lower else max(self.slots_hint, slots)
        if self.user_budget is None and self.slot_bytes:
            self.budget = min(self.reserve, self.slots_hint * self.slot_bytes)

    @property
    def capacity_slots(self) -> int:
        return self.budget // self.slot_bytes if self.slot_bytes and self.budget else 0

    @property
    def in_use(self) -> int:
        """Slots with a worker or the user: neither free, nor waiting for a fence."""
        return self.levels()[0][0][1]

    @property
    def fenced(self) -> int:
        """Released slots still waiting for their release event (or parked, (c))."""
        return len(self._fences) + len(self._parked)

    # -- acquire / release ---------------------------------------------------------------
    def acquire(self) -> tuple[int, int, int] | None:
        """A free slot as (id, offset, size), a new one within budget, or None (fallback)."""
        if not self._free:  # released slots are collected only when none is left
            self._collect_released()
            if not self._free:
                self._unfence()
        if not self.slot_bytes or self.closed:
            return None
        counted = self.live_bytes - self.carried_bytes  # against the budget
        while self._free:
            sid = self._free.pop()
            off, size = self._slots[sid]
            over = self.budget is not None and counted > self.budget
            if size >= self.slot_bytes and not over:
                self._out.add(sid)
                return sid, off, size
            try:
                self._retire(sid)  # too small for today's batches, or the budget shrank
            except BaseException:
                self._free.append(sid)  # still registered (a wait was interrupted)
                raise
            counted = self.live_bytes - self.carried_bytes
        if self.budget is not None and counted + self.slot_bytes <= self.budget:
            new = self._carve(self.slot_bytes)
            if new is not None:
                self._out.add(new[0])
                return new
        self.fallbacks += 1
        return None

    def release(self, sid: int) -> None:
        """Return a slot no copy can read (thread-safe): one a worker did not fill."""
        self._out.discard(sid)
        self._released.append(sid)

    def hand_out(self, sid: int, *, streams: bool) -> tuple[int, int] | None:
        """The batch of pinned slot ``sid`` is handed to the loop: its page-locked address
        range. ``streams``: remember the consumer's current streams, to fence at the release
        (NOTE [ Slot lifetime ] (a)); not before CUDA is initialised (no copy yet)."""
        if sid not in self._pins:
            return None
        if streams and _cuda.cuda_initialized():
            device = self.device if self.device is not None else _cuda.current_device()
            known = _cuda.context_devices(device, probe=False)  # a release probes the rest
            self._handout[sid] = _cuda.current_streams(known)
        off, size = self._slots[sid]
        start = self.region_tensor.data_ptr() + off
        return start, start + size

    def levels(self) -> tuple[list[tuple[str, int, int]], tuple[tuple[str, int], ...]]:
        """Occupancy (stage, used, capacity) and gauges (counter, level) for a loader's stats,
        once per batch handed out."""
        slot_bytes, budget = self.slot_bytes, self.budget  # capacity_slots, in_use in line
        cap = budget // slot_bytes if slot_bytes and budget else 0
        in_use = (len(self._slots) - len(self._free) - len(self._released) - len(self._dropped)
                  - len(self._parked) - (len(self._fences) if self._pins else 0))  # fences: pins'
        occupancy = [("ring", in_use, cap)]
        if self.pin:
            occupancy.append(("ring_fenced", self.fenced, cap))
        return occupancy, (("ring_slots", len(self._slots)), ("ring_bytes", self.live_bytes))

    def info(self) -> dict[str, int]:
        """The ring's figures for the loader's ``ring_info``."""
        return {"slot_bytes": self.slot_bytes, "live_bytes": self.live_bytes,
                "in_use": self.in_use, "fenced": self.fenced, "grows": self.grows,
                "fallbacks": self.fallbacks, "budget": self.budget or 0}

    def reclaim(self) -> None:
        """Kept for the next epoch, its workers stopped: slots given to workers that never
        answered are free again, and slots the user holds are carried outside the next
        epoch's budget until released."""
        self._free.extend(self._out)
        self._out.clear()
        self._collect_released()
        idle = {*self._free, *self._fences.payloads(), *self._parked}
        self._carried = {sid for sid in self._slots if sid not in idle}
        self.carried_bytes = sum(self._slots[sid][1] for sid in self._carried)

    def _unfence(self) -> None:
        """Slots whose release event has completed join the free list (never blocks)."""
        if self._parked:
            self._releaser.fence_parked()
        self._fences.done(self._released)  # each payload handed over as it is removed
        self._collect_released()

    def _collect_released(self) -> None:
        """Released slots (past their fence, or needing none) join the free list."""
        rel, dropped, leases = self._released, self._dropped, self._leases
        while dropped:
            sid = dropped.popleft().sid
            del leases[sid]
            rel.append(sid)
        while rel:
            sid = rel.popleft()
            if sid in self._slots:
                self._free.append(sid)
                if sid in self._carried:  # counts against the budget again
                    self._carried.discard(sid)
                    self.carried_bytes -= self._slots[sid][1]

    def _carve(self, size: int) -> tuple[int, int, int] | None:
        for i, (off, free) in enumerate(self._extents):
            if free >= size:
                handle = self._register(off, size)  # before any bookkeeping
                if free == size:
                    del self._extents[i]
                else:
                    self._extents[i] = (off + size, free - size)
                sid = self._next_id
                self._next_id += 1
                self._slots[sid] = (off, size)
                self.live_bytes += size
                self.grows += 1
                if handle is not None:
                    self._pins[sid] = handle
                return sid, off, size
        return None

    def _register(self, off: int, size: int) -> _pinning.PinnedRegion | None:
        """Page-lock a new slot; on failure warn once and go on unregistered (``release.py``)."""
        if not self.pin:
            return None
        try:
            handle = _pinning.register(
                self.region_tensor[off : off + size], device=self.device, fences=self._fences
            )
            if handle is not None and self.device is None:  # CUDA is initialised now
                self.device = self._releaser.device = handle.device = _cuda.current_device()
            return handle
        except RuntimeError as e:
            self.pin = False  # no later slot tries again
            warn_unpinned(e)
            return None

    def _retire(self, sid: int) -> None:
        """Give a free slot's memory back (it has no pending copy: NOTE (d))."""
        handle = self._pins.get(sid)
        if handle is not None:
            _pinning.unregister(handle, settled=True)  # may raise: then nothing changed
            del self._pins[sid]
        off, size = self._slots.pop(sid)
        self.live_bytes -= size
        self.region.discard(off, size)
        bisect.insort(self._extents, (off, size))
        merged: list[tuple[int, int]] = []
        for o, s in self._extents:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + s)
            else:
                merged.append((o, s))
        self._extents = merged

    # -- lease --------------------------------------------------------------------------
    def lease(self, sid: int, used: int) -> np.ndarray | None:
        """The ``used`` bytes of slot ``sid`` a worker filled, as the numpy base array that
        carries the slot's release (NOTE [ Slot lifetime ]; an unpinned slot's release is a
        weak reference, NOTE [ Ctrl-C and slot releases ]); None, the slot released at once,
        when ``used`` is 0."""
        off, _ = self._slots[sid]
        if used == 0:
            self.release(sid)
            return None
        self._out.discard(sid)
        base = self.region_array[off : off + (used + ALIGN - 1) // ALIGN * ALIGN]  # align()
        if sid in self._pins:
            fin = weakref.finalize(base, self._releaser, sid)
            fin.atexit = False
        else:
            ref = self._leases[sid] = _Lease(base, self._dropped.append)
            ref.sid = sid
        return base

    def close(self) -> bool:
        """Stop handing out slots and unregister the free ones; the others stay registered
        until released and fenced (NOTE (e)), and the memory stays mapped while views of it
        live. Interrupted, it can be called again. True when no slot is left registered."""
        self.closed = True
        if self.region is None:
            return not self._pins
        done = self.reap(wait=False) if self._pins else True
        # Views and registration handles keep the memory mapped; the ring lets go of it.
        self.region_tensor = self.region_array = None  # type: ignore[assignment]
        self.region.release()
        self.region = None  # type: ignore[assignment]
        return done

    def reap(self, *, wait: bool) -> bool:
        """Unregister a closed ring's free slots (``wait``: after its pending fences). True
        once no slot is left registered."""
        if wait:
            if self._parked:
                self._releaser.fence_parked()
            self._fences.wait(self._released)
        self._unfence()
        self._free.extend(self._out)  # given to workers that are gone: never leased
        self._out.clear()
        while self._free:
            sid = self._free[-1]
            handle = self._pins.get(sid)
            if handle is not None:  # may raise: the slot stays free and registered
                _pinning.unregister(handle, settled=True)
                del self._pins[sid]
            self._free.pop()
            self._slots.pop(sid, None)
        return not self._pins
