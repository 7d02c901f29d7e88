"""The timeline recorder: spans, counters and instants of every stage, on one clock.

``gpufeed.trace(...)`` (``_tools/trace.py``) makes a :class:`Timeline` the module's ``active``
one and turns its records into Chrome Trace Event JSON; every stage writes into it only when
it is set.

NOTE [ Timeline ]
-----------------
(1) Cost when off: a stage does ``tl = timeline.active`` and ``if tl is not None:``, once per
    batch (a worker message, a handover, a device copy); nothing else runs. While a
    ``torch.profiler`` records, the host iterators' and the device stage's ``next()`` also run
    inside ``record_function`` ranges (:data:`WAIT_RANGE`): an attribute read per batch
    (:data:`torch_profiler`) when no profiler runs.
(2) One clock. Every time is ``time.perf_counter()`` seconds, one monotonic clock for the
    whole machine, so a worker process (forked or spawned) reads the same timeline as the
    main process and needs no offset (``tests/tools/test_trace.py`` checks that each batch's
    worker spans end before the main thread hands it out). The copy stream's times come from
    CUDA events placed on this clock through an anchor event (``_device/timing.py``).
(3) The stats are spans: the times a stage gives ``StatsRecorder`` are the numbers it records
    here (``wait``/``step`` from ``BaseIter._finish``, or with a device stage from the
    ``Delivered`` around it: the loop's handovers, not the stage's pulls), so
    ``loader.stats()`` and the timeline never disagree (a test sums both).
(4) Owners and tracks. A record names its *owner* (a loader's ``StatsRecorder``, a
    ``DeviceIterator`` without a loader, a ``Profiler``), one process group in the viewer,
    with tracks "main", ("worker", w), "device" and "gpu" (the copy stream). Workers do not
    record: their spans travel in the ``Fetched`` messages they already send.
(5) Records are ``(kind, owner, start, end, *payload)``, the owner by its number. A per-batch
    kind packs several spans into one record (a handover is the step, the wait and the
    hand-out; a worker batch its fetch and collate), expanded by the writer, and is stored
    flat: its numbers appended to one list per kind (``list.extend``, one C call, atomic in
    CPython: any thread may record). Numbers are objects the garbage collector does not
    track, so a trace gives it nothing to count or scan; a tuple per record made it run
    several times as often. Measurements: docs/how-it-works/measurements/memory.md#timeline.
    Other records are tuples in a deque. A loader's counters are sampled at handovers, at
    most every ``SAMPLE_EVERY_S``: a viewer needs no more, and the cheapest batches come
    faster.
(6) Bounds. ``last_batches=N`` keeps what happened since the loop asked for the N-th latest
    batch handed out (of any traced loader); ``last_seconds=S`` keeps the last S seconds.
    Records that end before the cut are dropped from the left at each handover, and the
    writer drops any left over, so a bounded trace can stay on for a whole run (about 300
    bytes a batch are kept).
(7) Other stages write generic records with :meth:`Timeline.span`, :meth:`Timeline.counter`
    and :meth:`Timeline.instant`, or :func:`instant` (a no-op when off) for a one-off event
    without a timeline at hand, e.g. an autotuner's decision.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Hashable, Mapping
from contextlib import AbstractContextManager, suppress
from types import SimpleNamespace
from typing import Any

# Record kinds (``Record[0]``); the payload (``Record[4:]``) of each:
SPAN = 0  # (track, name, args): one span [start, end]
COUNTER = 1  # (name, values): counter values at ``start`` (== end)
INSTANT = 2  # (track, name, args): a point event at ``start`` (== end)
HANDOUT = 3  # (batch, epoch, asked, ready): step [start, asked] (none when start == asked:
#              the first batch), wait [asked, ready], hand out [ready, end], on the "main"
#              track
WORKER = 4  # (worker, batch, epoch, fetch_s, nbytes, spilled): fetch [start, start + fetch_s],
#             collate [start + fetch_s, end], on track ("worker", worker)
SAMPLE = 5  # (ring_in_use, ring_fenced, ring_free, in_flight, workers): a loader's counters
SAMPLE_EVERY_S = 0.002  # a loader's counters are sampled at handovers, at most this often

Record = tuple[Any, ...]  # (kind, owner number, start, end, *payload)
#: Numbers per record in the per-batch kinds' columns: owner, start, end, *payload.
WIDTH = {HANDOUT: 7, WORKER: 9, SAMPLE: 8}
_serials = itertools.count(1)


class _Numbers(dict[Hashable, int]):
    """Owner -> its number (0, 1, ... in order of first appearance), assigned on first use."""

    _lock = threading.Lock()

    def __missing__(self, owner: Hashable) -> int:
        with self._lock:  # two threads' first records: two numbers
            return self.setdefault(owner, len(self))


#: The name of the ``record_function`` range around a host iterator's ``next()``.
WAIT_RANGE = "gpufeed: waiting for data"

#: The timeline being recorded, or None. Read it once per batch (NOTE [ Timeline ] (1)).
active: Timeline | None = None


class Timeline:
    """Records of one trace, bounded by ``last_batches`` and ``last_seconds`` (None: no
    bound) as NOTE [ Timeline ] (6) says; without either, everything is kept."""

    def __init__(self, *, last_batches: int | None = None,
                 last_seconds: float | None = None) -> None:
        if last_batches is not None and (
                isinstance(last_batches, bool) or not isinstance(last_batches, int)
                or last_batches < 1):
            raise ValueError(f"last_batches={last_batches!r} must be an int >= 1 (batches to "
                             "keep) or None to keep all")
        if last_seconds is not None and (
                isinstance(last_seconds, bool) or not isinstance(last_seconds, int | float)
                or not last_seconds > 0):
            raise ValueError(f"last_seconds={last_seconds!r} must be a positive number of "
                             "seconds or None to keep all")
        self.last_batches = last_batches
        self.last_seconds = None if last_seconds is None else float(last_seconds)
        self.records: collections.deque[Record] = collections.deque()  # generic kinds
        self._append = self.records.append
        self.columns: dict[int, list[Any]] = {kind: [] for kind in WIDTH}  # per-batch kinds
        self._skip = dict.fromkeys(WIDTH, 0)  # records dropped from each column's front
        self._handout = self.columns[HANDOUT].extend
        self._worker = self.columns[WORKER].extend
        self._sample = self.columns[SAMPLE].extend
        self.owners = _Numbers()  # records hold numbers, not objects: see (5) of the NOTE
        self.labels: dict[tuple[int, Hashable], str] = {}  # (owner number, track or None)
        self._bounds = last_batches is not None or last_seconds is not None
        self.serial = next(_serials)  # stages remember this, not the timeline, once labelled
        self.started = time.perf_counter()
        self.stopped: float | None = None
        self.cut = self.started  # records ending before it are out of the bounds
        self._handovers: collections.deque[float] = collections.deque(maxlen=last_batches or 1)
        # (when the loop asked for each of the last ``last_batches`` batches handed out)

    # -- generic records ----------------------------------------------------------------------
    def span(self, owner: Hashable, track: Hashable, name: str, start: float, end: float,
             args: Mapping[str, Any] | None = None) -> None:
        """A span ``name`` of ``owner``'s ``track`` from ``start`` to ``end`` (perf_counter s)."""
        self._append((SPAN, self.owners[owner], start, end, track, name, args))

    def counter(self, owner: Hashable, name: str, values: Mapping[str, float],
                t: float | None = None) -> None:
        """Counter ``name`` of ``owner`` takes ``values`` (series -> number) at ``t`` (now)."""
        t = time.perf_counter() if t is None else t
        self._append((COUNTER, self.owners[owner], t, t, name, dict(values)))

    def instant(self, owner: Hashable, name: str, *, track: Hashable = "main",
                args: Mapping[str, Any] | None = None, t: float | None = None) -> None:
        """Something that changes behaviour (a ring fallback, a worker restarted) happened to
        ``owner`` at ``t`` (now)."""
        t = time.perf_counter() if t is None else t
        self._append((INSTANT, self.owners[owner], t, t, track, name, args))

    def label(self, owner: Hashable, track: Hashable | None, text: str) -> None:
        """Name ``owner``'s process group (``track`` None) or one of its tracks."""
        self.labels[(self.owners[owner], track)] = text

    # -- per-batch records (NOTE [ Timeline ] (5)) --------------------------------------------
    def handout(self, owner: Hashable, batch: int, epoch: int, step_from: float, asked: float,
                ready: float, end: float) -> None:
        """The loop stepped from ``step_from`` (0: the first batch) to ``asked``, waited until
        ``ready`` and got ``batch`` at ``end``."""
        self._handout((self.owners[owner], step_from or asked, end, batch, epoch, asked, ready))
        if self._bounds:
            self._bound(asked, end)

    def worker_batch(self, owner: Hashable, worker: int, batch: int, epoch: int, started: float,
                     fetch_s: float, collate_s: float, nbytes: int, spilled: bool) -> None:
        """``worker`` fetched ``batch`` from ``started`` for ``fetch_s`` seconds, then collated
        it for ``collate_s`` (``spilled``: into a memory file)."""
        self._worker((self.owners[owner], started, started + fetch_s + collate_s, worker, batch,
                      epoch, fetch_s, nbytes, spilled))

    def sample(self, owner: Hashable, t: float, ring_in_use: int, ring_fenced: int,
               ring_free: int, in_flight: int, workers: int) -> None:
        """A loader's counters at ``t``."""
        self._sample((self.owners[owner], t, t, ring_in_use, ring_fenced, ring_free, in_flight,
                      workers))

    # -- bounds ------------------------------------------------------------------------------
    def _bound(self, asked: float, now: float) -> None:
        cut = self.cut
        if self.last_batches is not None:
            self._handovers.append(asked)
            if len(self._handovers) == self.last_batches:
                cut = max(cut, self._handovers[0])
        if self.last_seconds is not None:
            cut = max(cut, now - self.last_seconds)
        self.cut = cut
        records = self.records
        while records and records[0][3] < cut:
            records.popleft()
        for kind, column in self.columns.items():
            width, skip = WIDTH[kind], self._skip[kind]
            n = len(column) // width
            while skip < n and column[skip * width + 2] < cut:
                skip += 1
            if skip > 256 and 2 * skip > n:  # compact now and then: amortised O(1)
                del column[:skip * width]
                skip = 0
            self._skip[kind] = skip

    def all_records(self) -> list[Record]:
        """Every record kept, the per-batch kinds' as tuples, in no set order."""
        out = list(self.records)
        for kind, column in self.columns.items():
            width = WIDTH[kind]
            values = column[:]  # one C call: safe while another thread records
            out += [(kind, *values[i:i + width]) for i in
                    range(self._skip[kind] * width, len(values) - width + 1, width)]
        return out

    def __len__(self) -> int:
        """Records kept now."""
        return len(self.records) + sum(len(c) // WIDTH[k] - self._skip[k]
                                       for k, c in self.columns.items())


def start(timeline: Timeline) -> None:
    """Make ``timeline`` the active one; a RuntimeError if another one records."""
    global active
    if active is not None:
        raise RuntimeError(
            "a gpufeed.trace is already recording; traces do not nest: leave the outer "
            "`with gpufeed.trace(...)` block first, or record everything in the outer one")
    active = timeline


def stop(timeline: Timeline) -> None:
    """Stop recording ``timeline`` (if it is the active one)."""
    global active
    if active is timeline:
        timeline.stopped = time.perf_counter()
        active = None


def instant(owner: Hashable, name: str, *, track: Hashable = "main",
            args: Mapping[str, Any] | None = None) -> None:
    """:meth:`Timeline.instant` into the active timeline, if any (NOTE [ Timeline ] (7))."""
    tl = active
    if tl is not None:
        tl.instant(owner, name, track=track, args=args)


def span_until_now(owner: Hashable, name: str, start: float, *, track: Hashable = "main",
                   args: Mapping[str, Any] | None = None) -> None:
    """Record a span from ``start`` to now into the active timeline, if any."""
    tl = active
    if tl is not None:
        tl.span(owner, track, name, start, time.perf_counter(), args)


#: ``torch.autograd.profiler``, whose global ``_is_profiler_enabled`` torch 2.x sets while a
#: profiler records: hot paths read it, two attribute loads and no call (another torch: never on).
torch_profiler: Any = SimpleNamespace(_is_profiler_enabled=False)
with suppress(ImportError):
    from torch.autograd import profiler as _profiler_module

    if isinstance(getattr(_profiler_module, "_is_profiler_enabled", None), bool):
        torch_profiler = _profiler_module


def profiling() -> bool:
    """Whether a ``torch.profiler`` (or ``torch.autograd.profiler.profile``) records now."""
    return bool(torch_profiler._is_profiler_enabled)


def torch_range(name: str) -> AbstractContextManager[Any]:
    """A ``record_function`` range named ``name`` in the running torch profiler's trace."""
    from torch.autograd.profiler import record_function

    return record_function(name)
