"""Loader statistics as data: a cheap recorder in the hot path, frozen snapshots for people,
and what each figure means.

The core calls :class:`StatsRecorder` once per batch and stage; ``loader.stats()`` returns its
:meth:`~StatsRecorder.snapshot`. A ``to_device`` iterator keeps its own counters
(:class:`DeviceStats`). Cost: :meth:`StatsRecorder.add` is one lock round trip, a dict look-up
and a few float operations; percentiles only in the snapshot. ``MEANINGS`` has one line per
stage, counter and column of :class:`~gpufeed.stats.LoaderStats` (docs/guides/stats.md,
"Reading loader.stats()", lists the same lines; a test keeps them in step).
:func:`ring_findings` reads a snapshot and, when a large share of batches missed the slot ring
(``ring_fallback``), names the cause it sees and the fix:

NOTE [ Ring fallback causes ]: the ring's slots in use (``ring`` occupancy) are the batches in
flight that got a slot (at most the ``prefetch`` occupancy) plus the batches the loop still
holds. So, over a snapshot:
1. **held by the loop**: the ring has more slots than batches may be in flight, yet it was
   full (sampled occupancy reached ``RING_FULL`` of the capacity) or held on average
   ``HELD_MIN`` (or ``HELD_SHARE`` of the capacity) slots more than the batches in flight:
   batches, or single tensors of them, that the loop kept (one label tensor keeps its whole
   slot), so new batches found it full. Fix: copy what you keep (``t.clone()``), or raise
   ``ring_bytes=`` to cover it.
2. **budget too small**: the ring has no more slots than batches in flight, so it cannot even
   hold the prefetch. Fix: ``ring_bytes=`` of at least (in flight + 2) batches.
3. **variable shapes**: slots were carved many times over (``ring_grow`` well above the
   capacity): batches change size, so slots sized for small batches are retired and re-carved.
   Fix: pad to fixed shapes in ``collate_fn``, or a ``ring_bytes=`` sized for the largest.
More than one cause can hold at once; with none of them visible the finding says so.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

DEFAULT_WINDOW = 4096


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of sorted values, linearly interpolated; 0.0 for none
    (a stage that never ran reads as zero time)."""
    n = len(sorted_values)
    if n == 0:
        return 0.0
    pos = (n - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, n - 1)
    frac = pos - lo
    return float(sorted_values[lo] * (1.0 - frac) + sorted_values[hi] * frac)


def input_bound_share(wait_s: float, step_s: float) -> float | None:
    """The share (0-1) of a loop spent waiting for data, ``wait / (wait + step)``, the waits
    without start-up (the first batch); None when nothing was measured. Every input-bound
    figure gpufeed prints is this one (``loader.stats()``, ``gpufeed profile``, ``tune``)."""
    total = wait_s + step_s
    return wait_s / total if total > 0 else None


def human_bytes(n: float) -> str:
    """Bytes for people, in powers of 1024: "512 B", "3.2 MiB", "15.6 GiB"."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:,.0f} B" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1024
    return f"{value:,.1f} TiB"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]], *,
                 left: int = 1) -> str:
    """A plain text table: the first ``left`` columns aligned left, the rest right."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        parts = [c.ljust(w) if i < left else c.rjust(w)
                 for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        return "  ".join(parts).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), sep, *(line(r) for r in cells[1:])])


@dataclass(frozen=True)
class StageStats:
    """What one stage of the data path did.

    Fields:
        name: the stage ("fetch", "collate", "wait", "step", "transfer", ...).
        batches: batches that went through the stage.
        busy_s: total seconds spent working on them.
        blocked_s: total seconds spent blocked (on a queue, a free slot, the next batch).
        p50_s, p90_s, p99_s: percentiles of ``busy_s + blocked_s`` per batch, in seconds, over
            the last ``window`` batches (a bounded ring: old batches fall out).
        occupancy_mean, occupancy_max: queue or ring slots in use, sampled once per batch
            (0 when never sampled).
        capacity: slots available at the last sample (0 when never sampled).
    """

    name: str
    batches: int
    busy_s: float
    blocked_s: float
    p50_s: float
    p90_s: float
    p99_s: float
    occupancy_mean: float = 0.0
    occupancy_max: int = 0
    capacity: int = 0

    @property
    def mean_s(self) -> float:
        """Mean seconds per batch (busy plus blocked); 0.0 when no batch went through."""
        return (self.busy_s + self.blocked_s) / self.batches if self.batches else 0.0


@dataclass(frozen=True)
class LoaderStats:
    """A snapshot of a loader's statistics.

    Fields:
        wall_s: seconds since the loader was built (its stats are never reset: for one
            epoch's figures, subtract the snapshot taken before it from the one after).
        stages: per-stage figures, by stage name, in the order first reported.
        counters: event counts ("batches", "samples", "ring_grow", "ring_fallback",
            "ring_unsupported": batches with a tensor the ring cannot hold, sent torch's own
            way, see ``gpufeed.DataLoader.stats``) and gauges, values at the last batch handed
            over ("ring_slots", "ring_bytes"), or set when they change ("worker_nice": NOTE
            [ Worker priority ] in ``_host/priority.py``).
        autotune: with ``num_workers="auto"``, an ``AutotuneStats`` (``_base/tuning.py``):
            the worker count in force, the budgets and the latest decisions; else None.
    """

    wall_s: float
    stages: Mapping[str, StageStats] = field(default_factory=dict)
    counters: Mapping[str, int] = field(default_factory=dict)
    autotune: Any = None

    @property
    def input_bound(self) -> float | None:
        """Share (0-1) of the user's loop spent waiting for data, from the "wait" and "step"
        stages (the first batch's wait, the "startup" stage, is left out, as
        ``gpufeed.tools.Profiler`` leaves it out). None until both stages are reported."""
        wait, step = self.stages.get("wait"), self.stages.get("step")
        if wait is None or step is None:
            return None
        return input_bound_share(wait.busy_s + wait.blocked_s, step.busy_s + step.blocked_s)

    def to_dict(self) -> dict[str, Any]:
        """The snapshot as a plain, JSON-ready dict."""
        out = {
            "wall_s": self.wall_s,
            "stages": {name: asdict(s) for name, s in self.stages.items()},
            "counters": dict(self.counters),
        }
        if self.autotune is not None:
            out["autotune"] = self.autotune.to_dict()
        return out

    def __str__(self) -> str:
        return self.render()

    def render(self, *, input_bound: bool = True) -> str:
        """The table ``print(stats)`` shows; ``input_bound=False`` leaves out the input-bound
        line (``gpufeed profile`` prints its own, over the steps it measured)."""
        rows = []
        for s in self.stages.values():
            occ = (f"{s.occupancy_mean:.1f}/{s.capacity} (max {s.occupancy_max})"
                   if s.capacity else "-")
            times = ([f"{s.busy_s:.3f}", f"{s.blocked_s:.3f}", f"{s.p50_s * 1e3:.2f}",
                      f"{s.p90_s * 1e3:.2f}", f"{s.p99_s * 1e3:.2f}"]
                     if s.batches else ["-"] * 5)  # an occupancy-only stage (a queue, the ring)
            rows.append([s.name, s.batches or "-", *times, occ])
        headers = ["stage", "batches", "busy s", "blocked s", "p50 ms", "p90 ms", "p99 ms",
                   "occupancy"]
        text = [f"gpufeed loader stats over {self.wall_s:.2f} s", format_table(headers, rows)]
        if self.counters:
            text.append("counters: " + ", ".join(f"{k}={v}" for k, v in self.counters.items()))
        bound = self.input_bound
        if bound is not None and input_bound:
            text.append(f"input-bound: {bound:.0%}")
        if self.autotune is not None:
            text.append(str(self.autotune))
        text += ring_findings(self)
        return "\n".join(text)

    def explain(self) -> str:
        """One line per stage, counter and column of this snapshot: "name: meaning"."""
        names = [*self.stages, *self.counters, "busy s", "blocked s", "p50/p90/p99 ms"]
        if any(s.capacity for s in self.stages.values()):
            names.append("occupancy")
        if self.input_bound is not None:
            names.append("input-bound")
        if self.autotune is not None:
            names.append("autotune")
        return "\n".join(f"{n}: {MEANINGS[n]}" for n in dict.fromkeys(names) if n in MEANINGS)


#: a fallback share above this gets a finding (a few fall-backs while the ring grows are normal)
FALLBACK_HIGH = 0.1
#: ring occupancy (sampled at handovers, so it can miss the very top) at or above this share of
#: the capacity counts as full; a loop that keeps nothing stays well below, near the batches
#: in flight
RING_FULL = 0.75
#: slots in use beyond the batches in flight, on average, that count as held by the loop (a
#: loop that keeps nothing holds one or two: the batch it works on and the one just handed over)
HELD_MIN = 4
HELD_SHARE = 0.1


MEANINGS: dict[str, str] = {
    # stages (seconds per batch)
    "fetch": "worker time reading the samples of a batch (your `dataset[i]` or `__getitems__`)",
    "collate": "worker time building the batch from its samples (into a ring slot if one "
               "was free)",
    "startup": "time your loop waited for the first batch of each iter() (worker start-up), "
               "left out of wait and input-bound",
    "wait": "time your loop was blocked waiting for the next batch (input-bound when large; "
            "without workers it includes the main thread's own fetch and collate)",
    "step": "time your loop spent between two batches (your training step)",
    "transfer": "device stage: host-to-device copy and device transform per batch",
    "ring": "occupancy only: slots of the shared ring in use (in flight plus held by your "
            "loop) / slots the ring budget allows",
    "ring_fenced": "occupancy only, pinned rings: slots your loop released whose copies the "
                   "GPU has not finished yet (free again once it has) / slots the ring budget "
                   "allows",
    "prefetch": "occupancy only: batches in flight (sent to workers or ready, not yet handed "
                "to your loop) / the most allowed in flight",
    # counters
    "batches": "batches handed to your loop",
    "samples": "samples handed to your loop (each batch's first tensor's first dimension; one "
               "per item with batch_size=None)",
    "ring_grow": "ring slots carved (grows with the prefetch; keeps growing if batch sizes vary)",
    "ring_fallback": "batches that found no free ring slot and got memory of their own (a "
                     "per-batch memory file with process workers): one allocation and page "
                     "faults per batch instead of a recycled slot",
    "ring_unsupported": "batches with a tensor the ring cannot hold (nested, sparse, quantized, "
                        "a tensor subclass), sent torch's own way (through /dev/shm)",
    "ring_slots": "slots the ring has carved and holds (in use, fenced or free), at the last "
                  "batch handed over",
    "ring_bytes": "memory the ring's slots take (in use or free), at the last batch handed over",
    "worker_nice": "how much lower than the main process's the process workers' CPU priority "
                   "is (nice; worker_nice=None lowers it by 5 once the loop is main-bound on "
                   "oversubscribed cores)",
    "device_ahead": "device stage: batches copied ahead of your loop (taken from the loader, "
                    "not yet handed to you; device_depth once it is full), at the last batch "
                    "handed over; not counted in batches or samples",
    "consumer_waits": "device stage: times your loop waited for a batch on the device",
    "pageable_batches": "device stage: batches copied from unpinned memory (slower copies)",
    # columns
    "busy s": "total seconds the stage worked",
    "blocked s": "total seconds the stage was blocked (on a queue, a slot, the next batch)",
    "p50/p90/p99 ms": "per-batch time (busy + blocked) percentiles over recent batches",
    "occupancy": "mean/capacity (max) of slots or queue entries in use, sampled per batch",
    "input-bound": "wait / (wait + step): share of your loop spent waiting for data, "
                   "start-up left out",
    "autotune": "with num_workers=\"auto\": the worker count in force, the CPU and memory "
                "budgets and what it uses of them, and its latest decisions",
}


def ring_findings(stats: LoaderStats) -> list[str]:
    """Causes and fixes of a high ring fallback share (NOTE [ Ring fallback causes ]); empty
    when the share is low or the loader has no ring."""
    fallbacks = stats.counters.get("ring_fallback", 0)
    batches = stats.counters.get("batches", 0) or (
        stats.stages["wait"].batches if "wait" in stats.stages else 0)
    if not fallbacks or not batches or fallbacks / batches <= FALLBACK_HIGH:
        return []
    share = fallbacks / batches
    head = (f"ring_fallback: {fallbacks} of {batches} batches ({share:.0%}) found no ring slot "
            "and took the slower stock path")
    ring, flight = stats.stages.get("ring"), stats.stages.get("prefetch")
    cap = ring.capacity if ring else 0
    in_flight = flight.capacity if flight else 0  # the most batches in flight at once
    held_mean = (ring.occupancy_mean - flight.occupancy_mean) if ring and flight else 0.0
    found = []
    if cap and in_flight and cap <= in_flight:
        found.append(f"cause: the ring budget is too small: {cap} slots for up to {in_flight} "
                     f"batches in flight; fix: ring_bytes= of at least {in_flight + 2} "
                     "batches")
    elif ring and cap and in_flight < cap and (
            ring.occupancy_max >= RING_FULL * cap
            or held_mean >= max(HELD_MIN, HELD_SHARE * cap)):
        found.append(f"cause: batches held by your loop: up to {ring.occupancy_max} of {cap} "
                     f"ring slots were in use ({ring.occupancy_mean:.0f} on average, with "
                     f"{flight.occupancy_mean if flight else 0:.0f} batches in flight), though "
                     "the ring has room for the "
                     f"{in_flight} batches allowed in flight; a slot stays taken while your "
                     "loop holds any tensor of its batch (a kept label tensor keeps the whole "
                     "slot); fix: copy what you keep (t.clone()) or raise ring_bytes= to "
                     "cover it")
    grows = stats.counters.get("ring_grow", 0)
    if cap and grows > 2 * cap:
        found.append(f"cause: variable batch shapes: {grows} slots carved for a ring of {cap}; "
                     "slots sized for smaller batches are retired and re-carved; fix: pad to "
                     "fixed shapes in collate_fn, or ring_bytes= sized for the largest batch")
    if not found:
        found.append("cause not visible in these stats; fix: raise ring_bytes=, or run "
                     "gpufeed profile on the loop to see the ring and prefetch occupancy")
    return [head, *found]


@dataclass(frozen=True)
class DeviceStats:
    """Counters of one ``to_device`` iterator (bytes are bytes, times are seconds). Rules are
    those of NOTE [ Device stage: streams, events and slots ] in ``_device/prefetch.py``.

    batches: batches handed to the consumer.
    bytes_copied: host bytes sent to the device (sum of tensor leaf sizes).
    in_flight: batches issued but not yet handed over (at most ``depth``).
    bytes_held: device bytes of those batches, after the transform.
    peak_bytes_held: largest ``bytes_held`` seen (while issuing, before a handover).
    host_batches_held: host batches kept alive until their copy completes (<= depth + 1).
    host_waits / host_wait_s: times, and seconds in total, next() blocked on a copy event
        to release a host batch (rule 3); non-zero means copies are slower than steps.
    pageable_batches: batches with a leaf whose copy could not overlap (rule 7).
    consumer_waits / consumer_wait_s: times, and seconds in total, next() blocked because
        the consumer stream was more than ``depth`` steps behind the CPU (rule 8): the GPU,
        not the input, is the bottleneck then.
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
    consumer_waits: int = 0
    consumer_wait_s: float = 0.0


@dataclass(slots=True)
class _Stage:
    """Per-stage accumulator; ``samples`` is a ring of the last ``window`` batch times."""

    samples: list[float]
    batches: int = 0
    busy: float = 0.0
    blocked: float = 0.0
    pos: int = 0
    occ_sum: int = 0
    occ_n: int = 0
    occ_max: int = 0
    cap: int = 0


class StatsRecorder:
    """Per-stage timings, occupancy and counters, recorded from any thread (one lock, held
    for a few operations). ``window``: recent batches per stage that feed the percentiles; a
    larger one gives steadier P99s at 8 bytes per batch per stage."""

    def __init__(self, *, window: int = DEFAULT_WINDOW) -> None:
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive int (batches), got {window!r}")
        self._window = window
        self._lock = threading.Lock()
        self._stages: dict[str, _Stage] = {}
        self._counters: dict[str, int] = {}
        self._t0 = time.perf_counter()

    def _stage(self, stage: str) -> _Stage:
        """A new stage's accumulator (callers look ``stage`` up first)."""
        st = self._stages[stage] = _Stage([0.0] * self._window)
        return st

    def add(self, stage: str, busy_s: float = 0.0, blocked_s: float = 0.0) -> None:
        """Record one batch through ``stage``: ``busy_s`` seconds working, ``blocked_s`` blocked."""
        with self._lock:
            st = self._stages.get(stage) or self._stage(stage)
            st.busy += busy_s
            st.blocked += blocked_s
            st.samples[st.pos % self._window] = busy_s + blocked_s
            st.pos += 1
            st.batches += 1

    def add_many(self, stage: str, busy: Sequence[float]) -> None:
        """``add(stage, busy_s=b)`` for each ``b`` of ``busy`` (one worker message's batches)."""
        with self._lock:
            st = self._stages.get(stage) or self._stage(stage)
            samples, window = st.samples, self._window
            for b in busy:
                samples[st.pos % window] = b
                st.pos += 1
                st.busy += b
            st.batches += len(busy)

    def handout(self, step_s: float | None, wait_s: float, samples: int | None = None,
                occupancy: Sequence[tuple[str, int, int]] = (),
                gauges: Sequence[tuple[str, int]] = ()) -> None:
        """One batch of ``samples`` samples handed to the user, in one lock round trip: the
        "step" and "wait" stages (``step_s`` None: the first batch, whose wait is worker
        start-up, "startup"), the "batches" and "samples" counters, and :meth:`passed_on`."""
        window = self._window
        with self._lock:  # add() written out: this runs once per batch
            stages, counters = self._stages, self._counters
            if step_s is not None:
                st = stages.get("step") or self._stage("step")
                st.busy += step_s
                st.samples[st.pos % window] = step_s
                st.pos += 1
                st.batches += 1
                st = stages.get("wait") or self._stage("wait")
            else:
                st = stages.get("startup") or self._stage("startup")
            st.blocked += wait_s
            st.samples[st.pos % window] = wait_s
            st.pos += 1
            st.batches += 1
            counters["batches"] = counters.get("batches", 0) + 1
            if samples is not None:
                counters["samples"] = counters.get("samples", 0) + samples
            self._sample(occupancy, gauges)

    def passed_on(self, occupancy: Sequence[tuple[str, int, int]] = (),
                  gauges: Sequence[tuple[str, int]] = ()) -> None:
        """Sample ``occupancy`` and set ``gauges`` for a batch handed to the device stage, whose
        handover to the loop records the rest (``_order/delivery.py``)."""
        with self._lock:
            self._sample(occupancy, gauges)

    def _sample(self, occupancy: Sequence[tuple[str, int, int]],
                gauges: Sequence[tuple[str, int]]) -> None:  # lock held
        for name, used, capacity in occupancy:
            st = self._stages.get(name) or self._stage(name)
            st.occ_sum += used
            st.occ_n += 1
            st.occ_max = max(st.occ_max, used)
            st.cap = capacity
        self._counters.update(gauges)

    def occupancy(self, stage: str, used: int, capacity: int) -> None:
        """Sample how many of ``capacity`` queue or ring slots of ``stage`` are in use now."""
        with self._lock:
            self._sample(((stage, used, capacity),), ())

    def count(self, name: str, k: int = 1) -> None:
        """Add ``k`` to the counter ``name`` (e.g. "ring_fallback")."""
        with self._lock:
            self._counters[name] = self._counters.get(name, 0) + k

    def counter(self, name: str) -> int | None:
        """The counter or gauge ``name`` now, None if never set (one value, no snapshot)."""
        return self._counters.get(name)  # one dict read, atomic: no lock needed

    def gauge(self, name: str, value: int) -> None:
        """Set the counter ``name`` to ``value``: a level now (e.g. "ring_bytes"), not a sum."""
        with self._lock:
            self._counters[name] = value

    def __getstate__(self) -> dict[str, Any]:
        """The figures without the lock (a loader's copy or pickle)."""
        with self._lock:
            state = dict(self.__dict__)
            state["_stages"] = copy.deepcopy(self._stages)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def snapshot(self) -> LoaderStats:
        """Frozen copy of the figures so far; percentiles are computed here, not in ``add``."""
        with self._lock:
            raw = {name: replace(st, samples=st.samples[:min(st.pos, self._window)])
                   for name, st in self._stages.items()}
            counters = dict(self._counters)
            wall = time.perf_counter() - self._t0
        stages: dict[str, StageStats] = {}
        for name, st in raw.items():
            samples = sorted(st.samples)
            stages[name] = StageStats(
                name=name, batches=st.batches, busy_s=st.busy, blocked_s=st.blocked,
                p50_s=percentile(samples, 50), p90_s=percentile(samples, 90),
                p99_s=percentile(samples, 99),
                occupancy_mean=st.occ_sum / st.occ_n if st.occ_n else 0.0,
                occupancy_max=st.occ_max, capacity=st.cap,
            )
        return LoaderStats(wall_s=wall, stages=stages, counters=counters)
