"""Tuner: measure short trials of loader settings and recommend the smallest good one.

Search (each trial is one ``measure_loader`` run of about ``trial_seconds``):

1. ``num_workers=0`` once, then for each worker type the worker ladder 1, 2, 4, ... (up to
   twice the usable CPUs, since threads blocked on I/O or in GIL-free code can outnumber cores).
   A type's ladder stops as soon as more workers stop helping (less than ``tolerance`` gain over
   that type's best) or a trial goes over the memory budget (more workers only cost more).
2. Around the fastest trial: the other prefetch factors (None: the loader's default, which
   in gpufeed adapts to cheap batches), and ``pin_memory=True`` when CUDA is
   available (without a GPU pinning only costs).

Memory per trial: peak PSS of the process tree (shared and pinned pages that are mapped count
once, proportionally), growth of /dev/shm use, and pinned host bytes (CUDA only). A trial over
any part of the :class:`Budget` is rejected. The recommendation is the *smallest* accepted
configuration (fewest workers, then the default or lowest prefetch, no pinning, least memory)
whose throughput is within ``tolerance`` of the best: extra workers that buy 2% cost RAM and CPU
the training needs.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

from . import _measure
from ._stats import format_table

__all__ = ["Budget", "Trial", "TuneResult", "parse_bytes", "require_matplotlib", "tune"]

log = logging.getLogger(__name__)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "t": 1e12, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | float | str) -> int:
    """Bytes from an int or a string such as "512MiB", "8GB" or "1.5g" (k/m/g are powers of 10)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return int(value)
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    if m is None or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"cannot read {value!r} as a size in bytes; write e.g. 8GiB, 512MB or "
                         "an int of bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def require_matplotlib() -> Any:
    """Import matplotlib (non-interactive backend) or say how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("plots need matplotlib: pip install 'gpufeed[plot]' "
                          "(or leave out --plot)") from exc
    return plt


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
        free_shm = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else None
        mem = psutil.virtual_memory().available + _measure.process_tree_pss()
        return cls(memory_bytes=int(0.8 * mem),
                   shm_bytes=int(0.8 * free_shm) if free_shm is not None else None)


@dataclass(frozen=True)
class Trial:
    """One measured configuration. Bytes are peaks during the trial: ``peak_pss_bytes`` of the
    process tree, ``shm_bytes`` the growth of /dev/shm use (machine-wide: other programs count
    too), ``pinned_bytes`` with CUDA only. ``note`` says why a trial was rejected ("" if not)."""

    num_workers: int
    worker_type: str | None
    prefetch_factor: int | None
    pin_memory: bool
    samples_per_s: float
    first_batch_s: float
    peak_pss_bytes: int
    shm_bytes: int
    pinned_bytes: int
    accepted: bool
    note: str = ""

    @property
    def kwargs(self) -> dict[str, Any]:
        """DataLoader keyword arguments of this configuration."""
        out: dict[str, Any] = {"num_workers": self.num_workers}
        if self.num_workers > 0:
            out.update(worker_type=self.worker_type, prefetch_factor=self.prefetch_factor)
        out["pin_memory"] = self.pin_memory
        return out


def _kwargs_text(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


@dataclass(frozen=True)
class TuneResult:
    """The measured table and the recommendation.

    Fields:
        trials: every trial in the order run, rejected ones included.
        recommended: DataLoader keyword arguments of ``chosen``, ready to paste.
        chosen: the smallest accepted trial within ``tolerance`` of ``best``.
        best: the fastest accepted trial.
        tolerance: the fraction used (0.05 = within 5%).
        budget: the limits the trials were held to.
        elapsed_s: wall time of the whole search.
        out_of_time: True when ``time_budget_s`` cut the search short.
    """

    trials: tuple[Trial, ...]
    recommended: dict[str, Any]
    chosen: Trial
    best: Trial
    tolerance: float
    budget: Budget
    elapsed_s: float
    out_of_time: bool = False

    @property
    def kwargs_text(self) -> str:
        """The recommendation as Python keyword arguments: ``num_workers=2, ...``."""
        return _kwargs_text(self.recommended)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``recommended`` (kwargs) and ``trials`` (one row per trial)."""
        return {"recommended": dict(self.recommended),
                "trials": [asdict(t) for t in self.trials],
                "best": self.best.kwargs, "tolerance": self.tolerance,
                "budget": asdict(self.budget), "elapsed_s": self.elapsed_s,
                "out_of_time": self.out_of_time}

    def write_json(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def __str__(self) -> str:
        mib = 1 << 20
        rows = [[t.worker_type or "-", t.num_workers,
                 t.prefetch_factor or ("default" if t.num_workers else "-"),
                 "yes" if t.pin_memory else "no", f"{t.samples_per_s:,.0f}",
                 f"{t.peak_pss_bytes / mib:,.0f}", f"{t.shm_bytes / mib:,.0f}",
                 ("* " if t is self.chosen else "") + (t.note or "ok")] for t in self.trials]
        table = format_table(["type", "workers", "prefetch", "pin", "samples/s", "PSS MiB",
                              "shm MiB", "result"], rows, left=2)
        gain = self.best.samples_per_s / max(self.chosen.samples_per_s, 1e-9) - 1
        return (f"gpufeed tune: {len(self.trials)} trials in {self.elapsed_s:.1f} s"
                + (" (time budget reached)" if self.out_of_time else "") + f"\n{table}\n"
                f"recommended (* above; the fastest is {gain:.1%} faster): "
                f"DataLoader(dataset, batch_size=..., {self.kwargs_text})")

    def plot(self, path: str | os.PathLike[str]) -> None:
        """Samples/s against num_workers per worker type (needs matplotlib)."""
        plt = require_matplotlib()
        fig, ax = plt.subplots(figsize=(6, 4))
        for kind in sorted({t.worker_type or "-" for t in self.trials}):
            pts = sorted((t.num_workers, t.samples_per_s) for t in self.trials
                         if (t.worker_type or "-") in (kind, "-") and t.accepted)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=kind)
        ax.set(xlabel="num_workers", ylabel="samples/s", title="gpufeed tune")
        ax.legend()
        fig.savefig(path, bbox_inches="tight")
        plt.close(fig)


class _Peaks:
    """``consume`` hook of a trial: runs the user's step, then samples /dev/shm use and pinned
    bytes every batch, and the process tree's PSS once the warm-up is over and then every
    ``pss_every_s`` (a sample costs a few ms: about 2% of a trial's time). This complements
    ``measure_loader``'s sampler thread, which can miss the peak of a short trial."""

    def __init__(self, step: Callable[[Any], object] | None, warmup: int,
                 pss_every_s: float = 0.25) -> None:
        self.step = step
        self.shm0 = self.shm = self._shm_used()
        self.pinned = self.pss = self.batches = 0
        self.warmup, self.every, self.next_pss = warmup, pss_every_s, 0.0
        self.cuda = torch.cuda.is_available() and hasattr(torch.cuda, "host_memory_stats")

    @staticmethod
    def _shm_used() -> int:
        try:
            u = shutil.disk_usage("/dev/shm")
        except OSError:
            return 0
        return u.total - u.free

    def __call__(self, batch: Any) -> None:
        if self.step is not None:
            self.step(batch)
        self.batches += 1
        self.shm = max(self.shm, self._shm_used())
        if self.cuda:
            self.pinned = max(self.pinned, _pinned_bytes())
        now = time.perf_counter()
        if self.batches >= self.warmup and now >= self.next_pss:
            self.pss = max(self.pss, _measure.process_tree_pss())
            self.next_pss = now + self.every


def _pinned_bytes() -> int:
    """Pinned host bytes: torch's caching host allocator plus regions gpufeed registered
    (``_pinning.registered_bytes()``, where the device module provides it)."""
    from . import _pinning

    registered = getattr(_pinning, "registered_bytes", None)
    stats = torch.cuda.host_memory_stats()
    return int(stats.get("allocated_bytes.current", 0)) + (int(registered()) if registered else 0)


def _usable_cpus() -> int:
    getter = getattr(os, "sched_getaffinity", None)
    return len(getter(0)) if getter is not None else (os.cpu_count() or 1)


def tune(dataset: Any, *, batch_size: int, collate_fn: Callable[[Any], Any] | None = None,
         step: Callable[[Any], object] | None = None, budget: Budget | int | str | None = None,
         worker_types: Sequence[str] = ("process", "thread"),
         num_workers: Sequence[int] | None = None,
         prefetch_factors: Sequence[int | None] = (None, 4),
         pin_memory: Sequence[bool] | None = None, tolerance: float = 0.05,
         trial_seconds: float = 2.0, time_budget_s: float = 120.0,
         loader_factory: Callable[..., Iterable[Any]] | None = None,
         progress: Callable[[Trial], None] | None = None) -> TuneResult:
    """Measure loader settings on ``dataset`` and recommend the smallest good one.

    Args:
        dataset: the map-style or iterable dataset to load.
        batch_size: samples per batch, as in training.
        collate_fn: passed to the loader (None: its default).
        step: called on every batch, as the training step would be; its time counts. None
            measures the loader alone (the upper bound of what it can deliver).
        budget: a :class:`Budget`, or a memory limit in bytes (int or "8GiB"). None: 80% of
            the available RAM and free /dev/shm.
        worker_types: worker kinds to try: "process" (parallel Python, pickles the dataset)
            and/or "thread" (cheap start and memory; scales only where the GIL is released).
        num_workers: worker counts to try, ascending; None: 0, 1, 2, 4, ... up to twice the
            usable CPUs. The ladder stops early once more workers stop helping.
        prefetch_factors: batches in flight per worker to try; the first is the one used
            while sweeping workers. None is the loader's default (gpufeed: at least 2, more
            for cheap batches; stock: 2). Deeper prefetch hides jitter and costs memory.
        pin_memory: values to try; None: (False, True) with CUDA, (False,) without.
        tolerance: the recommendation is the smallest trial within this fraction of the best.
        trial_seconds: timed seconds per trial (after warm-up). Longer is steadier, slower.
        time_budget_s: no trial starts after this many seconds; the result says so.
        loader_factory: builds a loader from (dataset, batch_size=..., num_workers=...,
            pin_memory=..., and with workers worker_type=..., prefetch_factor=...); default
            ``gpufeed.DataLoader``.
        progress: called with each finished :class:`Trial` (for progress bars).
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance is a fraction in [0, 1), e.g. 0.05; got {tolerance!r}")
    bad = [w for w in worker_types if w not in ("process", "thread")]
    if bad or not worker_types:
        raise ValueError(f"worker_types must name 'process' and/or 'thread', got {worker_types!r}")
    if not prefetch_factors or any(
            pf is not None and (isinstance(pf, bool) or not isinstance(pf, int) or pf < 1)
            for pf in prefetch_factors):
        raise ValueError(f"prefetch_factors must be positive ints or None (the loader's "
                         f"default), got {prefetch_factors!r}")
    if loader_factory is None:
        import gpufeed

        loader_factory = gpufeed.DataLoader
    if budget is None:
        budget = Budget.default()
    elif not isinstance(budget, Budget):
        budget = Budget(memory_bytes=parse_bytes(budget))
    ladder = list(num_workers) if num_workers is not None else [0] + [
        2**i for i in range(8) if 2**i <= 2 * _usable_cpus()]
    pins = tuple(pin_memory) if pin_memory is not None else (
        (False, True) if torch.cuda.is_available() else (False,))
    t_start = time.perf_counter()
    trials: list[Trial] = []
    done: dict[tuple[Any, ...], Trial] = {}
    skipped: list[tuple[Any, ...]] = []

    def run(n: int, kind: str | None, pf: int | None, pin: bool) -> Trial | None:
        key = (n, kind if n else None, pf if n else None, pin)
        if key in done:
            return done[key]
        if trials and time.perf_counter() - t_start > time_budget_s:
            skipped.append(key)
            return None
        trial = _run_trial(dataset, loader_factory, batch_size, collate_fn, step, budget,
                           trial_seconds, *key)
        done[key] = trial
        trials.append(trial)
        if progress is not None:
            progress(trial)
        return trial

    pf0 = prefetch_factors[0]
    if 0 in ladder:
        run(0, None, None, pins[0])
    for kind in worker_types:
        best_rate = 0.0
        for n in (n for n in ladder if n > 0):
            t = run(n, kind, pf0, pins[0])
            if t is None or not t.accepted:
                break
            if best_rate and t.samples_per_s < best_rate * (1 + tolerance):
                break  # more workers stopped helping
            best_rate = max(best_rate, t.samples_per_s)
    accepted = [t for t in trials if t.accepted]
    if accepted:
        top = max(accepted, key=lambda t: t.samples_per_s)
        for pf in prefetch_factors if top.num_workers else (None,):
            for pin in pins:
                run(top.num_workers, top.worker_type, pf, pin)
    if skipped:
        log.warning("time_budget_s=%s reached: %d trial(s) not run", time_budget_s, len(skipped))
    return _result(trials, tolerance, budget, time.perf_counter() - t_start, bool(skipped))


def _run_trial(dataset: Any, factory: Callable[..., Iterable[Any]], batch_size: int,
               collate_fn: Callable[[Any], Any] | None, step: Callable[[Any], object] | None,
               budget: Budget, seconds: float, n: int, kind: str | None, pf: int | None,
               pin: bool) -> Trial:
    kwargs: dict[str, Any] = {"batch_size": batch_size, "num_workers": n, "pin_memory": pin}
    if collate_fn is not None:
        kwargs["collate_fn"] = collate_fn
    if n:
        kwargs.update(worker_type=kind, prefetch_factor=pf)
    warmup = max(2, n)
    peaks = _Peaks(step, warmup)
    try:
        with warnings.catch_warnings():  # trying more workers than CPUs is the point here
            warnings.filterwarnings("ignore", message="This DataLoader will create",
                                    category=UserWarning)
            m = _measure.measure_loader(lambda: factory(dataset, **kwargs), max_seconds=seconds,
                                        warmup_batches=warmup, consume=peaks)
    except Exception as exc:  # a failing configuration is a result, not the end of the search
        log.warning("trial %s failed: %s: %s", _kwargs_text(kwargs), type(exc).__name__, exc)
        return Trial(n, kind, pf, pin, 0.0, 0.0, 0, 0, 0, False,
                     f"failed: {type(exc).__name__}: {exc}"[:200])
    shm = max(0, peaks.shm - peaks.shm0)
    pss = max(m.peak_pss_bytes, peaks.pss)
    over = [f"{what} {have / 2**20:,.0f} MiB > {limit / 2**20:,.0f} MiB"
            for what, have, limit in (("PSS", pss, budget.memory_bytes),
                                      ("shm", shm, budget.shm_bytes),
                                      ("pinned", peaks.pinned, budget.pinned_bytes))
            if limit is not None and have > limit]
    return Trial(n, kind, pf, pin, m.samples_per_s, m.first_batch_s, pss, shm,
                 peaks.pinned, not over, ("over budget: " + ", ".join(over)) if over else "")


def _result(trials: list[Trial], tolerance: float, budget: Budget, elapsed: float,
            out_of_time: bool) -> TuneResult:
    accepted = [t for t in trials if t.accepted]
    if not accepted:
        notes = "; ".join(f"{_kwargs_text(t.kwargs)}: {t.note}" for t in trials[:3])
        raise RuntimeError(f"no configuration worked within the budget ({notes}); raise the "
                           "budget, fix the failing trial, or try other num_workers")
    best = max(accepted, key=lambda t: t.samples_per_s)
    good = [t for t in accepted if t.samples_per_s >= (1 - tolerance) * best.samples_per_s]
    chosen = min(good, key=lambda t: (t.num_workers, t.prefetch_factor or 0, t.pin_memory,
                                      t.peak_pss_bytes))
    return TuneResult(tuple(trials), chosen.kwargs, chosen, best, tolerance, budget, elapsed,
                      out_of_time=out_of_time)
