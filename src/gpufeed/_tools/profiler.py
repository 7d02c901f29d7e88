"""Profiler: is the training loop waiting for data?

Wraps any iterable (gpufeed's loader, the stock ``torch.utils.data.DataLoader``, a generator)
and times, for every step, how long ``next()`` blocked ("wait") and how long the user's code ran
until it asked for the next batch ("compute")::

    with gpufeed.tools.Profiler() as prof:
        for batch in prof.wrap(loader):
            train_step(batch)
    print(prof.report())          # ... input-bound: 37% ...

    report = gpufeed.profile(loader, train_step, max_steps=200)

NOTE [ GPU idle time ]: with CUDA, an event is recorded on the current stream when a step ends
(the loop asks for data) and another when the next batch is handed over. The GPU time between
the two is exactly how long the GPU sat idle for lack of data: if it was still busy with the
previous step's kernels when the batch arrived, both events complete back to back (0 ms).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from .._base import timeline as _timeline
from .._base.stats import LoaderStats, format_table, input_bound_share, percentile

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class ProfileReport:
    """What a profiled loop did. Times in seconds; fractions in 0-1.

    Fields:
        steps: steps measured (after the ``warmup_steps`` left out).
        wall_s: wall time of the measured steps (wait plus compute).
        wait_s: total time blocked in ``next()`` waiting for data.
        compute_s: total time in the user's code between batches.
        input_bound: ``wait_s / wall_s``, the share of the loop spent waiting for data (the
            one input-bound figure a profile prints: its ``loader_stats`` table leaves out
            the loader's own, which covers the loader's whole life, not these steps).
        wait_p50_s, wait_p90_s, wait_p99_s: per-step wait percentiles.
        compute_p50_s, compute_p90_s, compute_p99_s: per-step compute percentiles.
        startup_s: wait for the first batch (worker start-up included), always reported.
        gpu_idle_s: GPU idle time between steps (see NOTE [ GPU idle time ]); None without CUDA.
        gpu_idle_fraction: ``gpu_idle_s / wall_s``; None without CUDA.
        loader_stats: ``loader.stats()`` of the wrapped loader when it has one (gpufeed's),
            printed with a line on what each figure means and, when many batches missed the
            slot ring, the cause and the fix; None for other iterables.
    """

    steps: int
    wall_s: float
    wait_s: float
    compute_s: float
    input_bound: float
    wait_p50_s: float
    wait_p90_s: float
    wait_p99_s: float
    compute_p50_s: float
    compute_p90_s: float
    compute_p99_s: float
    startup_s: float
    gpu_idle_s: float | None = None
    gpu_idle_fraction: float | None = None
    loader_stats: LoaderStats | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-ready)."""
        out = asdict(self)
        out["loader_stats"] = self.loader_stats.to_dict() if self.loader_stats else None
        return out

    @property
    def verdict(self) -> str:
        """One line for people: input-bound, compute-bound or in between."""
        if self.steps == 0:
            return "no steps measured"
        if self.input_bound >= 0.2:
            return ("the loop waits for data: try more workers (gpufeed tune), "
                    "a faster source or lighter transforms")
        if self.input_bound >= 0.05:
            return "the loop sometimes waits for data: a little more prefetch may help"
        return "compute-bound: the input pipeline keeps up"

    def __str__(self) -> str:
        ms = 1e3
        rows = [
            ["wait for data", f"{self.wait_s:.3f}", f"{self.wait_p50_s * ms:.2f}",
             f"{self.wait_p90_s * ms:.2f}", f"{self.wait_p99_s * ms:.2f}"],
            ["compute", f"{self.compute_s:.3f}", f"{self.compute_p50_s * ms:.2f}",
             f"{self.compute_p90_s * ms:.2f}", f"{self.compute_p99_s * ms:.2f}"],
        ]
        lines = [
            f"gpufeed profile: {self.steps} steps in {self.wall_s:.2f} s "
            f"(first batch after {self.startup_s:.2f} s, not counted)",
            format_table(["per step", "total s", "p50 ms", "p90 ms", "p99 ms"], rows),
            f"input-bound: {self.input_bound:.0%}",
        ]
        if self.gpu_idle_s is not None and self.gpu_idle_fraction is not None:
            lines.append(f"GPU idle between steps: {self.gpu_idle_s:.3f} s "
                         f"({self.gpu_idle_fraction:.0%} of wall time)")
        lines.append(f"verdict: {self.verdict}")
        if self.loader_stats is not None:
            lines += ["", self.loader_stats.render(input_bound=False), "",
                      "what the figures mean:",
                      *(f"  {line}" for line in self.loader_stats.explain().splitlines())]
        return "\n".join(lines)


class _CudaGaps:
    """Pairs of CUDA events around each wait (see NOTE [ GPU idle time ]).

    ``event_factory`` and ``synchronize`` default to torch's and are injectable for tests.
    """

    def __init__(self, event_factory: Callable[[], Any] | None = None,
                 synchronize: Callable[[], None] | None = None) -> None:
        import torch

        self._event = event_factory or (lambda: torch.cuda.Event(enable_timing=True))
        self._sync = synchronize or torch.cuda.synchronize
        self._pairs: list[tuple[Any, Any]] = []
        self._open: Any = None

    def step_ended(self) -> None:
        self._open = self._event()
        self._open.record()

    def batch_ready(self, measured: bool) -> None:
        if self._open is None:
            return
        end = self._event()
        end.record()
        if measured:
            self._pairs.append((self._open, end))
        self._open = None

    def idle_s(self) -> float:
        if not self._pairs:
            return 0.0
        self._sync()
        return sum(a.elapsed_time(b) for a, b in self._pairs) / 1e3  # elapsed_time is in ms


class Profiler:
    """Times a training loop's waits for data and its compute.

    Args:
        warmup_steps: steps left out of the figures (>= 1): the first batch's wait includes
            worker start-up, which would make a short profile look input-bound. It is
            reported apart as ``startup_s``. More warm-up hides more start-up noise but
            needs a longer run.
        max_steps: stop the wrapped iterable after this many steps (warm-up included);
            None runs it to the end.
        cuda: measure GPU idle time with CUDA events; None means "if CUDA is available".
            Costs two events per step and one synchronize at ``report()``.
    """

    def __init__(self, *, warmup_steps: int = 1, max_steps: int | None = None,
                 cuda: bool | None = None, _cuda_gaps: _CudaGaps | None = None) -> None:
        if not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"warmup_steps must be an int >= 1 (the first wait includes "
                             f"start-up), got {warmup_steps!r}")
        if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 1):
            raise ValueError(f"max_steps must be a positive int or None, got {max_steps!r}")
        self._warmup = warmup_steps
        self._max_steps = max_steps
        if _cuda_gaps is None and cuda is not False:
            import torch

            if torch.cuda.is_available():
                _cuda_gaps = _CudaGaps()
            elif cuda:
                raise ValueError("cuda=True but torch.cuda.is_available() is False; "
                                 "pass cuda=None to measure the GPU only when there is one")
        self._gaps = _cuda_gaps
        self._waits: list[float] = []
        self._computes: list[float] = []
        self._startup = 0.0
        self._taken = 0
        self._last: float | None = None  # when the last batch was handed over
        self._stats: Callable[[], Any] | None = None  # the wrapped loader's stats()

    def __enter__(self) -> Profiler:
        return self

    def __exit__(self, *exc: object) -> None:
        self._end_step(time.perf_counter())

    def wrap(self, iterable: Iterable[T]) -> Iterator[T]:
        """Return an iterator over ``iterable`` that times each step of the loop around it."""
        stats = getattr(iterable, "stats", None)
        if callable(stats):
            self._stats = stats
        return self._timed(iter(iterable))

    def _timed(self, it: Iterator[T]) -> Iterator[T]:
        """Timestamps every ``next()``; the time between two calls is compute."""
        while True:
            t0 = time.perf_counter()
            last = self._last
            self._end_step(t0)
            if self._max_steps is not None and self._taken >= self._max_steps:
                return
            try:
                item = next(it)
            except StopIteration:
                self._last = None
                return
            t1 = time.perf_counter()
            self._got_batch(t1 - t0, t1)
            tl = _timeline.active
            if tl is not None and self._stats is None:  # not gpufeed's: its loop's waits and steps
                tl.label(self, None, "your loop (gpufeed.tools.Profiler)")
                tl.handout(self, self._taken - 1, 0, last or 0.0, t0, t1, t1)
            yield item

    def _end_step(self, now: float) -> None:
        if self._last is None:
            return
        if self._taken > self._warmup:
            self._computes.append(now - self._last)
        self._last = None
        if self._gaps is not None:
            self._gaps.step_ended()

    def _got_batch(self, wait: float, now: float) -> None:
        self._taken += 1
        measured = self._taken > self._warmup
        if self._taken == 1:
            self._startup = wait
        elif measured:
            self._waits.append(wait)
        if self._gaps is not None:
            self._gaps.batch_ready(measured)
        self._last = now

    def report(self) -> ProfileReport:
        """Figures so far; a step still running is closed at this moment."""
        self._end_step(time.perf_counter())
        n = min(len(self._waits), len(self._computes))
        waits, computes = sorted(self._waits[:n]), sorted(self._computes[:n])
        wait_s, compute_s = sum(waits), sum(computes)
        wall = wait_s + compute_s
        idle = self._gaps.idle_s() if self._gaps is not None else None
        if n == 0:
            log.warning("profiler measured no steps: run more than warmup_steps=%d steps",
                        self._warmup)
        return ProfileReport(
            steps=n, wall_s=wall, wait_s=wait_s, compute_s=compute_s,
            input_bound=input_bound_share(wait_s, compute_s) or 0.0,
            wait_p50_s=percentile(waits, 50), wait_p90_s=percentile(waits, 90),
            wait_p99_s=percentile(waits, 99),
            compute_p50_s=percentile(computes, 50), compute_p90_s=percentile(computes, 90),
            compute_p99_s=percentile(computes, 99),
            startup_s=self._startup, gpu_idle_s=idle,
            gpu_idle_fraction=(idle / wall if wall > 0 else 0.0) if idle is not None else None,
            loader_stats=self._loader_stats(),
        )

    def _loader_stats(self) -> LoaderStats | None:
        if self._stats is None:
            return None
        try:
            snap = self._stats()
        except Exception as exc:  # a loader's stats must not cost the profile
            log.warning("could not read the loader's stats(): %s: %s", type(exc).__name__, exc)
            return None
        return snap if isinstance(snap, LoaderStats) else None


def profile(iterable: Iterable[T], step: Callable[[T], object], *,
            max_steps: int | None = None, warmup_steps: int = 1,
            cuda: bool | None = None) -> ProfileReport:
    """Run ``step(batch)`` for each batch of ``iterable`` under a :class:`Profiler`.

    Args:
        iterable: any iterable of batches (a gpufeed or stock DataLoader, a generator).
        step: the training step, called once per batch.
        max_steps: stop after this many steps (warm-up included); None runs to the end.
        warmup_steps: first steps left out of the figures (see :class:`Profiler`).
        cuda: measure GPU idle time; None means "if CUDA is available".
    """
    if not callable(step):
        raise TypeError(f"step must be callable as step(batch), got {type(step).__name__}")
    with Profiler(warmup_steps=warmup_steps, max_steps=max_steps, cuda=cuda) as prof:
        for batch in prof.wrap(iterable):
            step(batch)
    return prof.report()
