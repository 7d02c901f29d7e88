"""One tuner trial: a loader configuration measured repeatedly, with its memory peaks and the
share of a training step's loop it spends waiting for data.

Runs of a trial follow NOTE [ Repeated measurement ] (``_tools/repeat.py``): ``runs`` passes of
about ``seconds`` each (fewer, at least 3, when they already agree within ``target_spread``);
the trial reports their median rate and range.

With a ``step`` (the user's training step, or a sleep of ``--step-ms``) every batch is handed to
it as a training loop would; the time between the end of one step and the next batch is the
loop's *wait*, and ``input_bound = wait / (wait + step)`` over the timed batches. A loader that
keeps up with the step has an input-bound share near 0, whatever its raw throughput.
"""

from __future__ import annotations

import logging
import shutil
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .._base.stats import human_bytes
from . import measure as _measure
from .repeat import Spread

if TYPE_CHECKING:
    from .tuner import Budget

__all__ = ["Trial", "run_trial"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Trial:
    """One measured configuration. ``samples_per_s`` is the median of ``runs`` (the rate of
    each run). Bytes are peaks over the runs: ``peak_pss_bytes`` of the process tree,
    ``shm_bytes`` the growth of /dev/shm use (machine-wide: other programs count too),
    ``pinned_bytes`` with CUDA only. ``input_bound``: share (0-1) of the loop spent waiting for
    data when a step was given, else None. ``note`` says why a trial was rejected ("" if
    not)."""

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
    runs: tuple[float, ...] = field(default=())
    input_bound: float | None = None

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


class _Peaks:
    """``consume`` hook of a run: runs the user's step, times the loop's wait for each batch,
    then samples /dev/shm use and pinned bytes every batch, and the process tree's PSS once the
    warm-up is over and then every ``pss_every_s`` (a sample costs a few ms: about 2% of a
    run's time). This complements ``measure_loader``'s sampler thread, which can miss the peak
    of a short run."""

    def __init__(self, step: Callable[[Any], object] | None, warmup: int,
                 pss_every_s: float = 0.25) -> None:
        self.step = step
        self.shm0 = self.shm = self._shm_used()
        self.pinned = self.pss = self.batches = 0
        self.warmup, self.every, self.next_pss = warmup, pss_every_s, 0.0
        self.cuda = torch.cuda.is_available() and hasattr(torch.cuda, "host_memory_stats")
        self.wait_s = self.step_s = 0.0
        self._step_end: float | None = None

    @staticmethod
    def _shm_used() -> int:
        try:
            u = shutil.disk_usage("/dev/shm")
        except OSError:
            return 0
        return u.total - u.free

    def __call__(self, batch: Any) -> None:
        t0 = time.perf_counter()
        if self.step is not None:
            self.step(batch)
            t1 = time.perf_counter()
            if self.batches >= self.warmup and self._step_end is not None:
                self.wait_s += t0 - self._step_end
                self.step_s += t1 - t0
        self.batches += 1
        self.shm = max(self.shm, self._shm_used())
        if self.cuda:
            self.pinned = max(self.pinned, _pinned_bytes())
        now = time.perf_counter()
        if self.batches >= self.warmup and now >= self.next_pss:
            self.pss = max(self.pss, _measure.process_tree_pss())
            self.next_pss = now + self.every
        self._step_end = time.perf_counter()  # the loop asks for the next batch from here

    @property
    def input_bound(self) -> float | None:
        total = self.wait_s + self.step_s
        return self.wait_s / total if self.step is not None and total > 0 else None


def _pinned_bytes() -> int:
    """Pinned host bytes: torch's caching host allocator plus regions gpufeed registered
    (``_pinning.registered_bytes()``, where the device module provides it)."""
    from .._memory import pinning as _pinning

    registered = getattr(_pinning, "registered_bytes", None)
    stats = torch.cuda.host_memory_stats()
    return int(stats.get("allocated_bytes.current", 0)) + (int(registered()) if registered else 0)


def _kwargs_text(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


def run_trial(dataset: Any, factory: Callable[..., Iterable[Any]], batch_size: int,
              collate_fn: Callable[[Any], Any] | None, step: Callable[[Any], object] | None,
              budget: Budget, seconds: float, n: int, kind: str | None, pf: int | None,
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
    while not Spread(tuple(rates)).done(runs, target_spread):
        peaks = _Peaks(step, warmup)
        try:
            with warnings.catch_warnings():  # trying more workers than CPUs is the point here
                warnings.filterwarnings("ignore", message="This DataLoader will create",
                                        category=UserWarning)
                m = _measure.measure_loader(lambda: factory(dataset, **kwargs),
                                            max_seconds=seconds, warmup_batches=warmup,
                                            consume=peaks)
        except Exception as exc:  # a failing configuration is a result, not the end of the search
            log.warning("trial %s failed: %s: %s", _kwargs_text(kwargs), type(exc).__name__, exc)
            first = (str(exc).strip().splitlines() or [""])[0]  # not the worker's traceback
            return Trial(n, kind, pf, pin, 0.0, 0.0, 0, 0, 0, False,
                         f"failed: {type(exc).__name__}: {first}"[:200])
        rates.append(m.samples_per_s)
        firsts.append(m.first_batch_s)
        shm = max(shm, peaks.shm - peaks.shm0)
        pss = max(pss, m.peak_pss_bytes, peaks.pss)
        pinned = max(pinned, peaks.pinned)
        wait_s, step_s = wait_s + peaks.wait_s, step_s + peaks.step_s
        over = _over(budget, pss, shm, pinned)
        if over:  # more runs cannot bring a peak down
            break
    bound = wait_s / (wait_s + step_s) if step is not None and wait_s + step_s > 0 else None
    spread = Spread(tuple(rates))
    return Trial(n, kind, pf, pin, spread.median, sorted(firsts)[len(firsts) // 2], pss, shm,
                 pinned, not over, ("over budget: " + ", ".join(over)) if over else "",
                 runs=spread.runs, input_bound=bound)


def _over(budget: Budget, pss: int, shm: int, pinned: int) -> list[str]:
    return [f"{what} {human_bytes(have)} > {human_bytes(limit)}"
            for what, have, limit in (("PSS", pss, budget.memory_bytes),
                                      ("shm", shm, budget.shm_bytes),
                                      ("pinned", pinned, budget.pinned_bytes))
            if limit is not None and have > limit]
