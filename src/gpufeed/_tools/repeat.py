"""Repeated, like-for-like measurement: medians, spreads, and whether the machine was quiet.

One timed pass of a loader on a shared machine swings by tens of percent (other jobs, page
cache, CPU frequency), so ``gpufeed bench`` and ``gpufeed tune`` never trust one pass:

NOTE [ Repeated measurement ]:
1. Every configuration runs ``runs`` times (21 for ``bench``, 5 for ``tune`` by default); it
   may stop early when the spread of its first ``min_runs_to_stop(runs)`` runs or more (a
   third of ``runs``, at least ``MIN_RUNS`` = 3) is already below ``target_spread``: three
   runs that happen to agree are too few to stop on. Runs of different configurations are
   interleaved (round-robin), so a slow patch of the machine hits all of them, not one.
   ``bench`` runs 21 times because the ratios of 2-worker rows drift with the machine's state
   over minutes, so runs must span more of it.
2. A configuration is reported as the **median** of its runs and its **spread**, the range
   from the slowest to the fastest run.
3. A ratio of two configurations is taken between their *faster halves*: the median of every
   ratio of one of ``a``'s faster half of runs to one of ``b``'s. Interference on a shared
   machine only ever slows a run down, so the faster runs are the least disturbed ones, and half
   of them (not the single fastest) keeps one lucky run from deciding. The ratio carries a 95%
   interval: the 2.5th and 97.5th percentiles of the same ratio over ``BOOTSTRAP_RESAMPLES``
   bootstrap resamples (each row's runs drawn again with replacement, the faster halves and the
   median ratio taken again), seeded, so the same runs give the same interval. The verdict
   follows from it alone: *faster* when the whole interval lies above 1x, *slower* when it lies
   below, *cannot tell* when it holds 1x or a row has fewer than ``VERDICT_RUNS`` (7) runs,
   because a percentile bootstrap is too narrow on few runs.
4. While measuring, :class:`LoadMonitor` reads the CPU time the whole machine used
   (``/proc/stat``) and subtracts what this process tree used: the rest is *other processes*.
   Steal time (a hypervisor running other guests on our CPUs) is read from the same line.
   When either is high the result says "machine busy" (output and JSON) instead of quietly
   recommending from noisy figures.

Measurements: docs/how-it-works/measurements/tools.md#repeated-measurement.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psutil

from .probe import descendants

MIN_RUNS = 3
#: runs each row needs before a ratio's verdict may say faster or slower (rule (3))
VERDICT_RUNS = 7
#: bootstrap resamples behind a ratio's 95% interval (rule (3)): the interval's ends move by
#: about 1% between seeds at 2000 (tests/tools/test_repeat.py)
BOOTSTRAP_RESAMPLES = 2000
_LEVEL = 0.95
#: other processes using at least this many CPUs on average (or this share of all CPUs) make
#: the machine busy; background daemons of a quiet machine use a few hundredths of one.
BUSY_OTHER_CPUS = 0.25
BUSY_OTHER_SHARE = 0.1
#: CPU steal above this share of all CPU time makes the machine busy.
BUSY_STEAL_SHARE = 0.05


def min_runs_to_stop(runs: int) -> int:
    """Runs that must agree before a configuration stops short of ``runs`` (rule (1))."""
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

    def ratio(self, other: Spread) -> Ratio:
        """``self / other`` with its 95% bootstrap interval and verdict (NOTE [ Repeated
        measurement ] rule (3)); all zeros when either side has no run (or a run of no speed)."""
        if not self.runs or not other.runs or min(self.runs) <= 0 or other.lo <= 0:
            return Ratio(0.0, 0.0, 0.0, len(self.runs), len(other.runs))
        mid = _faster_half_ratio(self.runs, other.runs)
        lo, hi = _bootstrap_interval(self.runs, other.runs)
        return Ratio(mid, min(lo, mid), max(hi, mid), len(self.runs), len(other.runs))

    def done(self, runs: int, target_spread: float) -> bool:
        """Whether no more runs are needed (NOTE [ Repeated measurement ] rule (1))."""
        n = len(self.runs)
        return n >= runs or (n >= min_runs_to_stop(runs) and self.rel_spread <= target_spread)

    def text(self, fmt: str = ",.0f") -> str:
        """``median (lo-hi)`` for tables."""
        return f"{self.median:{fmt}} ({self.lo:{fmt}}-{self.hi:{fmt}})"

    def to_dict(self) -> dict[str, Any]:
        return {"median": self.median, "lo": self.lo, "hi": self.hi,
                "rel_spread": self.rel_spread, "runs": list(self.runs)}


def _faster_half_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """The median of ``x / y`` over the faster halves of ``a`` and ``b`` (rule (3))."""
    fa, fb = sorted(a)[len(a) // 2:], sorted(b)[len(b) // 2:]
    return float(statistics.median([x / y for x in fa for y in fb]))


def _bootstrap_interval(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """The 95% percentile-bootstrap interval of :func:`_faster_half_ratio` (rule (3))."""
    rng = random.Random(0)
    draws = sorted(_faster_half_ratio(rng.choices(a, k=len(a)), rng.choices(b, k=len(b)))
                   for _ in range(BOOTSTRAP_RESAMPLES))
    tail = (1.0 - _LEVEL) / 2
    return draws[int(tail * (len(draws) - 1))], draws[int((1.0 - tail) * (len(draws) - 1))]


@dataclass(frozen=True)
class Ratio:
    """``a / b`` of two measured rates (NOTE [ Repeated measurement ] rule (3)).

    Fields:
        mid: the figure reported, the median ratio of the faster halves.
        lo, hi: its 95% bootstrap interval.
        runs_a, runs_b: the runs behind each side.
    """

    mid: float
    lo: float
    hi: float
    runs_a: int
    runs_b: int

    @property
    def verdict(self) -> str:
        """"faster" (the whole interval above 1x), "slower" (below 1x) or "cannot tell"."""
        if min(self.runs_a, self.runs_b) < VERDICT_RUNS or self.lo <= 1.0 <= self.hi:
            return "cannot tell"
        return "faster" if self.lo > 1.0 else "slower"

    @property
    def why(self) -> str:
        """The verdict's reason, in words: "the 95% interval lies above 1x"."""
        runs = min(self.runs_a, self.runs_b)
        if runs < VERDICT_RUNS:
            return (f"{runs} run{'s' if runs != 1 else ''} of a row: a verdict needs "
                    f"{VERDICT_RUNS} (--runs {VERDICT_RUNS} or more)")
        where = ("lies above 1x" if self.lo > 1.0 else "lies below 1x" if self.hi < 1.0
                 else "holds 1x")
        return f"the 95% interval {where}"

    def text(self) -> str:
        """``3.02x (2.71-3.32)`` for tables."""
        return f"{self.mid:.2f}x ({self.lo:.2f}-{self.hi:.2f})"

    def to_dict(self) -> dict[str, Any]:
        return {"ratio": self.mid, "ratio_lo": self.lo, "ratio_hi": self.hi,
                "interval": "95% bootstrap", "verdict": self.verdict, "why": self.why}


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
        steal = "" if self.steal_share is None else f", CPU steal {self.steal_share:.0%}"
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
    """Watches the machine from its creation to :meth:`stop` (NOTE [ Repeated measurement ]
    (4)). A worker reaped in between counts as ours, whole even if it started before: that can
    only understate the others."""

    def __init__(self, cpus: int | None = None) -> None:
        self.cpus = cpus or os.cpu_count() or 1
        self._t0 = time.perf_counter()
        self._stat0 = _proc_stat()
        self._ours0 = _tree_cpu_s()

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
