"""CUDA calls outside the copies themselves: device guard, events, capture, fences.

Every call here asks ``torch.cuda`` directly for a loader's device; nothing else in gpufeed
does, apart from ``_memory/pinning.py`` and the device stage's backend
(``_device/streams.py``). The simulated backend of the tests (tests/support/sim_cuda.py)
replaces exactly the seams here, so the guards placed around them are tested. The cost of a
release fence: ``_memory/release.py``.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)


def cuda_initialized() -> bool:
    """Whether this process has initialised CUDA (False in a child forked after it did)."""
    return bool(torch.cuda.is_initialized())


def device_count() -> int:
    return int(torch.cuda.device_count())


def current_device() -> int:
    return int(torch.cuda.current_device())


def device_guard(index: int | None) -> AbstractContextManager[Any]:
    """``torch.cuda.device(index)``, nothing for None (NOTE [ Registered memory lifetime ]
    rule (5) in ``_memory/pinning.py``: under torchrun, rank 3 creates no context on GPU 0)."""
    return nullcontext() if index is None else torch.cuda.device(index)


def _has_context(index: int) -> bool:
    """Whether device ``index`` has a primary context here (the driver's query creates none);
    False where torch does not expose the query."""
    probe = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    return bool(probe(index)) if probe is not None else False


_with_context: set[int] = set()  # devices seen with a context


def _forget_contexts() -> None:  # a forked child has none
    _with_context.clear()


os.register_at_fork(after_in_child=_forget_contexts)


def context_devices(first: int, *, probe: bool = True) -> list[int]:
    """``first`` (the ring's device), then every other device with a CUDA context: those a
    copy from host memory can have been queued to (a copy creates its device's context
    before it is queued). A device without one is asked again each time, one with a context
    never again (contexts are never torn down); ``probe=False`` asks none."""
    count = device_count()
    if count <= 1:
        return [first]
    out = [first]
    for index in range(count):
        if index != first and (index in _with_context or (probe and _has_context(index))):
            _with_context.add(index)
            out.append(index)
    return out


def _current_stream_of(index: int) -> Any:
    return torch.cuda.current_stream(index)  # the calling thread's; creates no context


def current_streams(devices: Sequence[int]) -> list[Any]:
    """The calling thread's current stream of each of ``devices``."""
    return [_current_stream_of(d) for d in devices]


def _record_on(stream: Any) -> Any:
    event = torch.cuda.Event()
    event.record(stream)  # under a guard of the stream's own device (torch's CUDAEvent)
    return event


def _capturing_on(stream: Any) -> bool:
    with torch.cuda.stream(stream):
        return bool(torch.cuda.is_current_stream_capturing())


def release_event(device: int, also: Sequence[Any] = ()) -> Any:
    """A release fence (NOTE [ Slot lifetime ] (a) in ``_memory/ring.py``): an event that
    completes once everything queued so far has, on the streams ``also`` (where the batch was
    handed out) and on the calling thread's current stream of every device with a context,
    ``device`` first; one event per distinct stream. RuntimeError if a stream other than the
    first (the caller checked that one) is capturing a CUDA graph: the event would be part of
    the graph."""
    streams = current_streams(context_devices(device))  # distinct: one per device
    if also and list(also) != streams:  # handed out on other streams than the current ones
        streams = list(dict.fromkeys([*streams, *also]))
    if len(streams) == 1:
        return _record_on(streams[0])
    if any(_capturing_on(s) for s in streams[1:]):
        raise RuntimeError("a CUDA graph capture is in progress on a stream to fence")
    return Events(tuple(_record_on(s) for s in streams))


def error_name(cudart: Any, code: int) -> str:
    """The CUDA runtime's name for error ``code`` (``torch.cuda.cudart()``'s binding)."""
    try:
        return str(cudart.cudaGetErrorString(cudart.cudaError(code)))
    except Exception:
        return "unknown CUDA error"


def drain_last_error(cudart: Any) -> None:
    """Consume the error a failed runtime call left behind (best effort): torch's next kernel
    launch check would raise it against an unrelated op. torch's binding has
    ``cudaGetLastError`` only in some versions, so else every libcudart mapped into this
    process is asked (wheels bundle it as ``libcudart-<hash>``)."""
    getter = getattr(cudart, "cudaGetLastError", None)
    if getter is not None:
        getter()
        return
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(None, 5)[-1].strip() for line in maps if "libcudart" in line}
    except OSError:
        return
    for path in paths:
        path = path.removesuffix(" (deleted)")
        try:
            ctypes.CDLL(path).cudaGetLastError()
        except (OSError, AttributeError):
            logger.debug("could not clear the CUDA error through %s", path)


def capturing(index: int | None) -> bool:
    """Whether the current stream of device ``index`` is capturing a CUDA graph."""
    if not cuda_initialized():  # no capture without CUDA; asking would initialise it
        return False
    if index is None or index == current_device():  # no guard needed (the common case)
        return _current_stream_capturing()
    with device_guard(index):
        return _current_stream_capturing()


def _current_stream_capturing() -> bool:
    return bool(torch.cuda.is_current_stream_capturing())


@contextmanager
def copies_complete(addresses: Sequence[int]) -> Iterator[None]:
    """Batches whose leaves start at ``addresses``, dropped in this block, need no release
    fence: every copy from them completed (a device stage drops a host batch only after its
    copy event). Other batches released in the block are fenced as usual."""
    stack = getattr(_local, "complete", None)
    if stack is None:
        stack = _local.complete = []
    stack.append(addresses)
    try:
        yield
    finally:
        stack.pop()


def copies_completed(start: int, end: int) -> bool:
    """Whether a batch in ``[start, end)`` is being dropped under ``copies_complete``."""
    return any(start <= p < end for addresses in getattr(_local, "complete", ()) for p in addresses)


_local = threading.local()


@dataclass(frozen=True, slots=True)
class Events:
    """Several events as one (a release fenced on several streams or devices)."""

    events: tuple[Any, ...]

    def query(self) -> bool:
        return all(e.query() for e in self.events)

    def synchronize(self) -> None:
        for e in self.events:
            e.synchronize()


def _completed(event: Any) -> bool:
    """Whether ``event`` has completed, without blocking."""
    try:
        return bool(event.query())
    except RuntimeError as e:
        logger.debug("release fence not queryable: %s", e)
        return False


def _synchronized(event: Any) -> bool:
    event.synchronize()
    return True


class Fences:
    """Events to pass before memory may be reused or unregistered, each with a payload (a
    slot id), held strongly by whoever must wait for them (NOTE [ Registered memory lifetime ]
    rule (3) in ``_memory/pinning.py``).

    No locks: ``add`` runs in finalizers, on any thread, inside any allocation (a collection
    of a pinned batch caught in a reference cycle), where a lock held by the allocating code
    would deadlock the thread against itself. So each entry has a key of its own in one dict
    and each step is one atomic dict operation: ``add`` inserts; the others snapshot the keys
    and ``pop`` an entry, which exactly one caller wins, only once its event has completed.
    An entry is thus visible to every ``wait`` until then, and no payload is returned twice.
    """

    __slots__ = ("__weakref__", "_entries", "_keys")

    def __init__(self) -> None:
        self._entries: dict[int, tuple[Any, Any]] = {}
        self._keys = itertools.count()  # next() is atomic

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, event: Any, payload: Any = None) -> None:
        """Fence ``payload`` behind ``event`` (any thread, finalizers included)."""
        self._entries[next(self._keys)] = (event, payload)

    def done(self, sink: Any = None) -> list[Any]:
        """Drop the entries whose event has completed, never blocking (an event CUDA cannot
        query counts as pending); their payloads as ``_drain`` gives them."""
        return self._drain(_completed, sink)

    def retain(self, events: list[Any]) -> None:
        """Keep only the entries whose event is one of ``events`` (the others are known to
        have completed). Only for a Fences that no finalizer adds to (a device stage's own
        copies): an entry added after the caller built ``events`` would be dropped."""
        keep = {id(e) for e in events}
        self._drain(lambda event: id(event) not in keep, [])

    def wait(self, sink: Any = None) -> list[Any]:
        """Block until every event added before the call has completed and drop those
        entries (interrupted, the rest stay); their payloads as ``_drain`` gives them."""
        return self._drain(_synchronized, sink)

    def _drain(self, settled: Callable[[Any], bool], sink: Any) -> list[Any]:
        """Remove the entries present now that ``settled`` says are complete (one another
        caller removes meanwhile is skipped). Each payload goes to ``sink.append`` as its
        entry goes, so an interruption loses none; without a sink they are returned."""
        entries = self._entries
        finished: list[Any] = []
        put = finished.append if sink is None else sink.append
        for key in list(entries):
            entry = entries.get(key)
            if entry is None or not settled(entry[0]):
                continue
            gone = entries.pop(key, None)
            if gone is not None:
                put(gone[1])
        return finished

    def payloads(self) -> list[Any]:
        """The payloads of the entries now (a snapshot)."""
        return [entry[1] for entry in list(self._entries.values())]
