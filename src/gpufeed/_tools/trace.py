"""``gpufeed.trace``: record a timeline of every loader and write Chrome Trace Event JSON.

Every gpufeed loader (and ``to_device`` iterator) iterated inside ``with gpufeed.trace(...)`` is
recorded, from any thread; the recorder and its rules are NOTE [ Timeline ] in
``_base/timeline.py``. This module is the one writer: it expands the records into Trace Event
Format events (https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU):
per loader one process group (``pid`` 1, 2, ... in order of appearance), per track one thread
(``tid``: ``_TRACKS``, ``WORKER_TID + w`` for worker w), complete events (``ph`` "X",
``ts``/``dur`` in microseconds from the start of the trace), counters (``ph`` "C") and instants
(``ph`` "i").
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Hashable, Iterator
from pathlib import Path
from typing import Any

from .._base import timeline as _timeline
from .._base.timeline import COUNTER, HANDOUT, INSTANT, SAMPLE, SPAN, WORKER, Timeline

_TRACKS: dict[Hashable, tuple[int, str]] = {
    "main": (1, "main thread (your loop)"),
    "device": (2, "device stage"),
    "gpu": (3, "GPU copy stream (CUDA events)"),
    "fetching": (4, "main thread: fetch and collate (num_workers=0)"),
}
WORKER_TID = 100


def _track(track: Hashable, others: dict[Hashable, int]) -> tuple[int, str]:
    """(tid, name) of a track; a track neither known nor a worker's gets the next tid from
    1000 in ``others``."""
    known = _TRACKS.get(track)
    if known is not None:
        return known
    if isinstance(track, tuple) and len(track) == 2 and track[0] == "worker":
        return WORKER_TID + int(track[1]), f"worker {track[1]}"
    return others.setdefault(track, 1000 + len(others)), str(track)


def _expand(rec: tuple[Any, ...], delivered: int
            ) -> Iterator[tuple[str, Hashable, str, float, float, Any]]:
    """One record as (ph, track or counter name, name, start, end, args) events;
    ``delivered``: the owner's handovers so far in the trace, this one included."""
    kind, start, end, p = rec[0], rec[2], rec[3], rec[4:]
    if kind == HANDOUT:
        batch, epoch, asked, ready = p
        args = {"batch": batch, "epoch": epoch}
        if start < asked:
            yield "X", "main", "step", start, asked, args
            yield "X", "main", "wait", asked, ready, args
        else:  # the first batch of an iterator: worker start-up, as in the stats
            yield "X", "main", "startup", asked, ready, args
        if end > ready:  # (a wrapped loop's handover takes no time of its own)
            yield "X", "main", "hand out", ready, end, args
        yield "C", None, "batches delivered", end, end, {"delivered": delivered}
    elif kind == WORKER:
        worker, batch, epoch, fetch_s, nbytes, spilled = p
        args = {"batch": batch, "epoch": epoch, "bytes": nbytes}
        track = ("worker", worker)
        yield "X", track, "fetch", start, start + fetch_s, args
        yield "X", track, "collate", start + fetch_s, end, args
        if spilled:
            yield "i", track, "spill to a memory file", end, end, {"batch": batch}
    elif kind == SAMPLE:
        in_use, fenced, free, in_flight, workers = p
        yield "C", None, "ring slots", start, start, {
            "in use": in_use - fenced, "fenced": fenced, "free": free}
        yield "C", None, "batches in flight", start, start, {"in flight": in_flight}
        yield "C", None, "workers", start, start, {"in force": workers}
    elif kind == SPAN:
        track, name, args = p
        yield "X", track, name, start, end, args
    elif kind == COUNTER:
        name, values = p
        yield "C", None, name, start, start, values
    elif kind == INSTANT:
        track, name, args = p
        yield "i", track, name, start, start, args


def chrome_trace(timeline: Timeline) -> dict[str, Any]:
    """The timeline as a Trace Event Format document (a JSON-ready dict).

    Kept: what happened within the trace (and within its bounds, NOTE [ Timeline ] (6)): a
    span that began before the trace or the bound's cut, or ended after the trace stopped
    (a batch a worker began before ``trace()``), is left out, not clipped.
    """
    origin = timeline.started
    lo = timeline.cut
    hi = timeline.stopped if timeline.stopped is not None else float("inf")
    pids: dict[int, int] = {}  # owner number -> pid, in order of the first record kept
    tids: dict[tuple[int, int], str] = {}
    others: dict[Hashable, int] = {}
    events: list[dict[str, Any]] = []

    def us(t: float) -> float:
        return round((t - origin) * 1e6, 3)

    delivered: dict[int, int] = {}
    for rec in sorted(timeline.all_records(), key=lambda r: r[3]):
        owner: int = rec[1]
        pid = pids.setdefault(owner, len(pids) + 1)
        if rec[0] == HANDOUT:
            delivered[owner] = delivered.get(owner, 0) + 1
        for ph, track, name, start, end, args in _expand(rec, delivered.get(owner, 0)):
            if start < lo or end > hi:
                continue
            ev: dict[str, Any] = {"ph": ph, "name": name, "pid": pid, "ts": us(start)}
            if ph != "C":
                tid, track_name = _track(track, others)
                ev["tid"] = tid
                tids.setdefault((pid, tid), timeline.labels.get((owner, track)) or track_name)
            if ph == "X":
                ev["dur"] = round(us(end) - ev["ts"], 3)
                ev["cat"] = "worker" if tid >= WORKER_TID else "main" if tid == 1 else "device"
            elif ph == "i":
                ev["s"] = "t"
            if args:
                ev["args"] = dict(args)
            events.append(ev)
    events.sort(key=lambda e: e["ts"])
    # each process (tid 0) and thread: its name, and its place in the order (its pid or tid)
    named = [("process", pid, 0, timeline.labels.get((owner, None)) or f"gpufeed loader {pid}",
              pid) for owner, pid in pids.items()]
    named += [("thread", pid, tid, name, tid) for (pid, tid), name in sorted(tids.items())]
    meta = [{"ph": "M", "name": f"{kind}_{what}", "pid": pid, "tid": tid, "args": {what: value}}
            for kind, pid, tid, name, order in named
            for what, value in (("name", name), ("sort_index", order))]
    stopped = timeline.stopped
    return {
        "traceEvents": meta + events,
        "displayTimeUnit": "ms",
        "otherData": {
            "producer": "gpufeed",
            "clock": "time.perf_counter (CLOCK_MONOTONIC on Linux), microseconds from the "
                     "trace's start; worker processes read the same clock",
            "main_pid": os.getpid(),
            "duration_us": round((stopped - origin) * 1e6, 3) if stopped is not None else None,
            "window_start_us": us(lo),
            "bounds": {"last_batches": timeline.last_batches,
                       "last_seconds": timeline.last_seconds},
        },
    }


class Trace:
    """A recording started by :func:`trace`; a context manager (also ``start()``/``stop()``).

    ``to_dict()`` gives the Trace Event Format document, ``save(path)`` writes it,
    ``plot(path)`` draws a Gantt chart of it (needs matplotlib); all work after ``stop()``.
    """

    def __init__(self, path: str | os.PathLike[str] | None, *, last_batches: int | None,
                 last_seconds: float | None) -> None:
        if path is not None and not isinstance(path, str | os.PathLike):
            raise TypeError(f"trace path must be a str, a path or None, got {path!r}")
        self.path = Path(path) if path is not None else None
        self.timeline = Timeline(last_batches=last_batches, last_seconds=last_seconds)
        self._state = "new"

    def start(self) -> Trace:
        """Start recording (a RuntimeError if this or another trace already records)."""
        if self._state != "new":
            raise RuntimeError(f"this gpufeed.trace was already {self._state}; call "
                               "gpufeed.trace(...) again for a new recording")
        _timeline.start(self.timeline)
        self._state = "started"
        return self

    def stop(self) -> None:
        """Stop recording, and write the file given to ``trace()`` if any; idempotent."""
        if self._state != "started":
            return
        _timeline.stop(self.timeline)
        self._state = "stopped"
        if self.path is not None:
            self.save(self.path)

    def __enter__(self) -> Trace:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def to_dict(self) -> dict[str, Any]:
        """The Trace Event Format document of what was recorded so far."""
        return chrome_trace(self.timeline)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the trace as JSON (gzip-compressed when ``path`` ends in ``.gz``)."""
        path = Path(path)
        data = json.dumps(self.to_dict(), separators=(",", ":")).encode()
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with gzip.open(tmp, "wb") if path.suffix == ".gz" else open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        return path

    def plot(self, path: str | os.PathLike[str], *, seconds: float | None = 1.0,
             start_s: float = 0.0, stall_ms: float = 1.0) -> Path:
        """Draw ``seconds`` of the trace from ``start_s`` as a Gantt chart per track, stalls
        marked (see ``_tools/gantt.py``; needs matplotlib). A window past the trace's end
        raises ``ValueError``."""
        from .gantt import render

        return render(self.to_dict(), path, seconds=seconds, start_s=start_s,
                      stall_ms=stall_ms)


def trace(path: str | os.PathLike[str] | None = None, *, last_batches: int | None = None,
          last_seconds: float | None = None) -> Trace:
    """Record a timeline of every gpufeed loader iterated until the trace stops.

    Use it as ``with gpufeed.trace("run.json"): ...``; the file (Chrome Trace Event JSON,
    ``.json.gz`` compressed) opens in Perfetto (ui.perfetto.dev) and chrome://tracing. One
    process group per loader: the main thread (each batch's wait, hand-out and, as the gap
    between, your step), one track per worker (each batch's fetch and collate, with its batch
    index and bytes), the device stage, counters (ring slots in use / fenced / free, batches
    in flight, workers) and instants (ring fallbacks and growth, spills). A stock
    ``torch.utils.data.DataLoader`` shows its loop's waits and steps when iterated through
    ``gpufeed.tools.Profiler().wrap(loader)``.

    Args:
        path: where to write the trace when it stops; None writes nothing (use ``save``,
            ``to_dict`` or ``plot`` on the returned :class:`Trace`).
        last_batches: keep only what happened since the N-th latest batch handed out, so a
            trace can stay on for a whole run; None keeps everything.
        last_seconds: keep only the last S seconds; None keeps everything.

    Cost: off, one check per batch per stage; on, two records per batch, about 2 us of the
    main thread's CPU (``bench/results/timeline.md``: 0.5-2% of the cheapest batches'
    CPU time, the tabular benchmark's).
    """
    return Trace(path, last_batches=last_batches, last_seconds=last_seconds)
