"""Tuner: measure short trials of loader settings and recommend the smallest good one.

Search (each trial is ``runs`` passes of about ``trial_seconds``, see ``_tools/trial.py`` and NOTE
[ Repeated measurement ] in ``_tools/repeat.py``):

1. ``num_workers=0`` once, then for each worker type the worker ladder 1, 2, 4, ... up to
   twice the usable CPUs, or further while the model of NOTE [ What a worker costs ]
   (``_host/cost.py``, the autotuner's too) says the CPU the trials *used* leaves room: workers
   that wait on I/O with the GIL released cost little CPU and may far outnumber the cores.
   A type's ladder stops as soon as more workers stop helping (the new trial does not pay
   off: within the noise of that type's best, their ranges overlap, or it gains less than
   ``tolerance``) or a trial goes over the memory budget (more workers only cost more).
2. Around the fastest trial: the other prefetch factors (None: the loader's default, which
   in gpufeed adapts to cheap batches), and ``pin_memory=True`` when CUDA is
   available (without a GPU pinning only costs).

A trial over any part of the :class:`Budget` (peak PSS of the process tree, growth of /dev/shm
use, pinned host bytes) is rejected.

A loader warns once in its life and the tuner builds one per run of every trial, so
:class:`TrialWarnings` catches the ``RandomStateWarning`` of thread-worker runs (a dataset
drawing from a global random generator) and says it once, in the tool's words, attributed to
the dataset's own source, with the trials that saw it; the JSON holds the same words. Every
other warning passes. Measurements: docs/how-it-works/measurements/tools.md#one-warning-per-tool.

NOTE [ The recommendation ]: the fastest accepted trial (highest median) is the *best*; a trial
is *within the noise* of it when their ranges of runs overlap or its median is within
``tolerance`` of the best's. The recommendation is the *smallest* accepted trial within the
noise (fewest workers, then the default or lowest prefetch, no pinning, least memory): extra
workers that buy nothing measurable cost RAM and CPU the training needs. On a GIL-bound
dataset thread workers stay at one core's speed while process workers scale to the cores, so
process workers equal to the core count come out best and more add nothing: the rule picks them.
With a ``step`` the rate is the training loop's, so configurations that keep up with the step
are all within the noise of the best and the smallest of them wins.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .._base.stats import format_table, human_bytes
from .._base.system import usable_cpus
from .._host.config import WORKER_TYPES, WorkerType
from .._host.cost import HARD_MAX_WORKERS, WorkerCost, parse_bytes, pays_off
from .._loader import DataLoader
from .._order.sample_rng import RandomStateWarning
from .output import require_matplotlib, write_json
from .repeat import LoadMonitor, MachineLoad, spreads_text
from .trial import COLLATE_FIX, Budget, Trial, kwargs_text, ragged, run_trial

log = logging.getLogger(__name__)


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
        machine: what other processes did meanwhile (``machine.busy``: the figures are noisy).
        batch_size: the batch size the trials ran with (in the recommended line).
        warnings: what the trials' loaders warned about, each said once (:class:`TrialWarnings`):
            {"category", "message", "generators", "trials"}.
    """

    trials: tuple[Trial, ...]
    recommended: dict[str, Any]
    chosen: Trial
    best: Trial
    tolerance: float
    budget: Budget
    elapsed_s: float
    out_of_time: bool = False
    machine: MachineLoad | None = None
    batch_size: int | None = None
    warnings: tuple[dict[str, Any], ...] = ()

    @property
    def kwargs_text(self) -> str:
        """The recommendation as Python keyword arguments: ``num_workers=2, ...``."""
        return kwargs_text(self.recommended)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``recommended`` (kwargs) and ``trials`` (one row per trial)."""
        return {"recommended": dict(self.recommended),
                "trials": [asdict(t) for t in self.trials],
                "best": self.best.kwargs, "tolerance": self.tolerance,
                "budget": asdict(self.budget), "elapsed_s": self.elapsed_s,
                "out_of_time": self.out_of_time,
                "machine": self.machine.to_dict() if self.machine else None,
                "machine_busy": bool(self.machine and self.machine.busy),
                "batch_size": self.batch_size, "warnings": [dict(w) for w in self.warnings]}

    def write_json(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`to_dict` as JSON to ``path`` (``"-"``: to stdout)."""
        write_json(path, self.to_dict())

    def __str__(self) -> str:
        stepped = any(t.input_bound is not None for t in self.trials)
        rows = []
        for t in self.trials:
            why = ("* " if t is self.chosen else "") + (t.note or (
                "best" if t is self.best else "within noise of best"
                if within_noise(t, self.best, self.tolerance) else "slower"))
            row = [t.worker_type or "-", t.num_workers,
                   t.prefetch_factor or ("default" if t.num_workers else "-"),
                   "yes" if t.pin_memory else "no", t.spread.text() if t.accepted else "-"]
            if stepped:
                row.append("-" if t.input_bound is None else f"{t.input_bound:.0%}")
            rows.append([*row, human_bytes(t.peak_pss_bytes), human_bytes(t.shm_bytes), why])
        headers = ["type", "workers", "prefetch", "pin", "samples/s (range)",
                   *(["input-bound"] if stepped else []), "PSS", "shm", "result"]
        table = format_table(headers, rows, left=2)
        gain = self.best.samples_per_s / max(self.chosen.samples_per_s, 1e-9) - 1
        why = ("the fastest" if self.chosen is self.best else
               f"the smallest within the noise of the fastest ({gain:.1%} faster, ranges "
               "overlap or within tolerance)")
        lines = [f"gpufeed tune: {len(self.trials)} trials in {self.elapsed_s:.1f} s, "
                 f"{spreads_text([t.spread for t in self.trials if t.accepted])} each"
                 + (" (time budget reached)" if self.out_of_time else ""), table]
        if stepped:
            lines.append("input-bound: share of the training loop spent waiting for data "
                         "(0% = the loader keeps up with the step)")
        if self.machine is not None:
            lines.append(self.machine.summary)
        lines.append(f"recommended (* above; {why}): "
                     f"DataLoader(dataset, batch_size={self.batch_size or '...'}, "
                     f"{self.kwargs_text})")
        return "\n".join(lines)

    def plot(self, path: str | os.PathLike[str]) -> None:
        """Samples/s against num_workers per worker type (needs matplotlib)."""
        fig = require_matplotlib()(figsize=(6, 4))
        ax = fig.subplots()
        for kind in sorted({t.worker_type or "-" for t in self.trials}):
            first: dict[int, Trial] = {}  # the ladder's trial at each count (prefetch pf0)
            for t in self.trials:
                if t.accepted and not t.pin_memory and (t.worker_type or "-") in (kind, "-"):
                    first.setdefault(t.num_workers, t)
            pts = sorted((n, t.spread.median, t.spread.lo, t.spread.hi)
                         for n, t in first.items())
            if pts:
                ax.errorbar([p[0] for p in pts], [p[1] for p in pts],
                            yerr=[[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]],
                            marker="o", capsize=3, label=kind)
        ax.plot([self.chosen.num_workers], [self.chosen.samples_per_s], marker="*",
                markersize=16, linestyle="none", color="tab:red", label="recommended")
        ax.set(xlabel="num_workers", ylabel="samples/s (median, range of runs)",
               title="gpufeed tune")
        ax.legend()
        fig.savefig(path, bbox_inches="tight", dpi=100)


def tune(dataset: Any, *, batch_size: int, collate_fn: Callable[[Any], Any] | None = None,
         step: Callable[[Any], object] | None = None, budget: Budget | int | str | None = None,
         worker_types: Sequence[WorkerType] = WORKER_TYPES,
         num_workers: Sequence[int] | None = None,
         prefetch_factors: Sequence[int | None] = (None, 4),
         pin_memory: Sequence[bool] | None = None, tolerance: float = 0.05,
         trial_seconds: float = 0.5, time_budget_s: float = 120.0,
         loader_factory: Callable[..., Iterable[Any]] | None = None,
         progress: Callable[[Trial], None] | None = None, runs: int = 5,
         target_spread: float = 0.05) -> TuneResult:
    """Measure loader settings on ``dataset`` and recommend the smallest good one.

    Args:
        dataset: the map-style or iterable dataset to load.
        batch_size: samples per batch, as in training.
        collate_fn: passed to the loader (None: its default).
        step: called on every batch, as the training step would be; its time counts and each
            trial reports the loop's input-bound share. None measures the loader alone (the
            upper bound of what it can deliver).
        budget: a :class:`Budget`, or a memory limit in bytes (int or "8GiB"). None: 80% of
            the available RAM and free /dev/shm.
        worker_types: worker kinds to try: "process" (parallel Python, pickles the dataset)
            and/or "thread" (cheap start and memory; scales only where the GIL is released).
        num_workers: worker counts to try, ascending; None: 0, 1, 2, 4, ... up to twice the
            usable CPUs, or as far as the CPU the trials use leaves room for (see above). The
            ladder stops early once more workers stop helping.
        prefetch_factors: batches in flight per worker to try; the first is the one used
            while sweeping workers. None is the loader's default (gpufeed: at least 2, more
            for cheap batches; stock: 2). Deeper prefetch hides jitter and costs memory.
        pin_memory: values to try; None: (False, True) with CUDA, (False,) without.
        tolerance: a trial within this fraction of the best's median is within the noise even
            when the ranges do not overlap (see NOTE [ The recommendation ]).
        trial_seconds: timed seconds per run of a trial (after warm-up). Longer is steadier.
        time_budget_s: no trial starts after this many seconds; the result says so.
        loader_factory: builds a loader from (dataset, batch_size=..., num_workers=...,
            pin_memory=..., and with workers worker_type=..., prefetch_factor=...); default
            ``gpufeed.DataLoader``.
        progress: called with each finished :class:`Trial` (for progress bars).
        runs: runs per trial (fewer, at least 3, once they agree within ``target_spread``).
        target_spread: (fastest - slowest) / median of the runs that counts as steady.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance is a fraction in [0, 1), e.g. 0.05; got {tolerance!r}")
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        raise ValueError(f"runs must be a positive int (5 is the default), got {runs!r}")
    bad = [w for w in worker_types if w not in WORKER_TYPES]
    if bad or not worker_types:
        raise ValueError(f"worker_types must name 'process' and/or 'thread', got {worker_types!r}")
    if not prefetch_factors or any(
            pf is not None and (isinstance(pf, bool) or not isinstance(pf, int) or pf < 1)
            for pf in prefetch_factors):
        raise ValueError(f"prefetch_factors must be positive ints or None (the loader's "
                         f"default), got {prefetch_factors!r}")
    factory = loader_factory or DataLoader
    if budget is None:
        budget = Budget.default()
    elif not isinstance(budget, Budget):
        budget = Budget(memory_bytes=parse_bytes(budget))
    cpus = usable_cpus()
    ladder = list(num_workers) if num_workers is not None else [0] + [
        2**i for i in range(8) if 2**i <= HARD_MAX_WORKERS]
    pins = tuple(pin_memory) if pin_memory is not None else (
        (False, True) if torch.cuda.is_available() else (False,))
    t_start = time.perf_counter()
    monitor = LoadMonitor(max(1, round(usable_cpus(per_rank=False))))
    done: dict[tuple[Any, ...], Trial] = {}  # every trial, in the order run
    skipped: list[tuple[Any, ...]] = []
    caught = TrialWarnings("gpufeed tune")  # said once, after the trials

    def run(n: int, kind: WorkerType | None, pf: int | None, pin: bool) -> Trial | None:
        key = (n, kind if n else None, pf if n else None, pin)
        if key in done:
            return done[key]
        if done and time.perf_counter() - t_start > time_budget_s:
            skipped.append(key)
            return None
        with caught.trial(kwargs_text({"num_workers": n, "worker_type": kind} if n
                                      else {"num_workers": 0})):
            trial = run_trial(dataset, factory, batch_size, collate_fn, step, budget,
                              trial_seconds, *key, runs=runs, target_spread=target_spread)
        done[key] = trial
        if progress is not None:
            progress(trial)
        return trial

    pf0 = prefetch_factors[0]
    if 0 in ladder:
        run(0, None, None, pins[0])
    for kind in worker_types:
        best: Trial | None = None
        bound = 2 * cpus  # the default ladder's end, moved by what the trials cost
        for n in (n for n in ladder if n > 0):
            if num_workers is None and n > bound:
                break
            t = run(n, kind, pf0, pins[0])
            if t is None or not t.accepted:
                break
            if best is not None and not pays_off(
                    best.samples_per_s, t.samples_per_s, tolerance=tolerance,
                    before_hi=best.spread.hi, after_lo=t.spread.lo):
                break  # more workers stopped helping
            if best is None or t.samples_per_s > best.samples_per_s:
                best = t
            if t.cpu_cores:
                cost = WorkerCost.observed(workers=n, rate=t.samples_per_s, cpu_cores=t.cpu_cores)
                bound = max(bound, cost.cpu_limit(cpus))
    accepted = [t for t in done.values() if t.accepted]
    if accepted:
        top = max(accepted, key=lambda t: t.samples_per_s)
        for pf in prefetch_factors if top.num_workers else (None,):
            for pin in pins:
                run(top.num_workers, top.worker_type, pf, pin)
    if skipped:
        log.warning("time_budget_s=%s reached: %d trial(s) not run", time_budget_s, len(skipped))
    caught.report(dataset)
    return _result(list(done.values()), tolerance, budget, time.perf_counter() - t_start,
                   bool(skipped), monitor.stop(), batch_size=batch_size, warnings=caught.to_list())


def within_noise(t: Trial, best: Trial, tolerance: float) -> bool:
    """Whether ``t`` cannot be told from ``best`` (see NOTE [ The recommendation ])."""
    return t.accepted and (t.spread.overlaps(best.spread)
                           or t.samples_per_s >= (1 - tolerance) * best.samples_per_s)


def choose(trials: Sequence[Trial], tolerance: float) -> tuple[Trial, Trial]:
    """(chosen, best) of NOTE [ The recommendation ]; raises when no trial was accepted."""
    accepted = [t for t in trials if t.accepted]
    if not accepted:
        raise RuntimeError(_nothing_worked(trials))
    best = max(accepted, key=lambda t: t.samples_per_s)
    good = [t for t in accepted if within_noise(t, best, tolerance)]
    chosen = min(good, key=lambda t: (t.num_workers, t.prefetch_factor or 0, t.pin_memory,
                                      t.peak_pss_bytes))
    return chosen, best


def _nothing_worked(trials: Sequence[Trial]) -> str:
    """Why no trial was accepted, with the fix that applies to it."""
    notes = "; ".join(f"{kwargs_text(t.kwargs)}: {t.note}" for t in trials[:3])
    over = [t for t in trials if t.note.startswith("over budget")]
    fixes = []
    if over:
        fixes.append("raise the budget (--budget-memory / --budget-shm / --budget-pinned, or "
                     "budget=) or lower batch_size")
    if len(over) < len(trials):
        fixes.append(COLLATE_FIX if ragged(" ".join(t.note for t in trials)) else
                     "fix the error the trials raised (run one batch of the loader by hand "
                     "to see its traceback)")
    return f"no configuration worked ({notes}); " + "; ".join(fixes)


def _result(trials: list[Trial], tolerance: float, budget: Budget, elapsed: float,
            out_of_time: bool, machine: MachineLoad | None = None, *,
            batch_size: int | None = None,
            warnings: Sequence[dict[str, Any]] = ()) -> TuneResult:
    chosen, best = choose(trials, tolerance)
    return TuneResult(tuple(trials), chosen.kwargs, chosen, best, tolerance, budget, elapsed,
                      out_of_time=out_of_time, machine=machine, batch_size=batch_size,
                      warnings=tuple(warnings))


_DREW = re.compile(r"drew from (.+?) global random generator")


@dataclass
class TrialWarnings:
    """The ``RandomStateWarning``\\ s of a tool's trials, kept to be said once.

    Fields:
        tool: the tool's name, as its output starts ("gpufeed tune").
        generators: the global generators the dataset was seen drawing from ("torch's", ...).
        trials: the trials (their keyword arguments, as text) in which it was seen.
    """

    tool: str
    generators: list[str] = field(default_factory=list)
    trials: list[str] = field(default_factory=list)

    @contextmanager
    def trial(self, what: str) -> Iterator[None]:
        """Catch the random-state warnings of one trial (``what``: its keyword arguments);
        show any other warning after it as it would have been (an ``error`` filter raises)."""
        with warnings.catch_warnings(record=True) as caught:
            try:
                yield
            finally:
                others = []
                for w in caught:
                    if issubclass(w.category, RandomStateWarning) and "thread workers" in str(
                            w.message):
                        self._saw(str(w.message), what)
                    else:
                        others.append(w)
        for w in others:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file, w.line)

    def _saw(self, text: str, what: str) -> None:
        found = _DREW.search(text)
        names = found.group(1) if found else "a"
        for name in re.split(r", (?:and )?", names):
            if name not in self.generators:
                self.generators.append(name)
        if what not in self.trials:
            self.trials.append(what)

    @property
    def message(self) -> str | None:
        """The one warning, in the tool's words; None when no trial saw a draw."""
        if not self.trials:
            return None
        names = ", ".join(self.generators)
        n = len(self.trials)
        listed = "; ".join(self.trials[:3]) + ("; ..." if n > 3 else "")
        return (f"{self.tool}: your dataset draws from {names} global random generator, seen "
                f"in {n} thread-worker trial{'s' if n != 1 else ''} ({listed}). "
                "Thread workers share that generator, so under them its draws are not "
                "reproducible and differ from the stock loader's; the speed figures stand. Draw "
                "from gpufeed.random.sample_generator() (seeded per sample), or use "
                "worker_type='process'.")

    def to_list(self) -> list[dict[str, Any]]:
        """JSON-ready: one entry per warning said."""
        if not self.trials:
            return []
        return [{"category": "RandomStateWarning", "message": self.message,
                 "generators": list(self.generators), "trials": list(self.trials)}]

    def report(self, dataset: Any) -> None:
        """Warn once (``RandomStateWarning``), attributed to ``dataset``'s ``__getitem__`` (or
        its class) where its source is known, else to the tool's caller."""
        text = self.message
        if text is None:
            return
        where = _source_of(dataset)
        if where is None:
            warnings.warn(text, RandomStateWarning, stacklevel=3)
        else:
            filename, lineno, module = where
            warnings.warn_explicit(text, RandomStateWarning, filename, lineno, module=module,
                                   registry={})


def _source_of(dataset: Any) -> tuple[str, int, str] | None:
    """(file, line, module) of the dataset's ``__getitem__`` (its ``__iter__`` for an iterable
    one, else its class), or None where Python cannot tell (a built-in, a class made in C)."""
    cls = type(dataset)
    for target in (getattr(cls, "__getitem__", None), getattr(cls, "__iter__", None), cls):
        if target is None:
            continue
        try:
            fn = inspect.unwrap(target)
            filename = inspect.getsourcefile(fn)
            _, lineno = inspect.getsourcelines(fn)
        except (OSError, TypeError):
            continue
        if filename and "/torch/" not in filename:
            return filename, max(lineno, 1), cls.__module__
    return None
