"""The slot ring: recycled shared memory that workers collate batches straight into.

NOTE [ Slot lifetime ]
----------------------
One region of memory is reserved per iterator: shared memory for process workers (created
before the workers start, so they inherit or receive it once), ordinary memory for thread
workers. Slots are carved out of it as needed; the iterator owns the bookkeeping.

    main: acquire() ──(slot offset, size)──> worker: collate into the slot, send a small
          message (leaf offsets, dtypes, shapes) ──> main: lease() + unpack(), hand batch to user
    user drops the last tensor viewing the batch ──> finalizer ──> release() ──> free list

The user's tensors are views of one per-batch numpy "base" array that spans the slot; each
tensor's storage keeps that base alive, so the base's finalizer runs only when the last view,
slice or derived view of the batch is gone. Only then does the slot return to the free list:
a batch the user keeps (``list(loader)``) is never overwritten. With a device stage the
host batch is held until its copy's event has completed, which gives the same guarantee.

Release fences (pinned rings): a slot registered with CUDA may still be read by a copy the
user queued (``x.cuda(non_blocking=True)`` after ``DataLoader(pin_memory=True)``), so
dropping the batch does not free the slot by itself. PyTorch protects memory from its own
caching host allocator this way, but records nothing for registered memory:

    finalizer, CUDA initialised ──► event E on the current stream of the ring's device
                                    (the releasing thread's), (E, slot) into the ring's Fences
    acquire() with no free slot ──► E.query() for each: completed slots join the free list;
                                    none: carve a new slot or fall back (never blocks)
    close(), retire, collection ──► wait for every E (and one more event on the current
                                    stream, for slots the user still holds) before unregistering

(a) Covered: copies queued on the releasing thread's current stream of the ring's device
    before the last view went (the idiom above, in any order of ``del``). Not covered,
    the user's to order: a copy queued on another stream (``with torch.cuda.stream(s)``)
    or to another device when the batch is dropped outside that block (drop it inside, or
    make the current stream wait for ``s``); tests/memory/test_release_sim.py shows both.
    "Dropped" means the last reference went: ``for k, batch in enumerate(loader)`` keeps
    the batch in enumerate's tuple until the next iteration, on whatever stream is current
    then. Any thread may drop it; its own current stream is the one fenced.
(b) Not fenced: batches a device stage drops after their copy's event (it says so with
    ``_cuda.copies_complete``), slots of an unregistered ring (a copy from pageable
    memory returns once the bytes are staged), and any release before CUDA is initialised.
(c) A release that cannot record its event (a graph capture in progress, CUDA failing) is
    parked and fenced by the next ``acquire`` that can record one.
(d) Waiting happens only where memory is unregistered: close (epoch end), a retired slot
    (rare: batches grew) and collection; each waits for the current stream once, so an
    epoch ends after the GPU has finished the steps queued so far. Code: ``_memory/release.py``.

NOTE [ Ctrl-C and slot releases ]
---------------------------------
Python runs a signal's handler in the main thread between two bytecodes of whatever Python
code runs there, finalizers included, and an exception raised inside a finalizer is printed
("Exception ignored in ...") and dropped. A Ctrl-C whose KeyboardInterrupt landed in a batch's
release would be lost and the loop would go on. So:

- an unpinned slot (every slot without CUDA) is released by no Python code at all: its batch's
  base array carries a plain weak reference whose callback is the C method ``deque.append``
  (the ref lands in the ring's ``_dropped``; ``acquire`` maps it back to its slot). A signal
  that arrives meanwhile stays pending and is raised in the user's loop.
- a pinned slot must record its release event on the releasing thread's current stream then
  and there, which takes Python (``Releaser``). A KeyboardInterrupt raised inside it before the
  slot went to a list parks the slot (fenced by the next ``acquire``, (c) above); one raised
  after that leaves it be (at worst one slot lost to the ring: looking it up again could race
  an ``acquire`` on another thread and free it twice). Either way the main thread is
  interrupted again from a short-lived thread 20 ms later, when the release is over. Left
  open: the few bytecodes of ``weakref.finalize``'s own call before ``Releaser`` runs, and an
  interrupt raised by ``acquire``'s own collection of dropped slots (one slot lost).

Registration failure (locked-memory limit, unsupported, out of resources): one warning
(``PinningFallbackWarning``) with CUDA's reason and the fix; the slot and every later one
stay unregistered and their batches are pinned the ordinary way (``pin_batch``).

Growth and fallback: a batch needs ``need`` bytes (learnt from the first batch, and from any
larger one later). When no slot is free, a new one is carved while the ring stays within its
byte budget; past the budget a task gets no slot and the worker allocates ordinary shared
memory for that batch (the stock path). The budget is a cap, not memory mapped up front: the
reservation is at most the machine's physical memory (``reserve_for``), and a ring that has
carved all of it falls back the same way. Dispatch never waits for a slot, so keeping every
batch cannot deadlock, and a batch that does not fit is never truncated: its leaves that do
not fit are sent the ordinary way.
"""

from __future__ import annotations

import bisect
import collections
import errno
import weakref
from typing import Any

import numpy as np

from .._base import cuda as _cuda
from . import pinning as _pinning
from .region import PAGE, Region, align
from .release import Releaser, warn_unpinned


class SlotRing:
    """Main-process side of the ring: region, slots, free list, byte budget.

    Args:
        reserve: bytes of address space to reserve (sparse).
        budget: the most bytes live slots may take; None to size it from the first batch as
            ``slots_hint`` slots (a higher budget keeps more batches in recycled memory when
            the user holds many; a lower one falls back to ordinary allocation sooner).
        shared: shared memory (process workers) or ordinary memory (thread workers).
        pin: page-lock each slot when it is created (needs CUDA).
        slots_hint: slots the default budget allows.
        device: the CUDA device index registrations and release events run under (None:
            the current device).
    """

    def __init__(
        self, *, reserve: int, budget: int | None, shared: bool, pin: bool, slots_hint: int,
        device: int | None = None,
    ) -> None:
        self.reserve = reserve
        self.device = device
        self.budget = budget
        self.user_budget = budget
        self.slots_hint = slots_hint
        self.pin = pin
        if budget is not None:
            self.budget = self.user_budget = min(budget, reserve)  # see reserve_for
        try:
            self.region = Region(max(reserve, PAGE), shared=shared)
        except OSError as e:
            if e.errno not in (errno.ENOMEM, errno.EFBIG, errno.EINVAL):
                raise
            fix = (
                f"lower ring_bytes= (it is {budget})" if budget is not None
                else "set ring_bytes= to the bytes the ring may hold"
            )
            raise ValueError(
                f"gpufeed cannot reserve {reserve} bytes of address space for its slot ring "
                f"({e.strerror}): {fix}, or pass ring_bytes=0 to do without the ring"
            ) from e
        self.region_tensor = self.region.tensor
        self.region_array = self.region.array
        self.slot_bytes = 0  # size of new slots; 0 until the first batch says
        self._extents: list[tuple[int, int]] = [(0, reserve)]  # free (offset, size), sorted
        self._slots: dict[int, tuple[int, int]] = {}  # id -> (offset, size)
        self._pins: dict[int, Any] = {}
        self._free: list[int] = []
        self._next_id = 0
        self.live_bytes = 0
        self.grows = 0
        self.fallbacks = 0
        self.closed = False
        # Finalizers may run on any thread; deque.append/popleft are atomic.
        self._released: collections.deque[int] = collections.deque()
        # Unpinned leases: id(ref) -> (ref, slot); a dropped batch's ref lands in _dropped
        # (see NOTE [ Ctrl-C and slot releases ]).
        self._leases: dict[int, tuple[weakref.ref[np.ndarray], int]] = {}
        self._dropped: collections.deque[weakref.ref[np.ndarray]] = collections.deque()
        self._fences = _cuda.Fences()  # (event, slot) of fenced releases; handles hold it
        self._parked: collections.deque[int] = collections.deque()  # see (c)
        self._releaser = Releaser(self._released, self._fences, self._parked, self._pins,
                                   device)

    # -- sizing ---------------------------------------------------------------------------
    def learn(self, need: int) -> None:
        """Record that a batch needed ``need`` bytes; later slots are at least that big."""
        size = align(need, PAGE)
        if size > self.slot_bytes:
            self.slot_bytes = size
            if self.budget is None:
                self.budget = min(self.reserve, self.slots_hint * size)

    def set_slots_hint(self, slots: int, *, lower: bool = False) -> None:
        """Grow a default budget to ``slots`` slots (a budget the user set stays).

        It never shrinks, unless ``lower`` (the autotuner gave workers back): slots carved
        under it may be held by the user, and retiring free ones is done by ``acquire``
        whenever live bytes exceed the budget.
        """
        self.slots_hint = slots if lower else max(self.slots_hint, slots)
        if self.user_budget is None and self.slot_bytes:
            self.budget = min(self.reserve, self.slots_hint * self.slot_bytes)

    @property
    def capacity_slots(self) -> int:
        if not self.slot_bytes or self.budget is None:
            return 0
        return self.budget // self.slot_bytes

    @property
    def in_use(self) -> int:
        return len(self._slots) - len(self._free) - len(self._released) - len(self._dropped)

    @property
    def fenced(self) -> int:
        """Released slots still waiting for their release event (or parked, (c))."""
        return len(self._fences) + len(self._parked)

    # -- acquire / release ---------------------------------------------------------------
    def acquire(self) -> tuple[int, int, int] | None:
        """A free slot as (id, offset, size), a new one within budget, or None (fallback)."""
        self._collect_released()
        if not self.slot_bytes or self.closed:
            return None
        if not self._free:
            self._unfence()
        while self._free:
            sid = self._free.pop()
            off, size = self._slots[sid]
            over = self.budget is not None and self.live_bytes > self.budget
            if size >= self.slot_bytes and not over:
                return sid, off, size
            self._retire(sid)  # too small for today's batches, or the budget shrank
        if self.budget is not None and self.live_bytes + self.slot_bytes <= self.budget:
            new = self._carve(self.slot_bytes)
            if new is not None:
                return new
        self.fallbacks += 1
        return None

    def release(self, sid: int) -> None:
        """Return a slot no copy can read (thread-safe): one a worker did not fill."""
        self._released.append(sid)

    def _unfence(self) -> None:
        """Slots whose release event has completed join the free list (never blocks)."""
        if self._parked:
            self._releaser.fence_parked()
        for sid in self._fences.done():
            if sid in self._slots:
                self._free.append(sid)

    def _collect_released(self) -> None:
        """Slots released without a fence (``release``, dropped unpinned batches, unfenced
        finalizers) join the free list."""
        rel, dropped, leases = self._released, self._dropped, self._leases
        while dropped:
            rel.append(leases.pop(id(dropped.popleft()))[1])
        while rel:
            sid = rel.popleft()
            if sid in self._slots:
                self._free.append(sid)

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
        """Page-lock a new slot; on failure warn once and go on unregistered (see above)."""
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
        off, size = self._slots.pop(sid)
        handle = self._pins.pop(sid, None)
        if handle is not None:
            _pinning.unregister(handle)  # waits for the fences (rare: batches grew)
        self.live_bytes -= size
        self.region.discard(off, size)
        i = bisect.bisect(self._extents, (off, size))
        self._extents.insert(i, (off, size))
        merged: list[tuple[int, int]] = []
        for o, s in self._extents:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + s)
            else:
                merged.append((o, s))
        self._extents = merged

    # -- lease --------------------------------------------------------------------------
    def lease(self, sid: int, used: int) -> np.ndarray | None:
        """The bytes of slot ``sid`` a worker filled (``used`` of them), as one numpy array to
        view the batch through (``_host/collate.py``'s ``unpack``); None when the batch left
        nothing in the slot (``used`` 0), which is then released at once.

        See NOTE [ Slot lifetime ]: the array carries the slot's release, which runs when the
        array and the last view of it are gone; NOTE [ Ctrl-C and slot releases ] says why an
        unpinned slot's release is a weak reference whose callback is ``deque.append``.
        """
        off, _ = self._slots[sid]
        if used == 0:
            self.release(sid)
            return None
        base = self.region_array[off : off + align(used)]
        if sid in self._pins:
            fin = weakref.finalize(base, self._releaser, sid)
            fin.atexit = False
        else:
            ref = weakref.ref(base, self._dropped.append)
            self._leases[id(ref)] = (ref, sid)
        return base

    def close(self) -> None:
        """Forget the slots; memory stays mapped while user tensors still view it."""
        if self.closed:
            return
        self.closed = True
        if self._pins:
            # Each unregister first waits for the release fences and an event on the current
            # stream (slots the user still holds, parked ones): NOTE [ Registered memory
            # lifetime ] (3).
            for h in self._pins.values():
                _pinning.unregister(h)
        self._pins.clear()
        # Views handed to the user keep the memory mapped; the ring itself lets go of it
        # (unpinned first: memory is never unmapped while registered with CUDA).
        self.region_tensor = self.region_array = None  # type: ignore[assignment]
        self.region.release()
        self.region = None  # type: ignore[assignment]
