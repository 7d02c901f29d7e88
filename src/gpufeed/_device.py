"""Device stage: host-to-device prefetch on a side CUDA stream, for any iterable of batches.

``to_device(iterable, device, depth=2, transform=None)`` copies batch i+1..i+depth to the
device while the training step works on batch i. It is what ``gpufeed.DataLoader(device=...)``
returns, and it works just as well over a stock ``torch.utils.data.DataLoader``.

NOTE [ Device stage: streams, events and slots ]
------------------------------------------------

    source ──► _issue(batch i)            on the side stream S          next() on consumer stream C
               copy each leaf, non_blocking ─► E_copy(i)                  C.wait_event(E_ready(i))
               transform (optional)         ─► E_ready(i)                 leaf.record_stream(C)
                                                                          return device batch i
    _host:  (E_copy, host batch) FIFO ── dropped once E_copy.query() is True (rule 3)
    _ready: (E_ready, device batch) FIFO ── at most `depth` entries when next() returns (rule 4)

(1) Issue. Every copy, the transform and both events of batch i are enqueued on S, so
    the copy overlaps the work the user queued on C. Device tensors are allocated from S's
    pool of the caching allocator.
(2) Handover. C waits on E_ready: a wait on the GPU, the CPU does not block. Each device
    leaf gets ``record_stream(C)``, so when the user frees it the allocator does not hand
    its memory to a new tensor until C's queued work on it has finished.
(3) Slot release. The host batch may be a view into a pinned ring slot; the ring recycles
    the slot when the last reference to the batch goes. We keep the batch referenced
    until E_copy has completed (a non-blocking query() at every next()), then drop it.
    At most depth + 1 host batches are held: if one more would be needed, we wait for the
    oldest E_copy, a copy issued at least depth batches earlier (counted in host_waits).
(4) Depth. When next() returns batch i, batches i+1..i+depth have been issued. Device
    memory held by this stage is those batches (DeviceStats.bytes_held, and its peak).
(5) No synchronize(). The only host-side waits are rule (3) and close().
(6) Close. Wait for every outstanding E_copy (a DMA must never read a recycled slot) and
    drop all references. An explicit close() also calls the source iterator's close(), if
    it has one; exhaustion and garbage collection do not (a loader with persistent workers
    reuses its iterator).
(7) Pageable memory. A non_blocking copy from pageable (non-pinned) memory is staged by
    the driver and does not return before the host data is read: nothing overlaps. Such
    batches are counted (pageable_batches) and warned about once per iterator.

Backends: streams, events and copies come from a small backend object: ``CudaBackend`` for
CUDA, ``SyncBackend`` (blocking; for "cpu" a pass-through) for any other device. Tests
inject a fake backend whose events they complete by hand.
"""

from __future__ import annotations

import enum
import logging
import time
import traceback
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ._pinning import cuda_usable
from ._tree import tree_leaves, tree_map

__all__ = [
    "CudaBackend",
    "DeviceIterator",
    "DeviceStats",
    "PageableCopyWarning",
    "SyncBackend",
    "to_device",
]

logger = logging.getLogger(__name__)


class PageableCopyWarning(UserWarning):
    """A batch was copied to the GPU from pageable memory, so the copy could not overlap."""


class Event(Protocol):
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class _Done:
    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


_DONE = _Done()


class SyncBackend:
    """The backend interface (see NOTE [ Device stage ]), implemented synchronously.

    ``.to(device)`` blocks, events are complete at once, there are no streams; for "cpu"
    ``.to`` returns the tensor itself, so the stage is a pass-through. Other backends
    (``CudaBackend``, test fakes) override every method.
    """

    needs_pinned = False  # True when copies overlap only from pinned host memory

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def new_stream(self) -> Any:  # the side stream, made once per iterator
        return None

    def current_stream(self) -> Any:  # the consumer's stream, asked at each handover
        return None

    def use_stream(self, stream: Any) -> AbstractContextManager[Any]:
        return nullcontext()

    def record_event(self, stream: Any) -> Event:
        return _DONE

    def wait_event(self, stream: Any, event: Event) -> None:
        return None

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device)

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        return None

    def is_pinned(self, t: torch.Tensor) -> bool:
        return False


class CudaBackend(SyncBackend):
    """``torch.cuda`` streams and events, ``non_blocking`` copies."""

    needs_pinned = True

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=self.device)

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def use_stream(self, stream: Any) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def record_event(self, stream: Any) -> Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True)

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        if t.device.type == "cuda":
            t.record_stream(stream)

    def is_pinned(self, t: torch.Tensor) -> bool:
        return bool(t.is_pinned())


@dataclass(frozen=True)
class DeviceStats:
    """Counters of one ``to_device`` iterator (bytes are bytes, times are seconds).

    batches: batches handed to the consumer.
    bytes_copied: host bytes sent to the device (sum of tensor leaf sizes).
    in_flight: batches issued but not yet handed over (at most ``depth``).
    bytes_held: device bytes of those batches, after the transform.
    peak_bytes_held: largest ``bytes_held`` seen (while issuing, before a handover).
    host_batches_held: host batches kept alive until their copy completes (<= depth + 1).
    host_waits / host_wait_s: times, and seconds in total, next() blocked on a copy event
        to release a host batch (rule 3); non-zero means copies are slower than steps.
    pageable_batches: batches with a leaf in pageable memory (their copies did not overlap).
    """

    batches: int
    bytes_copied: int
    in_flight: int
    bytes_held: int
    peak_bytes_held: int
    host_batches_held: int
    host_waits: int
    host_wait_s: float
    pageable_batches: int


class _State(enum.Enum):
    UNSTARTED = "unstarted"
    RUNNING = "running"
    EXHAUSTED = "exhausted"
    CLOSED = "closed"


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    """``batch`` with ``fn`` applied to each tensor leaf; other leaves pass through."""
    return tree_map(lambda x: fn(x) if isinstance(x, torch.Tensor) else x, batch)


def _nbytes(batch: Any) -> int:
    leaves = tree_leaves(batch)
    return sum(x.numel() * x.element_size() for x in leaves if isinstance(x, torch.Tensor))


def parse_device(device: Any, *, injected: bool = False) -> torch.device:
    """``device`` as a ``torch.device`` (CUDA: with its index), or a ValueError/TypeError/
    RuntimeError that names the value and the fix. ``injected``: a custom backend is given,
    so CUDA need not be available."""
    if isinstance(device, bool) or not isinstance(device, str | int | torch.device):
        raise TypeError(
            f"device must be a str, int or torch.device, got {type(device).__name__} "
            f"({device!r}); use e.g. device='cuda' or device='cpu'"
        )
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(
            f"device={device!r} is not a valid torch device; use e.g. 'cuda', 'cuda:0' or 'cpu'"
        ) from None
    if dev.type != "cuda" or injected:
        return dev
    if not cuda_usable():
        raise RuntimeError(
            f"device={device!r} but CUDA is not available (torch {torch.__version__}); install a "
            "CUDA build of torch and check the driver, or use device='cpu'"
        )
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if not 0 <= index < count:
        raise ValueError(f"device={device!r} but only {count} CUDA device(s) are visible")
    return torch.device("cuda", index)


class DeviceIterator(Iterator[Any]):
    """Iterator returned by :func:`to_device`; see NOTE [ Device stage ] for the protocol.

    Single pass, not thread-safe. ``close()`` (also on ``with`` exit, exhaustion or garbage
    collection) waits for outstanding copies and releases every batch it holds (rule 6).
    """

    def __init__(
        self,
        iterable: Iterable[Any],
        device: str | int | torch.device,
        *,
        depth: int = 2,
        transform: Callable[[Any], Any] | None = None,
        recorder: Any | None = None,
        backend: SyncBackend | None = None,
    ) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int):
            raise TypeError(f"depth must be an int, got {type(depth).__name__} ({depth!r})")
        if depth < 1:
            raise ValueError(f"depth={depth} but it must be >= 1 (2 overlaps a copy with a step)")
        if transform is not None and not callable(transform):
            raise TypeError(
                f"transform must be callable (batch -> batch) or None, got "
                f"{type(transform).__name__}; e.g. transform=gpufeed.Normalize(mean, std)"
            )
        self.device = parse_device(device, injected=backend is not None)
        try:
            self._source: Iterator[Any] = iter(iterable)
        except TypeError:
            raise TypeError(
                f"to_device() needs an iterable of batches, got {type(iterable).__name__}"
            ) from None
        self.depth = depth
        self._iterable = iterable
        self._transform = transform
        self._recorder = recorder
        if backend is None:
            cuda = self.device.type == "cuda"
            backend = CudaBackend(self.device) if cuda else SyncBackend(self.device)
        self._backend = backend
        self._state = _State.UNSTARTED
        self._side: Any = None
        self._host: deque[tuple[Event, Any]] = deque()
        self._ready: deque[tuple[Event, Any, int]] = deque()
        self._source_done = False
        self._error: BaseException | None = None
        self._warned = False
        self._batches = self._bytes_copied = self._bytes_held = self._peak = 0
        self._host_waits = self._pageable = 0
        self._host_wait_s = 0.0

    def __iter__(self) -> DeviceIterator:
        return self

    def __len__(self) -> int:
        try:
            return len(self._iterable)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(
                f"len() is unknown: the source ({type(self._iterable).__name__}) has no len()"
            ) from None

    def __enter__(self) -> DeviceIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # wait for copies, drop batches; the source is not ours to close
        try:
            if self._state not in (_State.CLOSED, _State.EXHAUSTED):
                self._release(_State.CLOSED, close_source=False)
        except Exception:
            pass

    def __next__(self) -> Any:
        if self._state is _State.CLOSED:
            raise RuntimeError("this to_device iterator is closed; call to_device(...) again")
        if self._state is _State.EXHAUSTED:
            raise StopIteration
        if self._state is _State.UNSTARTED:
            self._side = self._backend.new_stream()
            self._state = _State.RUNNING
        self._fill()
        if not self._ready:
            error, self._error = self._error, None
            self._release(_State.EXHAUSTED)
            if error is not None:
                raise error
            raise StopIteration
        event, batch, nbytes = self._ready.popleft()
        consumer = self._backend.current_stream()  # rule (2)
        self._backend.wait_event(consumer, event)
        map_tensors(lambda t: self._backend.record_stream(t, consumer), batch)
        self._bytes_held -= nbytes
        self._batches += 1
        self._fill()  # rule (4): i+1..i+depth issued before batch i is returned
        self._reap()
        return batch

    def stats(self) -> DeviceStats:
        """A snapshot of this iterator's counters (see :class:`DeviceStats`)."""
        return DeviceStats(
            batches=self._batches,
            bytes_copied=self._bytes_copied,
            in_flight=len(self._ready),
            bytes_held=self._bytes_held,
            peak_bytes_held=self._peak,
            host_batches_held=len(self._host),
            host_waits=self._host_waits,
            host_wait_s=self._host_wait_s,
            pageable_batches=self._pageable,
        )

    def close(self) -> None:
        """Wait for outstanding copies, release all batches, close the source (rule 6).

        Idempotent; after exhaustion it does nothing (the source is left as it is).
        """
        if self._state not in (_State.CLOSED, _State.EXHAUSTED):
            self._release(_State.CLOSED)

    def _release(self, state: _State, *, close_source: bool = True) -> None:
        self._state = state
        source, self._source = self._source, iter(())
        try:
            while self._host:  # rule (6): no DMA may still read a slot we give back
                self._host[0][0].synchronize()
                self._host.popleft()
        finally:
            self._host.clear()
            self._ready.clear()
            self._bytes_held = 0
            logger.debug("to_device %s: %s", state.value, self.stats())
            close = getattr(source, "close", None)
            if state is _State.CLOSED and close_source and callable(close):
                close()  # rule (6)

    def _fill(self) -> None:
        while not self._source_done and len(self._ready) < self.depth:
            try:
                waited = self._make_room()  # before next(): the source may need a free slot
                self._issue(next(self._source), waited)
            except StopIteration:
                self._source_done = True
            except Exception as exc:  # delivered in order, after the batches before it
                # Its traceback's frames would keep the host batch (a ring slot) alive.
                traceback.clear_frames(exc.__traceback__)
                self._error = exc
                self._source_done = True

    def _reap(self) -> None:  # rule (3)
        while self._host and self._host[0][0].query():
            self._host.popleft()

    def _make_room(self) -> float:
        """Rule (3): hold at most depth + 1 host batches; returns the seconds spent waiting."""
        self._reap()
        if len(self._host) <= self.depth:
            return 0.0
        start = time.perf_counter()
        while len(self._host) > self.depth:
            self._host[0][0].synchronize()
            self._host.popleft()
            self._host_waits += 1
        waited = time.perf_counter() - start
        self._host_wait_s += waited
        return waited

    def _issue(self, host: Any, waited: float) -> None:
        start = time.perf_counter()
        backend = self._backend
        sent = 0
        pageable: torch.Tensor | None = None

        def copy(t: torch.Tensor) -> torch.Tensor:
            nonlocal sent, pageable
            sent += t.numel() * t.element_size()
            if backend.needs_pinned and t.device.type == "cpu" and not backend.is_pinned(t):
                pageable = t
            return backend.copy(t)

        with backend.use_stream(self._side):  # rule (1)
            try:
                batch = map_tensors(copy, host)
            finally:  # even after a failed copy: the leaves before it may be in flight
                copied = backend.record_event(self._side)
                self._host.append((copied, host))
            self._bytes_copied += sent
            ready = copied
            if self._transform is not None:
                batch = self._transform(batch)
                ready = backend.record_event(self._side)
        nbytes = _nbytes(batch)
        self._ready.append((ready, batch, nbytes))
        self._bytes_held += nbytes
        self._peak = max(self._peak, self._bytes_held)
        if pageable is not None:
            self._on_pageable(pageable)
        if self._recorder is not None:
            self._recorder.add("transfer", busy_s=time.perf_counter() - start, blocked_s=waited)
            self._recorder.occupancy("transfer", len(self._ready), self.depth)

    def _on_pageable(self, t: torch.Tensor) -> None:  # rule (7)
        self._pageable += 1
        if self._recorder is not None:
            self._recorder.count("pageable_batches")
        if self._warned:
            return
        self._warned = True
        warnings.warn(
            f"to_device: a batch has a tensor (shape {tuple(t.shape)}, {t.dtype}) in pageable "
            f"(non-pinned) host memory, so its non_blocking copy to {self.device} is synchronous "
            "and does not overlap with compute. Fix: pass pin_memory=True to the DataLoader, use "
            "gpufeed.DataLoader(..., pin_memory=True, device=...) whose ring is page-locked, or "
            "call .pin_memory() on the batch. (Counted in stats().pageable_batches.)",
            PageableCopyWarning,
            stacklevel=5,
        )


def to_device(
    iterable: Iterable[Any],
    device: str | int | torch.device,
    *,
    depth: int = 2,
    transform: Callable[[Any], Any] | None = None,
    recorder: Any | None = None,
    backend: SyncBackend | None = None,
) -> DeviceIterator:
    """Iterate over ``iterable``'s batches moved to ``device``, prefetched ``depth`` ahead.

    Batches may be tensors or nests of tuples, lists, dicts, namedtuples and dataclasses;
    non-tensor leaves pass through. For a CUDA device the copies run on a side stream and
    overlap the training step; for "cpu" this is a pass-through (plus ``transform``).

    Args:
        iterable: any iterable of batches, e.g. a ``torch.utils.data.DataLoader``. For
            overlapping copies its tensors must be in pinned memory (``pin_memory=True``).
        device: target, e.g. "cuda", "cuda:1", "cpu" or a ``torch.device``.
        depth: batches copied ahead of the one being used (>= 1). Each costs one batch of
            device memory (after ``transform``) and one held host batch; 2 hides a copy
            as long as a step; raise it only for bursty sources.
        transform: callable ``batch -> batch`` run on the device, on the side stream, right
            after the copy (e.g. ``gpufeed.Normalize``): ship uint8, compute in float there.
        recorder: optional stats recorder (``add``/``occupancy``/``count``), fed the
            "transfer" stage and the "pageable_batches" counter.
        backend: streams/events/copies provider; the default suits the device. For tests
            and other accelerators.

    Returns:
        A :class:`DeviceIterator`: ``close()``, context manager, ``len()`` when the source
        has one, ``stats()`` with device bytes held now and at peak.
    """
    return DeviceIterator(
        iterable, device, depth=depth, transform=transform, recorder=recorder, backend=backend
    )
