"""One tuner trial: a loader configuration measured repeatedly, with its memory peaks and the
share of a training step's loop it spends waiting for data.

Runs of a trial follow NOTE [ Repeated measurement ] (``_tools/repeat.py``); the trial reports
their median rate and range. With a ``step`` (the user's training step, or a sleep of
``--step-ms``) every batch is handed to it as a training loop would; the time between the end
of one step and the next batch is the loop's *wait*, and ``input_bound = wait / (wait + step)``
over the timed batches: near 0 for a loader that keeps up with the step, whatever its raw
throughput.
"""

from __future__ import annotations

import logging
import statistics
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import psutil

from .._base.stats import human_bytes, input_bound_share
from .._base.system import TreeCpu
from .._host.config import WorkerType
from . import measure as _measure
from .probe import descendants, process_tree_pss, shm_usage
from .repeat import Spread

log = logging.getLogger(__name__)
#: seconds between the PSS samples a run's ``consume`` hook takes after the warm-up.
PSS_EVERY_S = 0.25
#: seconds between its reads of the process tree's CPU time
CPU_EVERY_S = 0.2


#: what torch's default collate says when samples differ in size
RAGGED_ERRORS = ("stack expects each tensor to be equal size", "resize", "equal size",
                 "must match the size")
#: the fix ``gpufeed tune`` and ``gpufeed bench`` give for such samples
COLLATE_FIX = ("samples of different sizes need a collate_fn that pads them "
               "(--collate MODULE:FUNCTION, or collate_fn=)")


def ragged(text: str) -> bool:
    """Whether an error says the default collate could not stack samples of different sizes."""
    return any(s in text for s in RAGGED_ERRORS)


def kwargs_text(kwargs: dict[str, Any]) -> str:
    """Keyword arguments as Python source: ``num_workers=2, pin_memory=False``."""
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


@dataclass(frozen=True)
class Budget:
    """Limits a trial must stay within; None means "no limit".

    Fields:
        memory_bytes: peak PSS of the process tree (this process and its workers).
        shm_bytes: growth of /dev/shm use during the trial.
        pinned_bytes: page-locked host memory (CUDA only).
    """

    memory_bytes: int | None = None
    shm_bytes: int | None = None
    pinned_bytes: int | None = None

    @classmethod
    def default(cls) -> Budget:
        """80% of what this machine can give now: available RAM plus this tree's PSS, and free
        /dev/shm."""
        shm = shm_usage()
        mem = psutil.virtual_memory().available + process_tree_pss()
        return cls(memory_bytes=int(0.8 * mem),
                   shm_bytes=int(0.8 * shm[1]) if shm is not None else None)


@dataclass(frozen=True)
class Trial:
    """One measured configuration. ``samples_per_s`` is the median of ``runs`` (the rate of
    each run). Bytes are peaks over the runs: ``peak_pss_bytes`` of the process tree,
    ``shm_bytes`` the growth of /dev/shm use (machine-wide: other programs count too),
    ``pinned_bytes`` with CUDA only. ``input_bound``: share (0-1) of the loop spent waiting for
    data when a step was given, else None. ``cpu_cores``: cores the process tree used over
    the timed batches (mean over runs; None when not measured), which the tuner's model reads
    (NOTE [ What a worker costs ] in ``_host/cost.py``). ``note`` says why a trial was
    rejected ("" if not)."""

    num_workers: int
    worker_type: WorkerType | None
    prefetch_factor: int | None
    pin_memory: bool
    samples_per_s: float
    first_batch_s: float
    peak_pss_bytes: int
    shm_bytes: int
    pinned_bytes: int
    accepted: bool
    note: str = ""
    runs: tuple[float, ...] = field(default=())
    input_bound: float | None = None
    cpu_cores: float | None = None

    @property
    def spread(self) -> Spread:
        """The runs as a :class:`Spread` (one run at ``samples_per_s`` when none recorded)."""
        return Spread(self.runs or (self.samples_per_s,))

    @property
    def kwargs(self) -> dict[str, Any]:
        """DataLoader keyword arguments of this configuration."""
        out: dict[str, Any] = {"num_workers": self.num_workers}
        if self.num_workers > 0:
            out.update(worker_type=self.worker_type, prefetch_factor=self.prefetch_factor)
        out["pin_memory"] = self.pin_memory
        return out


class _Run:
    """The ``consume`` hook of one run: the user's step, and after the warm-up its time and the
    loop's wait (see the module docstring); the memory gauges every batch, and after the warm-up
    the tree's PSS every ``PSS_EVERY_S`` (a sample costs a few ms: about 2% of a run's time) and
    its CPU time every ``CPU_EVERY_S``: ``measure_loader``'s sampler thread can miss the peak of
    a short run."""

    def __init__(self, step: Callable[[Any], object] | None, warmup: int) -> None:
        self.step, self.warmup = step, warmup
        self.batches = 0
        self.wait_s = self.step_s = 0.0
        self.peaks = _measure.PeakSampler(gauges=True)
        self.tree = TreeCpu()
        self.cpu_first: tuple[float, float] | None = None
        self.cpu_last: tuple[float, float] | None = None
        self._step_end: float | None = None

    def __call__(self, batch: Any) -> None:
        t0 = time.perf_counter()
        if self.step is not None:
            self.step(batch)
            t1 = time.perf_counter()
            if self.batches >= self.warmup and self._step_end is not None:
                self.wait_s += t0 - self._step_end
                self.step_s += t1 - t0
        self.batches += 1
        self.peaks.sample_gauges()
        if self.batches >= self.warmup:
            self.peaks.maybe_sample(PSS_EVERY_S)
            now = time.perf_counter()
            if self.cpu_last is None or now - self.cpu_last[0] >= CPU_EVERY_S:
                self.cpu_last = (now, self.tree.read(p.pid for p in descendants()).total)
                self.cpu_first = self.cpu_first or self.cpu_last
        self._step_end = time.perf_counter()

    @property
    def cores(self) -> float | None:
        """Cores the process tree used between the first and the last CPU reading."""
        first, last = self.cpu_first, self.cpu_last
        if first is None or last is None or last[0] <= first[0]:
            return None
        return (last[1] - first[1]) / (last[0] - first[0])


def run_trial(dataset: Any, factory: Callable[..., Iterable[Any]], batch_size: int,
              collate_fn: Callable[[Any], Any] | None, step: Callable[[Any], object] | None,
              budget: Budget, seconds: float, n: int, kind: WorkerType | None, pf: int | None,
              pin: bool, *, runs: int = 5, target_spread: float = 0.05) -> Trial:
    """Measure one configuration ``runs`` times (see the module docstring)."""
    kwargs: dict[str, Any] = {"batch_size": batch_size, "num_workers": n, "pin_memory": pin}
    if collate_fn is not None:
        kwargs["collate_fn"] = collate_fn
    if n:
        kwargs.update(worker_type=kind, prefetch_factor=pf)
    warmup = max(2, n)
    rates: list[float] = []
    firsts: list[float] = []
    pss = shm = pinned = 0
    wait_s = step_s = 0.0
    cores: list[float] = []
    while not Spread(tuple(rates)).done(runs, target_spread):
        run = _Run(step, warmup)
        try:
            with warnings.catch_warnings():  # trying more workers than CPUs is the point here
                warnings.filterwarnings("ignore", message="This DataLoader will create",
                                        category=UserWarning)
                m = _measure.measure_loader(lambda: factory(dataset, **kwargs),
                                            max_seconds=seconds, warmup_batches=warmup,
                                            consume=run, sample_held=False)  # the budget is on PSS
        except Exception as exc:  # a failing configuration is a result, not the end of the search
            log.warning("trial %s failed: %s: %s", kwargs_text(kwargs), type(exc).__name__, exc)
            first = (str(exc).strip().splitlines() or [""])[0]  # not the worker's traceback
            return Trial(n, kind, pf, pin, 0.0, 0.0, 0, 0, 0, False,
                         f"failed: {type(exc).__name__}: {first}"[:200])
        rates.append(m.samples_per_s)
        firsts.append(m.first_batch_s)
        shm = max(shm, run.peaks.shm_used - run.peaks.shm_start)
        pss = max(pss, m.peak_pss_bytes, run.peaks.peak.pss)
        pinned = max(pinned, run.peaks.pinned)
        wait_s, step_s = wait_s + run.wait_s, step_s + run.step_s
        if run.cores is not None:
            cores.append(run.cores)
        over = _over(budget, pss, shm, pinned)
        if over:  # more runs cannot bring a peak down
            break
    bound = input_bound_share(wait_s, step_s) if step is not None else None
    spread = Spread(tuple(rates))
    return Trial(n, kind, pf, pin, spread.median, statistics.median_high(firsts), pss, shm,
                 pinned, not over, ("over budget: " + ", ".join(over)) if over else "",
                 runs=spread.runs, input_bound=bound,
                 cpu_cores=sum(cores) / len(cores) if cores else None)


def _over(budget: Budget, pss: int, shm: int, pinned: int) -> list[str]:
    return [f"{what} {human_bytes(have)} > {human_bytes(limit)}"
            for what, have, limit in (("PSS", pss, budget.memory_bytes),
                                      ("shm", shm, budget.shm_bytes),
                                      ("pinned", pinned, budget.pinned_bytes))
            if limit is not None and have > limit]
