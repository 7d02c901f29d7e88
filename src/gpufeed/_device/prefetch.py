"""DeviceIterator: the device stage's prefetch engine (``gpufeed.to_device`` returns one).

It keeps batches i+1..i+depth in flight while the step works on batch i, through a backend
(``_device/streams.py``); copies that cannot overlap are detected in ``_device/pageable.py``.

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

(1) Issue. Every copy, the transform and both events of batch i are enqueued on S, so the
    copy overlaps the work the user queued on C. Device tensors, the transform's outputs
    included, come from S's pool of the caching allocator.
(2) Handover. C waits on E_ready on the GPU; the CPU does not block. Each device leaf gets
    ``record_stream(C)``, so memory the user frees is not handed to a new tensor until C's
    queued work on it has finished.
(3) Slot release. The host batch may be a view into a pinned ring slot, recycled when the last
    reference to the batch goes: it is kept until E_copy has completed (a non-blocking query()
    at every next()), at most depth + 1 of them: one more waits for the oldest E_copy, issued
    at least depth batches earlier (host_waits).
(4) Depth. When next() returns batch i, batches i+1..i+depth have been issued; the device
    memory they hold is DeviceStats.bytes_held (and its peak).
(5) No synchronize(). The only host-side waits are on one event each, rules (3), (8) and (6),
    and only when the GPU is behind.
(6) Close. Wait for every outstanding E_copy (a DMA must never read a recycled slot) and drop
    all references. An explicit close() also closes the source iterator, if it can; exhaustion
    and garbage collection do not (a loader with persistent workers reuses its iterator). In a
    forked child, collecting its copy of the iterator does nothing.
(7) Pageable memory. A non_blocking copy from pageable memory, or of a non-dense tensor, is
    staged through host memory and returns once the host data is read: nothing overlaps. Such
    batches are counted (pageable_batches) and warned about once.
(8) Consumer lag. Memory the user frees returns to S's pool only once C has finished the work
    queued before the free (rule 2), so a CPU running many steps ahead of the GPU would need
    fresh device memory for every batch. Each next() records M on C; before a batch is issued,
    at most `depth` of them may be unfinished, else we wait for the oldest (consumer_waits).
    The stage thus uses at most 2 * depth + 1 batches of device memory (depth ahead, the one
    in use, depth that C has not finished with; plus any the user keeps), and a ``for`` loop
    2 * depth + 2: its variable holds batch i-1 while next() issues i+depth, and its free is
    queued on C after the marks so far (tests/device/test_prefetch_sim.py measures both).
(9) Device-resident leaves (a source that yields tensors already on the device) are not
    copied: S waits for C before the transform may read them (they may be produced there),
    and they get ``record_stream(S)``, so freeing them cannot recycle memory S still reads.
(10) Unregistering. Every E_copy also goes into the iterator's ``_cuda.Fences``, which
    ``_pinning`` tracks (holds strongly) from the first next() to close: unregistering pinned
    memory (a slot retired, a ring closed first after a worker error or collected first in a
    garbage cycle) waits for these copies; a close whose wait is interrupted (Ctrl-C) leaves
    them tracked. Host batches are dropped under ``_cuda.copies_complete(addresses of their
    leaves)``: their copy has completed, so the ring recycles their slots at once, with no
    release fence (NOTE [ Slot lifetime ] (b)); another loader's batch dropped meanwhile is
    fenced as usual.
(11) Device and capture. Every backend call runs under ``backend.guard()`` (the target device
    current: no context on another GPU). next() during CUDA graph capture raises: its copies,
    events and waits would be recorded into the graph.
(12) Current stream. C is the target device's current stream, read afresh at each next():
    batch i is ordered before, and protected (record_stream) until, the work queued on the
    stream current when it was handed over. Using a batch on another stream is the user's to
    order (``s.wait_stream(C)``, ``t.record_stream(s)``), as with any CUDA tensor; rule (8)'s
    marks are taken on whichever stream was current at each next().
(13) Errors. An error of the source (a worker's), of a copy or of the transform takes its
    batch's place: raised after the batches before it, nothing pulled past it until then (so
    rule (4) issues fewer), and the next next() goes on after it, as the stock loader does
    after a worker's error. A failed copy's or transform's host batch is dropped once its
    E_copy was waited for (rule 6, for one batch).
(14) GPU decode (``_device/decode.py``). A batch whose images the workers left encoded is
    placed by the decode step instead of copied: (a) the decode, crops and resizes are queued
    on S into a batch from S's pool, before E_copy and E_ready, so C reads them after waiting
    on E_ready (rule 2); (b) the decoder reads the encoded bytes from the host batch when its
    queued work runs, so E_copy is recorded after the decode is queued, and the host batch,
    with the host images it uploads, is held until E_copy has completed (rule 3); (c) S is
    idle before the decode: an event recorded on S after the batch is allocated is waited for
    on the host (idle_waits), because nvJPEG's batched hardware decode writes its outputs
    before the work already queued on its stream has run: memory that queued work still
    reads (freed on S, reused at once by the caching allocator) would be overwritten. Each
    part has a test that breaks it (tests/device/test_decode_sim.py).
    Measurements: docs/how-it-works/measurements/device.md#gpu-decode-on-an-idle-stream.
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
from .._base.tree import tree_leaves, tree_map
from .._memory import pinning as _pinning
from .pageable import staged_reason, warn_staged
from .streams import Event, SyncBackend, backend_for, parse_device
from .timing import DeviceTrace

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
        decode: Any | None = None,
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
        self._decode = decode  # a DeviceDecode (rule 14), or None
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
        self._error_queued = False  # an error waits in _ready, in order (rule 13)
        self._taken = 0  # batches taken from the source (counted by _take)
        # Which error next() raised last (read by _order/delivery.py): a taken batch's, whose
        # copy or transform failed and which is never delivered, or the source's own.
        self.error_took_a_batch = False
        self.error_from_source = False
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
        if event is None:
            # An error in its batch's place (rule 13); its nbytes counts the batches it took.
            self._error_queued = False
            self.error_took_a_batch = bool(nbytes)
            self.error_from_source = not nbytes
            # The traceback holds this frame: a local keeping the error would make a cycle
            # that keeps the iterator, its workers and ring until a collection.
            try:
                raise batch
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
            batches=self._batches,
            bytes_copied=self._bytes_copied,
            in_flight=len(self._ready),
            bytes_held=self._bytes_held,
            peak_bytes_held=self._peak,
            host_batches_held=len(self._host),
            host_waits=self._host_waits,
            host_wait_s=self._host_wait_s,
            pageable_batches=self._pageable,
            consumer_waits=self._consumer_waits,
            consumer_wait_s=self._consumer_wait_s,
        )

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
                self._drop_oldest()
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
            issued = len(self._host)
            taken = self._taken
            try:
                # Before next(): the source may need a free slot (and copied batches go).
                waited = self._make_room()
                issued = len(self._host)
                self._issue(self._take(), waited)
            except StopIteration:
                self._source_done = True
            except Exception as exc:
                # Delivered in order (rule 13). Its traceback's frames would keep the host
                # batch (a ring slot) alive.
                traceback.clear_frames(exc.__traceback__)
                if len(self._host) > issued:
                    # The copy or transform failed: its host batch goes once what was queued
                    # of it is done (rule 6), kept by no local (this frame is in the traceback).
                    self._host[-1][0].synchronize()
                    drop_copied([self._host.pop()])
                # More than 0: a taken batch failed here (copy, transform).
                self._ready.append((None, exc, self._taken - taken))
                self._error_queued = True

    def _take(self) -> Any:
        """The source's next batch, counted (no local of ``_fill`` may hold it)."""
        batch = next(self._source)
        self._taken += 1
        return batch

    def _make_room(self) -> float:
        """Rules (3) and (8) before a batch is issued; returns the seconds spent waiting on
        copies (consumer waits are not the input's fault: counted apart)."""
        drop_copied(pop_completed(self._host))
        pop_completed(self._marks)
        waited = 0.0
        if len(self._host) > self.depth:
            start = time.perf_counter()
            while len(self._host) > self.depth:
                self._drop_oldest()
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

    def _drop_oldest(self) -> None:
        self._host[0][0].synchronize()
        drop_copied([self._host.popleft()])

    def _issue(self, host: Any, waited: float) -> None:
        start = time.perf_counter()
        backend, side = self._backend, self._side
        tl, marks = self._trace.begin(side)  # (None, None) unless a trace records
        copy = Copier(backend, side, host)  # rules (7) and (9)
        with backend.use_stream(side):  # rule (1)
            held = host
            try:
                if self._decode is None:
                    batch = map_tensors(copy, host)
                else:  # rule (14)
                    batch, held = self._decode.place(host, copy, backend, side)
            finally:  # even after a failed copy: the leaves before it may be in flight
                copied = backend.record_event(side)
                self._host.append((copied, held, tuple(copy.addresses)))
                self._copies.add(copied)
            copied_at = self._trace.mark(marks, side)
            self._bytes_copied += copy.sent
            ready = copied
            if self._transform is not None:
                batch = self._transform(batch)
                ready = backend.record_event(side)
                self._trace.mark(marks, side)
        nbytes = tensor_bytes(batch)
        self._ready.append((ready, batch, nbytes))
        self._bytes_held += nbytes
        self._peak = max(self._peak, self._bytes_held)
        if copy.staged is not None:
            self._on_staged(*copy.staged)
        end = time.perf_counter()
        if self._recorder is not None:
            self._recorder.add("transfer", busy_s=end - start, blocked_s=waited)
            self._recorder.occupancy("transfer", len(self._ready), self.depth)
        if tl is not None:  # the times of "transfer" (NOTE [ Timeline ] (3))
            self._trace.issued(tl, self._batches + len(self._ready) - 1, start, copied_at, end,
                               copy.sent, self._transform is not None, marks)

    def _on_staged(self, t: torch.Tensor, reason: str) -> None:  # rule (7)
        self._pageable += 1
        if self._recorder is not None:
            self._recorder.count("pageable_batches")
        if self._pageable == 1:  # the first such batch: warned once
            # user frame <- __next__ <- _next <- _fill <- _issue <- _on_staged <- warn_staged
            warn_staged(t, reason, self.device, stacklevel=6)


class Copier:
    """``copier(t)``: ``t`` copied by ``backend`` on the current (side) stream (rule (1)), or
    ``t`` itself when it already lives on the device (rule (9)); made once per batch, before
    its copies. It notes the bytes sent, the host addresses read, and the first leaf whose
    copy is staged through pageable memory (rule (7))."""

    def __init__(self, backend: Any, side: Any, host: Any) -> None:
        self.backend = backend
        self.sent = 0
        self.addresses: list[int] = []
        self.staged: tuple[torch.Tensor, str] | None = None
        self.resident = {id(t): t for t in tree_leaves(host)
                         if isinstance(t, torch.Tensor) and backend.on_device(t)}
        if self.resident:  # rule (9)
            backend.wait_event(side, backend.record_event(backend.current_stream()))
            for t in self.resident.values():
                backend.record_stream(t, side)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if id(t) in self.resident:
            return t  # what .to(device) would return: the tensor itself
        backend = self.backend
        self.sent += t.numel() * t.element_size()
        self.addresses.append(t.data_ptr())
        if backend.needs_pinned and t.device.type == "cpu" and self.staged is None:
            reason = staged_reason(t, backend.is_pinned(t))
            if reason is not None:
                self.staged = (t, reason)
        return backend.copy(t)


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    """``batch`` with ``fn`` applied to each tensor leaf; other leaves pass through."""
    return tree_map(lambda x: fn(x) if isinstance(x, torch.Tensor) else x, batch)


def tensor_bytes(batch: Any) -> int:
    leaves = tree_leaves(batch)
    return sum(x.numel() * x.element_size() for x in leaves if isinstance(x, torch.Tensor))


def pop_completed(fifo: deque[Any]) -> list[Any]:
    """Pop entries (events, or tuples starting with one) from the left once complete."""
    done = []
    while fifo and event_of(fifo[0]).query():
        done.append(fifo.popleft())
    return done


def drop_copied(entries: list[tuple[Any, Any, tuple[int, ...]]]) -> None:
    """Drop host batches whose copies have completed (rule 10): their ring slots need no
    release fence, and only theirs: the addresses of their leaves say which (a collection
    that runs meanwhile may drop another loader's batch, which must still be fenced)."""
    with _cuda.copies_complete([p for entry in entries for p in entry[2]]):
        entries.clear()


def event_of(entry: Any) -> Any:
    return entry[0] if isinstance(entry, tuple) else entry
