"""Repeated, like-for-like measurement: medians, spreads, and whether the machine was quiet.

One timed pass of a loader on a shared machine swings by tens of percent (other jobs, page
cache, CPU frequency), so ``gpufeed bench`` and ``gpufeed tune`` never trust one pass:

NOTE [ Repeated measurement ]:
1. Every configuration runs ``runs`` times (21 for ``bench``, 5 for ``tune`` by default); it
   may stop early when the spread of its first ``min_runs_to_stop(runs)`` runs or more (a
   third of ``runs``, at least ``MIN_RUNS`` = 3) is already below ``target_spread``. Three
   runs were not enough to stop on: in four ``bench`` invocations, 4 of the 24 2-worker rows
   (whose runs spread 20-40%) stopped after three runs within 5% of each other, and two of
   the three ratios that then moved by more than 10% between invocations rested on them.
   Runs of different configurations are interleaved (round-robin), so a slow patch of the
   machine hits all of them, not one.
2. A configuration is reported as the **median** of its runs and its **spread**, the range
   from the slowest to the fastest run.
3. Two configurations are called different only when their spreads do not overlap; otherwise
   they are "the same within noise". A ratio of two configurations is taken between their
   *faster halves*: the median of every ratio of one of ``a``'s faster half of runs to one of
   ``b``'s. Interference on a shared machine only ever slows a run down, so the faster runs are
   the least disturbed ones, and half of them (not the single fastest) keeps one lucky run from
   deciding. On the same four back-to-back ``gpufeed bench --runs 7`` invocations on this 2-core
   VM, the largest change of a ratio between consecutive invocations was 24%, 23% and 14% with
   the median of per-round paired ratios, and 15%, 12% and 7% with the faster halves
   (``bench/results/bench-repeat.md``). The ratio carries its own range (slowest over
   fastest, fastest over slowest).
   Why 21 runs for ``bench``: the ratios of 2-worker rows drift with the machine's state over
   minutes, so runs must span more of it. Shorter invocations replayed from seven 21-run ones
   (``python -m bench.repeatability``) had every ratio of an invocation and the
   next within 10% in 74% of pairs with 9 runs per row, 87% with 13, 96% with 17. Real
   21-run invocations agreed so in 10 of 12 consecutive pairs, 9-run ones in 1 of 4
   (``bench/results/bench-repeat.md``).
4. While measuring, :class:`LoadMonitor` reads the CPU time the whole machine used
   (``/proc/stat``) and subtracts what this process tree used: the rest is *other processes*.
   Steal time (a hypervisor running other guests on our CPUs) is read from the same line.
   When either is high the result says "machine busy" (output and JSON) instead of quietly
   recommending from noisy figures.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psutil

from .probe import descendants

__all__ = ["MIN_RUNS", "LoadMonitor", "MachineLoad", "Spread", "min_runs_to_stop", "spreads_text"]

MIN_RUNS = 3
#: other processes using at least this many CPUs on average (or this share of all CPUs) make
#: the machine busy; background daemons of a quiet machine use a few hundredths of one.
BUSY_OTHER_CPUS = 0.25
BUSY_OTHER_SHARE = 0.1
#: CPU steal above this share of all CPU time makes the machine busy.
BUSY_STEAL_SHARE = 0.05


def min_runs_to_stop(runs: int) -> int:
    """Runs that must agree within the target spread before a configuration stops short of
    ``runs``: ``MIN_RUNS``, or a third of ``runs`` when that is more."""
    return max(MIN_RUNS, -(-runs // 3))


@dataclass(frozen=True)
class Spread:
    """Runs of one configuration (a rate: higher is better), their median and range."""

    runs: tuple[float, ...]

    @property
    def median(self) -> float:
        return float(statistics.median(self.runs)) if self.runs else 0.0

    @property
    def lo(self) -> float:
        return min(self.runs) if self.runs else 0.0

    @property
    def hi(self) -> float:
        return max(self.runs) if self.runs else 0.0

    @property
    def rel_spread(self) -> float:
        """``(hi - lo) / median``: 0.1 means the runs span 10% of the median."""
        return (self.hi - self.lo) / self.median if self.median > 0 else 0.0

    def overlaps(self, other: Spread) -> bool:
        """True when the two ranges share a value: not distinguishable from noise."""
        return self.lo <= other.hi and other.lo <= self.hi

    def fastest_half(self) -> tuple[float, ...]:
        """The faster half of the runs (the faster ``ceil(n / 2)``), the least disturbed."""
        return tuple(sorted(self.runs)[len(self.runs) // 2:])

    def ratio(self, other: Spread) -> tuple[float, float, float]:
        """``self / other`` as (ratio of the faster halves, lowest, highest) (NOTE [ Repeated
        measurement ] rule (3)).

        The middle figure is the median of ``x / y`` over every ``x`` of this spread's faster
        half and every ``y`` of the other's; the range stays the conservative one of the two
        spreads.
        """
        if not self.runs or other.median <= 0 or other.lo <= 0:
            return (0.0, 0.0, 0.0)
        mid = float(statistics.median(x / y for x in self.fastest_half()
                                      for y in other.fastest_half()))
        return (mid, self.lo / other.hi, self.hi / other.lo)

    def verdict(self, other: Spread) -> str:
        """"faster", "slower" or "same within noise" (see NOTE [ Repeated measurement ])."""
        if self.overlaps(other):
            return "same within noise"
        return "faster" if self.lo > other.hi else "slower"

    def done(self, runs: int, target_spread: float) -> bool:
        """Whether a configuration measured so far needs no more runs (``runs`` at most; see
        NOTE [ Repeated measurement ] rule (1) for when it may stop early)."""
        n = len(self.runs)
        return n >= runs or (n >= min_runs_to_stop(runs) and self.rel_spread <= target_spread)

    def text(self, fmt: str = ",.0f") -> str:
        """``median (lo-hi)`` for tables."""
        return f"{self.median:{fmt}} ({self.lo:{fmt}}-{self.hi:{fmt}})"

    def to_dict(self) -> dict[str, Any]:
        return {"median": self.median, "lo": self.lo, "hi": self.hi,
                "rel_spread": self.rel_spread, "runs": list(self.runs)}


@dataclass(frozen=True)
class MachineLoad:
    """What else the machine did while we measured.

    Fields:
        seconds: wall time watched.
        cpus: CPUs of the machine.
        other_cpus: CPUs' worth used on average by processes outside this process tree.
        steal_share: share (0-1) of all CPU time stolen by the hypervisor; None where
            ``/proc/stat`` is missing.
    """

    seconds: float
    cpus: int
    other_cpus: float
    steal_share: float | None

    @property
    def busy(self) -> bool:
        limit = max(BUSY_OTHER_CPUS, BUSY_OTHER_SHARE * self.cpus)
        return self.other_cpus >= limit or (self.steal_share or 0.0) >= BUSY_STEAL_SHARE

    @property
    def summary(self) -> str:
        steal = ("" if self.steal_share is None
                 else f", CPU steal {self.steal_share:.0%}")
        what = (f"other processes used {self.other_cpus:.2f} of {self.cpus} CPUs{steal} "
                f"over {self.seconds:.0f} s")
        if self.busy:
            return (f"machine busy: {what}; the figures are noisy and the choice may not hold "
                    "on a quiet machine: rerun when it is idle")
        return f"machine quiet: {what}"

    def to_dict(self) -> dict[str, Any]:
        return {"busy": self.busy, "seconds": self.seconds, "cpus": self.cpus,
                "other_cpus": self.other_cpus, "steal_share": self.steal_share}


def _proc_stat() -> tuple[float, float, float] | None:
    """(busy, steal, total) CPU seconds of the whole machine since boot, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    fields += [0] * (8 - len(fields))
    user, nice, system, idle, iowait, irq, softirq, steal = fields[:8]
    busy = user + nice + system + irq + softirq  # guest time is already inside user
    return busy / hz, steal / hz, (busy + idle + iowait + steal) / hz


def _tree_cpu_s() -> float:
    """CPU seconds of this process, its reaped children and its live descendants (less
    multiprocessing's helpers, which run besides the measurement)."""
    me = psutil.Process()
    t = me.cpu_times()
    total = t.user + t.system + t.children_user + t.children_system
    for kid in descendants(me):
        try:
            k = kid.cpu_times()
        except psutil.Error:
            continue
        total += k.user + k.system
    return total


class LoadMonitor:
    """Watches the machine between :meth:`start` and :meth:`stop` (see point 4 of NOTE
    [ Repeated measurement ]). Workers that exit in between and are reaped count as ours;
    a worker that started before ``start`` and was reaped after counts whole, which can only
    understate the others."""

    def __init__(self, cpus: int | None = None) -> None:
        self.cpus = cpus or os.cpu_count() or 1
        self._t0 = 0.0
        self._stat0: tuple[float, float, float] | None = None
        self._ours0 = 0.0

    def start(self) -> LoadMonitor:
        self._t0 = time.perf_counter()
        self._stat0 = _proc_stat()
        self._ours0 = _tree_cpu_s()
        return self

    def stop(self) -> MachineLoad:
        seconds = max(time.perf_counter() - self._t0, 1e-9)
        ours = _tree_cpu_s() - self._ours0
        stat1 = _proc_stat()
        if self._stat0 is None or stat1 is None:
            return MachineLoad(seconds, self.cpus, 0.0, None)
        busy, steal, total = (b - a for a, b in zip(self._stat0, stat1, strict=True))
        other = max(0.0, busy - ours) / seconds
        return MachineLoad(seconds, self.cpus, other, steal / total if total > 0 else 0.0)


def spreads_text(spreads: Sequence[Spread]) -> str:
    """Runs per configuration, for the header line of a table: "5 runs" or "3-5 runs"."""
    counts = sorted({len(s.runs) for s in spreads})
    if not counts:
        return "no runs"
    return f"{counts[0]} runs" if len(counts) == 1 else f"{counts[0]}-{counts[-1]} runs"
