"""The device stage in a trace: host-side spans of each copy, and the copy stream's own times.

Recorded only while a trace records (NOTE [ Timeline ] in ``_base/timeline.py``).

Host side (every backend), track "device": "copy" (issuing each leaf's copy; with the
synchronous backend, the copy itself), "transform" (issued), "wait for a copy" (``next()``
blocked on an older copy's event, rule (3) of NOTE [ Device stage: streams, events and
slots ]). Their sum per batch is the "transfer" figure of ``loader.stats()``.

GPU side (a backend with a GPU clock: CUDA), track "gpu": "copy" and "transform" as the copy
stream ran them, from timed CUDA events around them. CUDA events measure time between events,
not clock time, so each event X is placed at ``g_A + elapsed(A, X)``, where A, the *anchor*,
is an event recorded once on the side stream and ``g_A`` is when the GPU ran it, on the host
clock. A ran after the host recorded it and before ``A.synchronize()`` returned (``t_after``),
and every later X ran after the host recorded it (``h_X``), so ``g_A >= h_X - elapsed(A, X)``.
The estimate is the largest of these lower bounds, capped at ``t_after``: never later than the
truth, exact to the launch latency (microseconds) whenever the stream was idle when A or a
later event was recorded (a new stream, or copies that keep up), and a span never starts before
its copy was issued. Add the drift between the GPU's timer and the host clock over the run
(parts per million). Spans are resolved once their last event has completed, at a later
``next()`` (never blocking) or at close. Tested with a simulated GPU clock, not yet against a
real GPU's profile.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Hashable
from typing import Any

from .._base import timeline as _timeline


class DeviceTrace:
    """What one device stage records while a trace runs; ``owner``: its loader's stats
    recorder (the loader's process group in the trace), or this object for ``to_device``
    over another iterable. GPU spans are placed on the host clock as the module's text says."""

    def __init__(self, backend: Any, recorder: Any) -> None:
        self.owner: Hashable = recorder if recorder is not None else self
        self._labelled = 0  # the serial of the trace last labelled for
        self._backend = backend
        self.gpu = bool(getattr(backend, "gpu_clock", False))
        self._anchor: Any = None
        self._lo = self._hi = 0.0  # bounds of the anchor's GPU time, on the host clock
        self.pending: deque[tuple[Hashable, int, int, list[tuple[Any, float]]]] = deque()

    def begin(self, side: Any
              ) -> tuple[_timeline.Timeline | None, list[tuple[Any, float] | None] | None]:
        """At a batch's issue: the active trace (None: none records) and the batch's GPU
        marks so far (the first one; None without a trace or a GPU clock)."""
        tl = _timeline.active
        if tl is None or not self.gpu:
            return tl, None
        return tl, [self._gpu_mark(side)]

    def mark(self, marks: list[tuple[Any, float] | None] | None, side: Any) -> float:
        """Add a GPU mark on ``side`` to a batch's ``marks`` (None: none); the host's time."""
        if marks is not None:
            marks.append(self._gpu_mark(side))
        return time.perf_counter()

    def issued(self, tl: _timeline.Timeline, batch: int, start: float, copied: float,
               end: float, nbytes: int, transformed: bool, marks: list[Any] | None) -> None:
        """Host-side spans of one batch's issue: copy [start, copied], transform [copied,
        end] (copy [start, end] without a transform), and its GPU marks for later."""
        if self._labelled != tl.serial:
            self._labelled = tl.serial
            if self.gpu:
                tl.label(self.owner, "device", "device stage (host side: issuing copies)")
            if self.owner is self:
                tl.label(self, None, "gpufeed.to_device")
        args = {"batch": batch, "bytes": nbytes}
        if transformed:
            tl.span(self.owner, "device", "copy", start, copied, args)
            tl.span(self.owner, "device", "transform", copied, end, args)
        else:
            tl.span(self.owner, "device", "copy", start, end, args)
        if marks is not None:
            # Its GPU events: before its copies, after them, after its transform (if any).
            self.pending.append((self.owner, batch, nbytes, marks))

    def waited(self, start: float, seconds: float) -> None:
        """``next()`` waited ``seconds`` from ``start`` for an older copy (rule (3))."""
        tl = _timeline.active
        if tl is not None:
            tl.span(self.owner, "device", "wait for a copy", start, start + seconds)

    def _gpu_mark(self, stream: Any) -> tuple[Any, float]:
        """A timed event on ``stream`` now and the host's time just before it was recorded
        (the anchor first, once)."""
        if self._anchor is None:
            self._lo = time.perf_counter()
            self._anchor = self._backend.timed_event(stream)
            self._anchor.synchronize()
            self._hi = time.perf_counter()
        host = time.perf_counter()
        return self._backend.timed_event(stream), host

    def flush(self, tl: _timeline.Timeline | None, *, wait: bool = False) -> None:
        """Record the GPU spans whose events have completed (all of them with ``wait``,
        waiting); without a trace (it stopped) they are dropped."""
        pending = self.pending
        while pending:
            owner, batch, nbytes, marks = pending[0]
            last = marks[-1][0]
            if wait:
                last.synchronize()
            elif not last.query():
                return
            pending.popleft()
            if tl is None or self._anchor is None:
                continue
            since = [self._backend.elapsed_ms(self._anchor, e) / 1e3 for e, _ in marks]
            self._lo = max(self._lo, *(h - d for (_, h), d in zip(marks, since, strict=True)))
            anchor = min(self._lo, self._hi)
            t = [anchor + d for d in since]
            args = {"batch": batch, "bytes": nbytes}
            tl.span(owner, "gpu", "copy", t[0], t[1], args)
            if len(t) > 2:
                tl.span(owner, "gpu", "transform", t[1], t[2], args)
