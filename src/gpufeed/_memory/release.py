"""Release fences of a pinned slot ring, and going on when the ring cannot be pinned.

See NOTE [ Slot lifetime ] in ``_memory/ring.py`` ("Release fences"): a ring slot registered with
CUDA returns to the free list only once an event recorded on the current stream at its
release has completed, because a copy the user queued from it may still read it.
"""

from __future__ import annotations

import collections
import logging
import signal
import threading
import warnings
from typing import Any

from .._base import cuda as _cuda

__all__ = ["PinningFallbackWarning", "Releaser", "interrupt_main_later", "warn_unpinned"]

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
    release fence when the slot is registered and CUDA is initialised (NOTE above). It holds
    the ring's containers, not the ring: a kept batch does not keep the ring alive."""

    __slots__ = ("device", "fences", "parked", "pins", "released")

    def __init__(self, released: collections.deque[int], fences: _cuda.Fences,
                 parked: collections.deque[int], pins: dict[int, Any],
                 device: int | None) -> None:
        self.released, self.fences, self.parked = released, fences, parked
        self.pins, self.device = pins, device

    def __call__(self, sid: int) -> None:
        try:
            self.release(sid)
        except KeyboardInterrupt:  # see NOTE [ Ctrl-C and slot releases ] in _memory/ring.py
            if sid not in self.released and sid not in self.parked and sid not in self.fences:
                self.parked.append(sid)
            interrupt_main_later()

    def release(self, sid: int) -> None:
        """The slot to the free list, or behind a fence on the current stream (see above)."""
        if (
            sid not in self.pins
            or _cuda.in_copies_complete()
            or not _cuda.cuda_initialized()
        ):
            self.released.append(sid)
            return
        try:
            if _cuda.capturing(self.device):
                raise RuntimeError("a CUDA graph capture is in progress")
            self.fences.add(_cuda.current_stream_event(self.device), sid)
        except Exception:  # (c): fenced by a later acquire
            self.parked.append(sid)

    def fence_parked(self) -> None:
        """Fence the parked releases (c) with one event now, unless still impossible."""
        try:
            if _cuda.capturing(self.device):
                return
            event = _cuda.current_stream_event(self.device)
        except Exception as e:  # still cannot fence: they stay parked
            logger.debug("release fence not recorded yet: %s", e)
            return
        while self.parked:
            self.fences.add(event, self.parked.popleft())


def interrupt_main_later(delay_s: float = 0.02) -> None:
    """Send SIGINT to the main thread after ``delay_s``, from a daemon thread: a Ctrl-C caught
    where Python would drop it (a finalizer) is raised again once that code has returned."""
    main = threading.main_thread().ident
    if main is None:
        return
    timer = threading.Timer(delay_s, signal.pthread_kill, (main, signal.SIGINT))
    timer.daemon = True
    timer.name = "gpufeed-reinterrupt"
    timer.start()
