"""DeviceIterator: the device stage's prefetch engine (``gpufeed.to_device`` returns one).

It keeps batch i+1..i+depth in flight to the device while the training step works on batch
i. Streams, events and copies come from a backend (``_device/streams.py``); copies that cannot
overlap are detected in ``_device/pageable.py``.

NOTE [ Device stage: streams, events and slots ]
------------------------------------------------

    source ──► _issue(batch i)            on the side stream S          next() on consumer stream C
               copy each leaf, non_blocking ─► E_copy(i)                  M: an event on C (rule 8)
               transform (optional)         ─► E_ready(i)                 C.wait_event(E_ready(i))
                                                                          leaf.record_stream(C)
                                                                          return device batch i
    _host:  (E_copy, host batch, its leaves' addresses) FIFO ── dropped once E_copy.query()
            is True (rule 3)
    _ready: (E_ready, device batch) FIFO ── at most `depth` entries when next() returns (rule 4)
    _marks: M FIFO ── at most `depth` unfinished when a batch is issued (rule 8)

(1) Issue. Every copy, the transform and both events of batch i are enqueued on S, so
    the copy overlaps the work the user queued on C. Device tensors, the transform's
    outputs included, are allocated from S's pool of the caching allocator.
(2) Handover. C waits on E_ready: a wait on the GPU, the CPU does not block. Each device
    leaf gets ``record_stream(C)``, so when the user frees it the allocator does not hand
    its memory to a new tensor until C's queued work on it has finished.
(3) Slot release. The host batch may be a view into a pinned ring slot; the ring recycles
    the slot when the last reference to the batch goes. We keep the batch referenced
    until E_copy has completed (a non-blocking query() at every next()), then drop it.
    At most depth + 1 host batches are held: if one more would be needed, we wait for the
    oldest E_copy, a copy issued at least depth batches earlier (counted in host_waits).
(4) Depth. When next() returns batch i, batches i+1..i+depth have been issued. Device
    memory they hold is DeviceStats.bytes_held (and its peak).
(5) No synchronize(). The only host-side waits are on one event each: rule (3), rule (8)
    and close (6), and only when the GPU is behind.
(6) Close. Wait for every outstanding E_copy (a DMA must never read a recycled slot) and
    drop all references. An explicit close() also calls the source iterator's close(), if
    it has one; exhaustion and garbage collection do not (a loader with persistent workers
    reuses its iterator). In a forked child, collecting its copy of the iterator does nothing.
(7) Pageable memory. A non_blocking copy from pageable memory, or of a non-dense tensor, is
    staged through host memory and returns only once the host data is read: nothing
    overlaps. Such batches are counted (pageable_batches) and warned about once.
(8) Consumer lag. Memory the user frees returns to S's pool only once C has finished the
    work queued before the free (rule 2), so a CPU running many steps ahead of the GPU would
    need fresh device memory for every new batch. Each next() records M on C (all the user
    has queued so far); before a batch is issued, at most `depth` of them may be unfinished,
    else we wait for the oldest (consumer_waits). Device memory this stage uses is thus at
    most 2 * depth + 1 batches: depth issued ahead, the one in use, and depth that C has not
    finished with (plus any the user keeps). A plain ``for`` loop keeps one: its variable
    holds batch i-1 while next() issues i+depth, and its free is queued on C after the
    marks recorded so far, so such a loop may use 2 * depth + 2
    (tests/device/test_prefetch_sim.py measures both).
(9) Device-resident leaves (a source that yields tensors already on the device) are not
    copied: S waits for C before the transform may read them (they may be produced there),
    and they get ``record_stream(S)``, so freeing them cannot recycle memory S still reads.
(10) Unregistering. Every E_copy also goes into the iterator's ``_cuda.Fences``, tracked
    (held strongly) by ``_pinning`` from the first next() to close: unregistering pinned
    memory (a ring slot retired, a ring closed first after a worker error, or collected
    before this iterator in a garbage cycle) waits for the copies in flight here before
    ``cudaHostUnregister``; a close whose wait is interrupted (Ctrl-C) leaves them tracked.
    Host batches are dropped under ``_cuda.copies_complete(addresses of their leaves)``:
    their copy has completed, so the ring needs no release fence for their slots (NOTE [ Slot
    lifetime ] (b)) and recycles them at once; another loader's batch dropped meanwhile (by a
    collection) is fenced as usual.
(11) Device and capture. Every backend call runs under ``backend.guard()`` (the target
    device made current: no context on another GPU). next() during CUDA graph capture
    raises: its copies, events and waits would be recorded into the graph.
(12) Current stream. The consumer stream C is the current stream of the target device at
    each next(), read afresh each time: batch i is ordered before the work queued on the
    stream current when batch i was handed over, and protected (record_stream) against
    reuse until that stream's work is done. Using a batch on another stream is the user's
    to order (``s.wait_stream(C)``, ``t.record_stream(s)``), as with any CUDA tensor; the
    marks of rule (8) are then taken on whichever stream was current at each next().
(13) Errors. An error of the source (a worker's), of a copy or of the transform takes its
    batch's place: raised after the batches before it, nothing pulled past it until then (so
    rule (4) issues fewer), and the next next() goes on with the batches after it, as the
    stock loader goes on after a worker's error. A failed copy's or transform's host batch
    is dropped once its E_copy was waited for (rule 6's guarantee, for one batch).
"""

from __future__ import annotations

import enum
import logging
import os
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from .._base import cuda as _cuda
from .._base import timeline as _timeline
from .._base.stats import DeviceStats
from .._base.tree import tree_leaves
from .._memory import pinning as _pinning
from .held import drop_copied, map_tensors, pop_completed, tensor_bytes
from .pageable import staged_reason, warn_staged
from .streams import Event, SyncBackend, backend_for, parse_device
from .timing import DeviceTrace

__all__ = ["DeviceIterator", "map_tensors"]

logger = logging.getLogger(__name__)


class _State(enum.Enum):
    UNSTARTED = "unstarted"
    RUNNING = "running"
    EXHAUSTED = "exhausted"
    CLOSED = "closed"


class DeviceIterator(Iterator[Any]):
    """Iterator returned by :func:`to_device`; the protocol is NOTE [ Device stage: streams,
    events and slots ].

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
        self._backend = backend if backend is not None else backend_for(self.device)
        self._trace = DeviceTrace(self._backend, recorder)  # NOTE [ Timeline ]
        self._pid = os.getpid()
        self._state = _State.UNSTARTED
        self._side: Any = None
        self._host: deque[tuple[Event, Any, tuple[int, ...]]] = deque()
        self._ready: deque[tuple[Event | None, Any, int]] = deque()
        self._marks: deque[Event] = deque()
        self._copies = _cuda.Fences()  # rule (10)
        self._source_done = False
        self._error_queued = False  # an error of the source waits in _ready, in order
        self._taken = 0  # batches taken from the source (counted by _issue)
        self.error_took_a_batch = False  # the last error raised was a taken batch's: see _next
        self.error_from_source = False  # ... or the source's (a batch whose fetch failed)
        self._warned = False
        self._batches = self._bytes_copied = self._bytes_held = self._peak = 0
        self._host_waits = self._pageable = self._consumer_waits = 0
        self._host_wait_s = self._consumer_wait_s = 0.0

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
            if self._pid == os.getpid() and self._state not in (_State.CLOSED, _State.EXHAUSTED):
                with self._backend.guard():
                    self._release(_State.CLOSED, close_source=False)
        except Exception:
            pass

    def __next__(self) -> Any:
        self.error_took_a_batch = self.error_from_source = False  # set by the error it raises
        if self._state is _State.CLOSED:
            raise RuntimeError("this to_device iterator is closed; call to_device(...) again")
        if self._state is _State.EXHAUSTED:
            raise StopIteration
        with self._backend.guard():  # rule (11)
            if self._backend.capturing():
                raise RuntimeError(
                    f"next() on a to_device iterator was called while the current stream of "
                    f"{self.device} is capturing a CUDA graph; fetch the batch before "
                    "torch.cuda.graph(...) and copy it into the graph's static inputs "
                    "(static_x.copy_(batch)), never iterate the loader during capture"
                )
            if _timeline.profiling():  # NOTE [ Timeline ] (1)
                with _timeline.torch_range("gpufeed: next batch on device"):
                    return self._next()
            return self._next()

    def _next(self) -> Any:
        backend = self._backend
        if self._state is _State.UNSTARTED:
            self._side = backend.new_stream()
            self._state = _State.RUNNING
            _pinning.track_copies(self._copies)  # rule (10)
        elif self._batches:  # rule (8): what the user queued on the batches so far
            self._marks.append(backend.record_event(backend.current_stream()))
        self._fill()
        if not self._ready:
            self._release(_State.EXHAUSTED)
            raise StopIteration
        event, batch, nbytes = self._ready.popleft()
        if event is None:  # the source's error, after the batches before it; as with the
            self._error_queued = False  # stock loader, the next next() goes on after it
            # its copy or transform failed (not the source): never delivered (Delivered, in
            self.error_took_a_batch = bool(nbytes)  # _order/delivery.py, counts it so)
            self.error_from_source = not nbytes
            try:  # the traceback holds this frame: no local may keep the error (a cycle that
                raise batch  # kept the iterator, its workers and ring until a collection)
            finally:
                batch = None
        consumer = backend.current_stream()  # rule (2)
        backend.wait_event(consumer, event)
        map_tensors(lambda t: backend.record_stream(t, consumer), batch)
        self._bytes_held -= nbytes
        self._batches += 1
        self._fill()  # rule (4): i+1..i+depth issued before batch i is returned
        drop_copied(pop_completed(self._host))  # rule (3)
        self._copies.retain([entry[0] for entry in self._host])  # the others have completed
        self._trace.flush(_timeline.active)  # GPU spans of copies that completed
        return batch

    def stats(self) -> DeviceStats:
        """A snapshot of this iterator's counters (see :class:`DeviceStats`)."""
        return DeviceStats(
            batches=self._batches, bytes_copied=self._bytes_copied, in_flight=len(self._ready),
            bytes_held=self._bytes_held, peak_bytes_held=self._peak,
            host_batches_held=len(self._host), host_waits=self._host_waits,
            host_wait_s=self._host_wait_s, pageable_batches=self._pageable,
            consumer_waits=self._consumer_waits, consumer_wait_s=self._consumer_wait_s)

    def close(self) -> None:
        """Wait for outstanding copies, release all batches, close the source (rule 6).

        Idempotent; after exhaustion it does nothing (the source is left as it is).
        """
        if self._state not in (_State.CLOSED, _State.EXHAUSTED):
            with self._backend.guard():
                self._release(_State.CLOSED)

    def _release(self, state: _State, *, close_source: bool = True) -> None:
        self._state = state
        source, self._source = self._source, iter(())
        waited = False
        try:
            while self._host:  # rule (6): no DMA may still read a slot we give back
                self._host[0][0].synchronize()
                drop_copied([self._host.popleft()])
            self._trace.flush(_timeline.active, wait=True)
            waited = True
        finally:
            rest = list(self._host)  # a failed wait: released unfenced, as before
            self._host.clear()
            drop_copied(rest)
            self._ready.clear()
            self._marks.clear()
            self._bytes_held = 0
            if waited:  # else the copies stay tracked: nothing is unregistered under them
                _pinning.untrack_copies(self._copies)
            self._copies = _cuda.Fences()
            logger.debug("to_device %s: %s", state.value, self.stats())
            close = getattr(source, "close", None)
            if state is _State.CLOSED and close_source and callable(close):
                close()  # rule (6)

    def _fill(self) -> None:
        while not self._source_done and not self._error_queued and len(self._ready) < self.depth:
            issued, taken = len(self._host), self._taken  # (_make_room may drop some)
            try:
                waited = self._make_room()  # before next(): the source may need a free slot
                issued = len(self._host)
                self._issue(next(self._source), waited)
            except StopIteration:
                self._source_done = True
            except Exception as exc:  # delivered in order, after the batches before it: the
                # loop goes on if it catches it, as with the stock loader's worker errors. Its
                # traceback's frames would keep the host batch (a ring slot) alive.
                traceback.clear_frames(exc.__traceback__)
                if len(self._host) > issued:  # the copy or transform failed: its host batch
                    self._host[-1][0].synchronize()  # goes once what was queued of it is
                    drop_copied([self._host.pop()])  # done (rule 6); no local keeps it (this
                    # frame is in the traceback)
                self._ready.append((None, exc, self._taken - taken))  # > 0: a taken batch's
                self._error_queued = True

    def _make_room(self) -> float:
        """Rules (3) and (8) before a batch is issued; returns the seconds spent waiting on
        copies (consumer waits are counted apart: they are not the input's fault)."""
        drop_copied(pop_completed(self._host))
        pop_completed(self._marks)
        waited = 0.0
        if len(self._host) > self.depth:
            start = time.perf_counter()
            while len(self._host) > self.depth:
                self._host[0][0].synchronize()
                drop_copied([self._host.popleft()])
                self._host_waits += 1
            waited = time.perf_counter() - start
            self._host_wait_s += waited
            self._trace.waited(start, waited)
        if len(self._marks) > self.depth:
            start, n = time.perf_counter(), 0
            while len(self._marks) > self.depth:
                self._marks.popleft().synchronize()
                n += 1
            self._consumer_waits += n
            self._consumer_wait_s += time.perf_counter() - start
            if self._recorder is not None:
                self._recorder.count("consumer_waits", n)
        return waited

    def _issue(self, host: Any, waited: float) -> None:
        start, self._taken = time.perf_counter(), self._taken + 1
        backend, side = self._backend, self._side
        tl, marks = self._trace.begin(side)  # (None, None) unless a trace records
        sent = 0
        addresses: list[int] = []
        staged: tuple[torch.Tensor, str] | None = None
        resident = {id(t): t for t in tree_leaves(host)
                    if isinstance(t, torch.Tensor) and backend.on_device(t)}
        if resident:  # rule (9)
            backend.wait_event(side, backend.record_event(backend.current_stream()))
            for t in resident.values():
                backend.record_stream(t, side)

        def copy(t: torch.Tensor) -> torch.Tensor:
            nonlocal sent, staged
            if id(t) in resident:
                return t  # what .to(device) would return: the tensor itself
            sent += t.numel() * t.element_size()
            addresses.append(t.data_ptr())
            if backend.needs_pinned and t.device.type == "cpu" and staged is None:
                reason = staged_reason(t, backend.is_pinned(t))
                if reason is not None:
                    staged = (t, reason)
            return backend.copy(t)

        with backend.use_stream(side):  # rule (1)
            try:
                batch = map_tensors(copy, host)
            finally:  # even after a failed copy: the leaves before it may be in flight
                copied = backend.record_event(side)
                self._host.append((copied, host, tuple(addresses)))
                self._copies.add(copied)
            copied_at = self._trace.mark(marks, side)
            self._bytes_copied += sent
            ready = copied
            if self._transform is not None:
                batch = self._transform(batch)
                ready = backend.record_event(side)
                self._trace.mark(marks, side)
        nbytes = tensor_bytes(batch)
        self._ready.append((ready, batch, nbytes))
        self._bytes_held += nbytes
        self._peak = max(self._peak, self._bytes_held)
        if staged is not None:
            self._on_staged(*staged)
        end = time.perf_counter()
        if self._recorder is not None:
            self._recorder.add("transfer", busy_s=end - start, blocked_s=waited)
            self._recorder.occupancy("transfer", len(self._ready), self.depth)
        if tl is not None:  # the times of "transfer" (NOTE [ Timeline ] (3))
            self._trace.issued(tl, self._batches + len(self._ready) - 1, start, copied_at, end,
                               sent, self._transform is not None, marks)

    def _on_staged(self, t: torch.Tensor, reason: str) -> None:  # rule (7)
        self._pageable += 1
        if self._recorder is not None:
            self._recorder.count("pageable_batches")
        if not self._warned:
            self._warned = True
            # user frame <- __next__ <- _next <- _fill <- _issue <- _on_staged <- warn_staged
            warn_staged(t, reason, self.device, stacklevel=6)
