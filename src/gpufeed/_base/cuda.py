"""CUDA calls outside the copies themselves: device guard, events, capture, fences.

Every call here asks ``torch.cuda`` directly for a loader's device; nothing else in gpufeed
does, apart from ``_memory/pinning.py`` (``cudart``, ``is_pinned``, ``pin_memory``) and the
device stage's backend (``_device/streams.py``). The simulated backend of the tests
(tests/support/sim_cuda.py) replaces exactly these functions, so the guards placed around
them are tested:

* ``device_guard(d)``: ``torch.cuda.device(d)`` (NOTE [ Registered memory lifetime ] rule 5:
  under torchrun, rank 3 creates no context on GPU 0);
* ``release_event(d, also)``: one event on the calling thread's current stream of every
  device that has a CUDA context (``d`` first), and on the streams ``also`` (where the batch
  was handed out): a release fence, NOTE [ Slot lifetime ] in ``_memory/ring.py``;
* ``current_streams(devices)``: the calling thread's current stream of each device;
* ``capturing(d)``: whether the current stream of ``d`` is capturing a CUDA graph;
* ``Fences``: events to pass before memory is reused or unregistered, held strongly, with no
  lock (a finalizer adds to them, inside any allocation);
* ``copies_complete()``: marks batches dropped after their copy completed (no fence needed).

Cost of a release fence, per device with a context: one ``current_stream`` read and one event
record (``torch.cuda.Event.record`` guards the stream's device itself, so no Python-side guard
runs); the devices are found with the driver's primary-context query, once per device until
it has a context.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "Events", "Fences", "capturing", "context_devices", "copies_complete", "copies_completed",
    "cuda_initialized", "current_device", "current_streams", "device_count", "device_guard",
    "drain_last_error", "error_name", "release_event",
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


def _has_context(index: int) -> bool:
    """Whether device ``index`` has a CUDA (primary) context in this process: asked of the
    driver, which creates none. False where torch does not expose the query."""
    probe = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    return bool(probe(index)) if probe is not None else False


_with_context: set[int] = set()  # devices seen with a context: a context is never torn down


def _forget_contexts() -> None:  # a forked child has none
    _with_context.clear()


os.register_at_fork(after_in_child=_forget_contexts)


def context_devices(first: int, *, probe: bool = True) -> list[int]:
    """``first`` (the ring's device), then every other device that has a CUDA context: the
    devices a copy from host memory can have been queued to (a copy needs a context on its
    device, and creates it before it is queued). Devices without one are asked each time
    (a context may appear between two calls), devices with one never again; ``probe=False``
    asks none (the devices known so far)."""
    count = device_count()
    if count <= 1:
        return [first]
    out = [first]
    for index in range(count):
        if index == first:
            continue
        if index in _with_context or (probe and _has_context(index)):
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
    """An event that completes once everything queued so far on the streams ``also`` and on
    the calling thread's current stream of every device with a context (``device`` first)
    has: a user's non_blocking copies from a batch, wherever they went (NOTE [ Slot
    lifetime ] (a)). One event per distinct stream. RuntimeError if a stream other than the
    first (the caller checked that one) is capturing a CUDA graph: an event recorded there
    would be part of the graph."""
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
    """Consume the error a failed runtime call left behind (best effort).

    A failed ``cudaHostRegister`` leaves a pending per-thread error; torch's next kernel
    launch check (``cudaGetLastError``) would then raise it against an unrelated op.
    torch's own binding exposes ``cudaGetLastError`` only in some versions, so fall back to
    every libcudart mapped into this process (wheels bundle it as ``libcudart-<hash>``).
    """
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
    """The batches whose leaves start at ``addresses``, dropped in this block, had every copy
    from them completed (a device stage drops a host batch only after its copy event): their
    slots need no release fence. Other batches released in the block (a collection that runs
    inside it) are fenced as usual."""
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
    for addresses in getattr(_local, "complete", ()):
        for p in addresses:
            if start <= p < end:
                return True
    return False


_local = threading.local()




class Events:
    """Several events as one: completed when every one of them has (a release fenced on
    several streams or devices)."""

    __slots__ = ("events",)

    def __init__(self, events: tuple[Any, ...]) -> None:
        self.events = events

    def query(self) -> bool:
        return all(e.query() for e in self.events)

    def synchronize(self) -> None:
        for e in self.events:
            e.synchronize()


def _completed(event: Any) -> bool:
    """Whether ``event`` has completed, without blocking (not queryable: not completed)."""
    try:
        return bool(event.query())
    except RuntimeError as e:
        logger.debug("release fence not queryable: %s", e)
        return False


def _synchronized(event: Any) -> bool:
    """Block until ``event`` has completed."""
    event.synchronize()
    return True


class Fences:
    """Events to pass before memory may be reused or unregistered (NOTE [ Registered memory
    lifetime ] rule (3) in ``_memory/pinning.py``), each with a payload (a slot id).

    Held strongly by whoever must wait for them, so no collection order can lose them.

    No locks: ``add`` runs in finalizers, on any thread, and inside any allocation of any code
    (a collection that finalizes a pinned batch caught in a reference cycle). A lock that
    code which allocates holds would deadlock the thread against itself there; so every entry
    lives in one dict under a key of its own, and each step is one atomic dict operation:
    ``add`` inserts; ``done``, ``retain`` and ``wait`` snapshot the keys (a C-level copy, no
    allocation per entry) and remove an entry with ``pop``, which exactly one caller wins,
    only once its event has completed (``retain``: once it is known complete). An entry is
    therefore visible to every ``wait`` until its event has completed, whichever thread, or
    nested collection, looks at it meanwhile, and no payload is returned twice.
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
        """Drop the entries whose event has completed (never blocks); their payloads, handed
        to ``sink.append`` as each entry is removed when given (an interruption between two
        entries then loses none), else returned. An event that cannot be asked (CUDA error)
        counts as not completed."""
        return self._drain(_completed, sink)

    def retain(self, events: list[Any]) -> None:
        """Keep only the entries whose event is one of ``events`` (the others are known to
        have completed). Only for a Fences that no finalizer adds to (a device stage's own
        copies): an entry added after the caller built ``events`` would be dropped."""
        keep = {id(e) for e in events}
        entries = self._entries
        for key in list(entries):
            entry = entries.get(key)
            if entry is not None and id(entry[0]) not in keep:
                entries.pop(key, None)

    def wait(self, sink: Any = None) -> list[Any]:
        """Block until every event added before the call has completed; drop those entries;
        their payloads (to ``sink.append`` as each is removed, when given). Interrupted, the
        entries not yet waited for stay."""
        return self._drain(_synchronized, sink)

    def _drain(self, settled: Callable[[Any], bool], sink: Any) -> list[Any]:
        """Remove the entries present now whose event ``settled`` says is complete (another
        caller may remove one meanwhile: skipped); each payload to ``sink.append`` as its
        entry goes, else returned."""
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
