"""Release fences of a pinned slot ring, and going on when the ring cannot be pinned.

Cost per batch of the fences (NOTE [ Slot lifetime ] in ``_memory/ring.py``): at hand-out, one
current-stream read per device known to have a context; at release, the same reads, a driver
query (which creates no context) per visible device not yet known to have one, and one event
record per distinct stream, under torch's own guard of the stream's device (no Python-side
guard); at ``acquire`` with no free slot, a query per fenced slot. No pointer probe.
``python -m bench.release`` counts them and times gpufeed's own part.

A slot that cannot be registered (locked-memory limit, unsupported, out of resources) gives one
warning with CUDA's reason and the fix (``warn_unpinned``); it and every later slot stay
unregistered, and their batches are pinned the ordinary way (``pin_batch``).

NOTE [ Ctrl-C and slot releases ]
---------------------------------
A KeyboardInterrupt raised inside a finalizer is printed and dropped (NOTE [ Ctrl-C that
Python drops ] in ``_base/interrupts.py``): one that landed in a batch's release would be lost
and the loop would go on. So:

- an unpinned slot (every slot without CUDA) is released by no Python code: its batch's base
  array carries a weak reference (``_Lease``, naming the slot) whose callback is the C method
  ``deque.append`` into the ring's ``_dropped``, which ``acquire`` reads. A signal that
  arrives meanwhile stays pending and is raised in the user's loop.
- a pinned slot must record its release event on the current streams then and there, which
  takes Python (``Releaser``). A KeyboardInterrupt raised there before the slot went to a
  list parks the slot (fenced by the next ``acquire``, NOTE [ Slot lifetime ] (c)); one raised
  after leaves it be (at worst one slot lost to the ring: looking it up again could race an
  ``acquire`` on another thread and free it twice). Either way the main thread is
  interrupted again 20 ms later, when the release is over. Left open: the few bytecodes of
  ``weakref.finalize``'s own call before ``Releaser`` runs, and an interrupt raised by
  ``acquire``'s collection of dropped slots (one slot lost).
"""

from __future__ import annotations

import collections
import logging
import warnings
from typing import Any

from .._base import cuda as _cuda
from .._base.interrupts import interrupt_main_later

logger = logging.getLogger(__name__)


class PinningFallbackWarning(UserWarning):
    """The slot ring could not be page-locked; its batches are pinned the ordinary way."""


_warned = False  # once per process


def warn_unpinned(error: BaseException) -> None:
    """Say once per process why the ring is not page-locked, and the fix."""
    global _warned
    if _warned:
        logger.debug("slot ring left unregistered: %s", error)
        return
    _warned = True
    warnings.warn(
        f"gpufeed could not page-lock its slot ring ({error}); batches are pinned the "
        "ordinary way instead (one extra host copy each). Fix: raise the locked-memory "
        "limit (`ulimit -l`, RLIMIT_MEMLOCK; docker: --ulimit memlock=-1), lower "
        "ring_bytes=, or pass pin_memory=False.",
        PinningFallbackWarning,
        stacklevel=4,
    )


class Releaser:
    """What a batch's finalizer calls (any thread): its slot back to the ring, behind a
    release fence when the slot is registered and CUDA is initialised (NOTE [ Slot lifetime ]
    in ``_memory/ring.py``), on the streams of its hand-out (``handout``) too. It holds the
    ring's containers, not the ring: a kept batch does not keep the ring alive, and a closed
    ring's kept slots are still fenced when released.
    """

    __slots__ = ("device", "fences", "handout", "parked", "pins", "released")

    def __init__(self, released: collections.deque[int], fences: _cuda.Fences,
                 parked: collections.deque[int], pins: dict[int, Any],
                 device: int | None, handout: dict[int, Any] | None = None) -> None:
        self.released, self.fences, self.parked = released, fences, parked
        self.pins, self.device = pins, device
        self.handout: dict[int, Any] = {} if handout is None else handout

    def __call__(self, sid: int) -> None:
        """The slot to the free list, or behind a fence (NOTE [ Slot lifetime ] (a))."""
        # ``placing`` turns True just before the slot goes to a list: a KeyboardInterrupt
        # before that parks the slot, one after leaves it be (NOTE [ Ctrl-C and slot releases ]).
        placing = False
        try:
            handle = self.pins.get(sid)
            if (
                handle is None
                or not _cuda.cuda_initialized()
                or _cuda.copies_completed(handle.ptr, handle.ptr + handle.nbytes)
            ):
                placing = True
                self.handout.pop(sid, None)
                self.released.append(sid)
                return
            try:
                if _cuda.capturing(self.device):
                    raise RuntimeError("a CUDA graph capture is in progress")
                event = _cuda.release_event(self._device(), self.handout.get(sid, ()))
            except Exception:  # (c): fenced by a later acquire
                placing = True
                self.parked.append(sid)
                return
            placing = True
            self.handout.pop(sid, None)
            self.fences.add(event, sid)
        except KeyboardInterrupt:
            if not placing:
                self.parked.append(sid)
            interrupt_main_later()

    def _device(self) -> int:
        return _cuda.current_device() if self.device is None else self.device

    def fence_parked(self) -> None:
        """Fence the parked releases (c) with one event now, unless still impossible."""
        parked = list(self.parked)  # those released before the event below; later ones wait
        try:
            if _cuda.capturing(self.device):
                return
            streams = [s for sid in parked for s in self.handout.get(sid, ())]
            event = _cuda.release_event(self._device(), streams)
        except Exception as e:  # still cannot fence: they stay parked
            logger.debug("release fence not recorded yet: %s", e)
            return
        for _ in parked:
            sid = self.parked.popleft()
            self.handout.pop(sid, None)
            self.fences.add(event, sid)
