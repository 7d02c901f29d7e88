"""The slot ring: recycled shared memory that workers collate batches straight into.

NOTE [ Slot lifetime ]
----------------------
One region of memory is reserved per iterator: shared memory for process workers (created
before the workers start, so they inherit or receive it once), ordinary memory for thread
workers. Slots are carved out of it as needed; the iterator owns the bookkeeping.

    main: acquire() ──(slot offset, size)──> worker: collate into the slot, send a small
          message (leaf offsets, dtypes, shapes) ──> main: views(), hand batch to user
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
    make the current stream wait for ``s``); tests/test_ring_release_sim.py shows both.
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
import mmap
import os
import sys
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .._base import cuda as _cuda
from . import pinning as _pinning
from .release import Releaser, warn_unpinned

# A sparse reservation must not be charged to the commit limit up front (Linux's value; newer
# Pythons name it).
_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)
ALIGN = 64  # bytes; every leaf starts on a cache-line boundary
PAGE = mmap.PAGESIZE  # 64 KiB on some aarch64 hosts (GH200): never assume 4096


def align(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


def contiguous_at(typed: torch.Tensor, shape: tuple[int, ...], offset: int) -> torch.Tensor:
    """A C-contiguous tensor of ``shape`` viewing the 1-D ``typed`` from element ``offset``
    (how slot writers and spill files carve a leaf out of their memory)."""
    stride = []
    acc = 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    return typed.as_strided(shape, stride[::-1], offset)


def shm_free_bytes(path: str = "/dev/shm") -> int | None:
    """Free bytes in the shared-memory file system, or None where there is none."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def default_reserve() -> int:
    """Address space reserved for a ring whose budget the user did not set.

    The reservation is sparse: pages cost memory only once a slot touches them, and the
    budget (learnt from the first batch) bounds what is touched.
    """
    import psutil

    cap = min(16 << 30, psutil.virtual_memory().total // 2)
    return max(cap // PAGE * PAGE, PAGE)


def reserve_for(budget: int | None) -> int:
    """Address space to reserve for a ring whose budget is ``budget`` bytes (None: default).

    A user's budget is reserved up to the physical memory: live slots are touched memory, so
    a ring can never usefully hold more, and mapping more fails (128 TiB is the whole address
    space). Past the reservation batches fall back to ordinary allocation, as past the budget.
    """
    if budget is None:
        return default_reserve()
    import psutil

    return min(budget, max(psutil.virtual_memory().total // PAGE * PAGE, PAGE))


def _anonymous_file(size: int) -> int:
    """A descriptor of a nameless file for the shared region (the caller sizes and maps it).

    Linux: a memory file (``memfd``). Elsewhere (macOS, the BSDs): an unlinked temporary file,
    in /dev/shm when there is one; it leaves nothing behind either, but its pages may be
    written back to disk under memory pressure.
    """
    create = getattr(os, "memfd_create", None)
    if create is not None:
        return int(create("gpufeed-ring", getattr(os, "MFD_CLOEXEC", 0)))
    import tempfile

    ram = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryFile(prefix="gpufeed-ring-", dir=ram) as f:  # unlinked already
        return os.dup(f.fileno())  # not inheritable (PEP 446), like MFD_CLOEXEC


def _close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


class Region:
    """A sparse block of memory; shared (memfd) for process workers, private for threads.

    Shared regions live in an anonymous memory file (``_anonymous_file``: a memfd on Linux, an
    unlinked temporary file elsewhere), not in /dev/shm: nothing to unlink,
    nothing left behind if a process is killed, and no /dev/shm size limit to hit. Pickling
    one (for spawned workers) passes its descriptor; fork inherits the mapping. Private
    regions are private anonymous memory, so ``discard`` really frees their pages (a shared
    anonymous mapping would keep them in shmem).

    The region owns its descriptor: ``close_fd()`` closes it, and so does a finalizer when the
    region is collected first, or when ``__init__`` fails after creating it. The mapping
    belongs to ``mm`` (which keeps a descriptor of its own: CPython's mmap dups it); numpy and
    torch views keep ``mm`` alive. ``release()`` lets go of both: it unmaps at once when
    nothing views the memory any more, else the mapping goes with the last view. So a region
    still referenced after its ring closed (by a failed start-up's traceback, say) holds no
    descriptor and no memory.
    """

    def __init__(self, size: int, *, shared: bool) -> None:
        self.size = size
        self.fd = -1
        self.shared = shared
        self._fd_fin: weakref.finalize[Any, Any] | None = None
        if shared:
            self.fd = _anonymous_file(size)
            self._fd_fin = weakref.finalize(self, _close_fd, self.fd)
            try:
                os.ftruncate(self.fd, size)
                self.mm = mmap.mmap(self.fd, size)
            except BaseException:
                self.close_fd()
                raise
        else:
            self.mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _NORESERVE)
        self.array: np.ndarray = np.frombuffer(self.mm, dtype=np.uint8)
        self.tensor = torch.from_numpy(self.array)

    def discard(self, offset: int, size: int) -> None:
        """Give the pages of a retired slot back to the system (contents are lost)."""
        advice = getattr(mmap, "MADV_REMOVE" if self.shared else "MADV_DONTNEED", None)
        if advice is None:
            return  # this platform cannot punch holes: the pages stay until the ring closes
        try:
            self.mm.madvise(advice, offset, size)
        except (OSError, ValueError):
            pass  # only memory use is at stake

    def close_fd(self) -> None:
        """Drop the descriptor once workers have it; the mapping stays. Idempotent."""
        if self._fd_fin is not None:
            self._fd_fin()  # closes the descriptor once, and never again at collection
        self.fd = -1

    def release(self) -> None:
        """Let go of the descriptor and the mapping (see the class docstring). Idempotent."""
        self.close_fd()
        mm, self.mm = self.mm, None  # type: ignore[assignment]
        self.array = self.tensor = None  # type: ignore[assignment]
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # views of it are alive: it is unmapped with the last of them

    def __reduce__(self) -> tuple[Any, ...]:
        if self.fd < 0:
            raise RuntimeError("a gpufeed ring can only be sent to workers while they start")
        from multiprocessing.reduction import DupFd

        return (_attach, (DupFd(self.fd), self.size))


def _attach(dupfd: Any, size: int) -> Region:
    fd = dupfd.detach()
    obj = Region.__new__(Region)
    obj.size, obj.fd, obj.shared, obj._fd_fin = size, -1, True, None
    try:
        obj.mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    obj.array = np.frombuffer(obj.mm, dtype=np.uint8)
    obj.tensor = torch.from_numpy(obj.array)
    return obj


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
            self.mem = Region(max(reserve, PAGE), shared=shared)
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
        self.region = self.mem.tensor
        self.region_np = self.mem.array
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

    def set_slots_hint(self, slots: int) -> None:
        """Grow a default budget to ``slots`` slots (a budget the user set stays).

        It never shrinks: slots carved under it may be held by the user, and retiring free
        ones is done by ``acquire`` whenever live bytes exceed the budget.
        """
        self.slots_hint = max(self.slots_hint, slots)
        if self.user_budget is None and self.slot_bytes:
            self.budget = min(self.reserve, self.slots_hint * self.slot_bytes)

    @property
    def capacity_slots(self) -> int:
        if not self.slot_bytes or self.budget is None:
            return 0
        return self.budget // self.slot_bytes

    @property
    def in_use(self) -> int:
        return len(self._slots) - len(self._free) - len(self._released)

    @property
    def fenced(self) -> int:
        """Released slots still waiting for their release event (or parked, (c))."""
        return len(self._fences) + len(self._parked)

    # -- acquire / release ---------------------------------------------------------------
    def acquire(self) -> tuple[int, int, int] | None:
        """A free slot as (id, offset, size), a new one within budget, or None (fallback)."""
        self.drain()
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

    def drain(self) -> None:
        rel = self._released
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
                self.region[off : off + size], device=self.device, fences=self._fences
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
        self.mem.discard(off, size)
        i = bisect.bisect(self._extents, (off, size))
        self._extents.insert(i, (off, size))
        merged: list[tuple[int, int]] = []
        for o, s in self._extents:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + s)
            else:
                merged.append((o, s))
        self._extents = merged

    # -- views ----------------------------------------------------------------------------
    def views(self, sid: int, used: int, packed: Any, spill: torch.Tensor | None = None) -> Any:
        """Turn a worker's packed batch into tensors viewing slot ``sid`` (and its spill file's
        bytes ``spill``, if any: NOTE [ Spill ] in _memory/spill.py).

        See NOTE [ Slot lifetime ]: the slot is released when the last view is gone.
        """
        from .._host.collate import unpack

        off, _ = self._slots[sid]
        if used == 0:
            self.release(sid)
            return unpack(packed, None, spill)
        base = self.region_np[off : off + align(used)]
        fin = weakref.finalize(base, self._releaser, sid)
        fin.atexit = False
        return unpack(packed, base, spill)

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
        self.region = self.region_np = None  # type: ignore[assignment]
        self.mem.release()
        self.mem = None  # type: ignore[assignment]


ReleaseFn = Callable[[int], None]
