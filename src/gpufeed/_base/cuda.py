"""CUDA calls outside the copies themselves: device guard, events, capture, fences.

Every call here asks ``torch.cuda`` directly for a loader's device; nothing else in gpufeed
does, apart from ``_memory/pinning.py`` (``cudart``, ``is_pinned``, ``pin_memory``) and the
device stage's backend (``_device/streams.py``). The simulated backend of the tests
(tests/support/sim_cuda.py) replaces exactly these functions, so the guards placed around
them are tested:

* ``device_guard(d)``: ``torch.cuda.device(d)`` (NOTE [ Registered memory lifetime ] rule 5:
  under torchrun, rank 3 creates no context on GPU 0);
* ``current_stream_event(d)``: an event on the calling thread's current stream of ``d``
  (a release fence, NOTE [ Slot lifetime ] in ``_memory/ring.py``);
* ``capturing(d)``: whether that stream is capturing a CUDA graph;
* ``Fences``: events to pass before memory is reused or unregistered, held strongly;
* ``copies_complete()``: marks batches dropped after their copy completed (no fence needed).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch

__all__ = [
    "Fences", "capturing", "copies_complete", "cuda_initialized", "current_device",
    "current_stream_event", "device_count", "device_guard", "in_copies_complete",
]


def cuda_initialized() -> bool:
    """Whether this process has initialised CUDA (False in a child forked after it did)."""
    return bool(torch.cuda.is_initialized())


def device_count() -> int:
    return int(torch.cuda.device_count())


def current_device() -> int:
    return int(torch.cuda.current_device())


def device_guard(index: int | None) -> AbstractContextManager[Any]:
    """``torch.cuda.device(index)`` (NOTE [ Registered memory lifetime ] rule (5), in
    ``_memory/pinning.py``); nothing for None."""
    return nullcontext() if index is None else torch.cuda.device(index)


def current_stream_event(index: int | None) -> Any:
    """An event recorded now on the calling thread's current stream of device ``index``:
    it completes once everything queued there so far (a user's non_blocking copy) has."""
    with device_guard(index):
        return _record_on_current_stream()


def _record_on_current_stream() -> Any:
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream())  # the current device's: the guard's
    return event


def capturing(index: int | None) -> bool:
    """Whether the current stream of device ``index`` is capturing a CUDA graph."""
    if not cuda_initialized():  # no capture without CUDA; asking would initialise it
        return False
    with device_guard(index):
        return _current_stream_capturing()


def _current_stream_capturing() -> bool:
    return bool(torch.cuda.is_current_stream_capturing())


@contextmanager
def copies_complete() -> Iterator[None]:
    """Batches dropped in this block had every copy from them completed (a device stage
    drops a host batch only after its copy event): their slots need no release fence."""
    _local.complete = getattr(_local, "complete", 0) + 1
    try:
        yield
    finally:
        _local.complete -= 1


def in_copies_complete() -> bool:
    return bool(getattr(_local, "complete", 0))


_local = threading.local()




class Fences:
    """Events to pass before memory may be unregistered or reused (NOTE [ Registered memory
    lifetime ] rule (3) in ``_memory/pinning.py``).

    Entries are ``(event, payload)``; thread-safe (finalizers add from any thread). Held
    strongly by whoever must wait for them, so no collection order can lose them.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: list[tuple[Any, Any]] = []

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, event: Any, payload: Any = None) -> None:
        with self._lock:
            self._entries.append((event, payload))

    def done(self) -> list[Any]:
        """Drop the entries whose event has completed (non-blocking); their payloads."""
        with self._lock:
            entries = list(self._entries)
        finished = [e for e in entries if e[0].query()]
        if not finished:
            return []
        with self._lock:
            gone = {id(e) for e in finished}
            self._entries = [e for e in self._entries if id(e) not in gone]
        return [payload for _, payload in finished]

    def retain(self, events: list[Any]) -> None:
        """Keep only the entries whose event is one of ``events`` (known complete others)."""
        keep = {id(e) for e in events}
        with self._lock:
            self._entries = [e for e in self._entries if id(e[0]) in keep]

    def wait(self) -> list[Any]:
        """Block until every event has completed; drop them all; their payloads."""
        with self._lock:
            entries, self._entries = self._entries, []
        try:
            for event, _ in entries:
                event.synchronize()
        except BaseException:
            with self._lock:  # not waited for: keep them for the next wait
                self._entries[:0] = entries
            raise
        return [payload for _, payload in entries]
