"""AutoIter: the worker iterator of ``num_workers="auto"``, measuring windows and resizing.

A ``WorkerIter`` that, between two batches, closes a measuring window, asks the loader's
``AutoTuner`` (NOTE [ Autotuning decisions ] in ``_host/autotune.py``) for a move and applies
it to its elastic pool (NOTE [ Resizing the pool ] in ``_host/elastic.py``), the in-flight
bound and the ring's default size moving with it, the epoch going on. A window measures:

- per batch handed over: the loop's wait in ``next()``, of it the time blocked with no batch
  ready (``_wait``: what more workers can cut), and the loop's step since the previous batch;
- per batch answered: the workers' fetch and collate seconds;
- per window: the process tree's CPU seconds, the ring's bytes, and every ``MEMORY_EVERY_S``
  one process worker's private memory in turn (a read walks its page tables, so the interval
  stretches to 50 times what a read costs).

Applying a move (starting a process) counts as the loop's wait in ``stats()``.

Thread workers the GIL holds back: when the loop waits (input-bound at least ``GROW_AT``) and
the window's decision holds more workers back (not for noise or a failed start) or reverts a
growth, while the whole process used under ``GIL_CORES`` cores of a budget of two or more, the
work holds the GIL: threads run it one core at a time. The iterator then warns once per loader,
a :class:`ThreadWorkersWarning` naming ``worker_type="process"`` (:func:`held_back`).

It warns rather than switch the type (auto never changes it, NOTE [ Autotuning decisions ] in
``_host/autotune.py``): process workers pickle the dataset, run ``worker_init_fn`` in another
process, seed the global generators there and take memory the budgets were not sized for,
which a drop-in loader cannot do behind the program's back, and the gain of a switch did not
stand out of the noise. On a machine whose cores other programs keep busy, the advice may name
cores that process workers would not get either.
Measurements: docs/how-it-works/measurements/host.md#thread-workers-held-back.
"""

from __future__ import annotations

import itertools
import logging
import time
import warnings
import weakref
from collections.abc import Sequence
from typing import Any, cast

from .._base.system import CpuTimes, TreeCpu, private_bytes
from .autotune import GROW_AT, AutoTuner
from .config import IterConfig
from .cost import Budgets, default_max_workers, parse_bytes
from .elastic import ElasticProcessPool, ElasticThreadPool
from .messages import Reseed, ToMain, UsePlan
from .window import Gauges, Window, pct
from .worker_iter import WorkerIter

log = logging.getLogger("gpufeed")
MEMORY_EVERY_S = 2.0


class _Meter:
    """One window's sums."""

    def __init__(self, t0: float, cpu0: CpuTimes | None) -> None:
        self.t0, self.cpu0 = t0, cpu0
        self.batches = self.answered = 0
        self.wait = self.starved = self.step = self.busy = 0.0


class AutoIter(WorkerIter):
    """Batches from a pool the autotuner resizes between batches."""

    process_pool = ElasticProcessPool
    thread_pool = ElasticThreadPool
    keeps_region_fd = True

    def __init__(self, config: IterConfig) -> None:
        tuner = config.autotune
        if tuner is None:
            raise ValueError("AutoIter needs the loader's AutoTuner (num_workers='auto')")
        self._tuner = tuner
        tuner.trace_owner = config.recorder  # decisions as instants of this loader's trace
        self._retiring: set[int] = set()  # ids >= the count that still hold tasks
        self._plans: dict[int, int] = {}  # worker -> generation whose index plan it has
        self._seeds: dict[int, int | None] = {}  # worker -> per-sample seed it has
        self._cpu = TreeCpu()
        self._meter = _Meter(time.perf_counter(), None)
        self._worker_bytes = 0
        self._memory_at = 0.0
        self._memory_turn = 0
        self._token = 0
        super().__init__(config)
        if tuner.depth != self._work_ahead.depth:
            self._work_ahead.resize(self._num_workers, tuner.depth)
            self._ring.set_slots_hint(self._work_ahead.slots_hint)

    @property
    def _elastic(self) -> ElasticProcessPool | ElasticThreadPool:
        return cast("ElasticProcessPool | ElasticThreadPool", self._pool)

    # -- epochs -------------------------------------------------------------------------------
    def _restart(self, sample_seed: int | None, first_iter: bool = False) -> None:
        super()._restart(sample_seed, first_iter)
        n = self._num_workers
        self._plans = {w: self._gen for w in range(n)} if self._plan is not None else {}
        self._seeds.update({w: self._sample_seed for w in range(n)})
        self._token = self._tuner.begin()  # a new epoch's first window settles
        self._meter = _Meter(time.perf_counter(), self._read_cpu())

    # -- measuring ------------------------------------------------------------------------------
    def _wait(self) -> None:
        t0 = time.perf_counter()
        try:
            super()._wait()
        finally:
            self._meter.starved += time.perf_counter() - t0

    def _worked(self, batches: int, busy_s: float) -> None:
        m = self._meter
        m.busy += busy_s
        m.answered += batches

    def _handle(self, w: int, msg: ToMain) -> None:
        super()._handle(w, msg)
        if self._retiring and not self._closed:
            self._reap()

    def _finish(self, data: Any, asked_at: float, k: int,
                worker_state: tuple[int, Any] | None = None,
                registered: tuple[int, int] | None = None,
                occupancy: Sequence[tuple[str, int, int]] = (),
                gauges: Sequence[tuple[str, int]] = ()) -> Any:
        now = time.perf_counter()
        m, tuner = self._meter, self._tuner
        m.batches += 1
        m.wait += now - asked_at
        if self._returned_at:
            m.step += asked_at - self._returned_at
        tuner.delivered_one()
        move = tuner.scheduled(self._gauges()) if tuner.schedule is not None else None
        if move is None and m.batches >= tuner.window_batches and now - m.t0 >= tuner.window_s:
            win, decided = self._close_window(now), tuner.snapshot().decided
            move = tuner.decide(self._token, win)
            advice = held_back(tuner, win, decided)  # once per loader
            if advice is not None:
                # _finish <- WorkerIter._next_batch <- its _next <- BaseIter.__next__ <- the loop
                warnings.warn(advice, ThreadWorkersWarning, stacklevel=5)
        if move is not None:
            self._apply(move.workers, move.depth)
        return super()._finish(data, asked_at, k, worker_state, registered, occupancy, gauges)

    def _gauges(self) -> Gauges:
        wa, ring = self._work_ahead, self._ring
        return Gauges(self._worker_bytes, ring.slot_bytes, ring.live_bytes,
                      2 * wa.chunk if wa.chunk > 1 else 0, wa.held)

    def _close_window(self, now: float) -> Window:
        m = self._meter
        pids = self._elastic.pids()
        cpu = self._read_cpu()
        if pids and now >= self._memory_at:
            t0 = time.perf_counter()
            got = private_bytes(pids[self._memory_turn % len(pids)])
            self._memory_turn += 1
            if got is not None:
                self._worker_bytes = max(self._worker_bytes, got)
            self._memory_at = now + max(MEMORY_EVERY_S, 50 * (time.perf_counter() - t0))
        win = Window(workers=self._num_workers, depth=self._tuner.depth,
                     batches=m.batches, seconds=now - m.t0, wait_s=m.wait, starved_s=m.starved,
                     step_s=m.step, busy_s=m.busy, answered=m.answered,
                     cpu_s=None if m.cpu0 is None else cpu.total - m.cpu0.total,
                     gauges=self._gauges(),
                     worker_cpu_s=0.0 if m.cpu0 is None else cpu.workers - m.cpu0.workers,
                     queued_s=0.0 if m.cpu0 is None else cpu.queued - m.cpu0.queued)
        self._meter = _Meter(now, cpu)
        return win

    def _read_cpu(self) -> CpuTimes:
        return self._cpu.read(self._elastic.pids(), self._elastic.tids())

    # -- resizing (NOTE [ Resizing the pool ] in _host/elastic.py) ----------------------------
    def _apply(self, workers: int, depth: int) -> None:
        """Move to ``workers`` workers and ``depth`` batches ahead each, between two batches."""
        pool = self._elastic
        try:
            while self._num_workers < workers:
                w = self._num_workers
                if w in self._retiring:
                    self._retiring.discard(w)
                    self._priority.catch_up(w)  # it may have missed a lowered priority
                else:
                    try:
                        pool.add(w, workers)
                    except (OSError, RuntimeError) as e:  # fork or thread start failed
                        self._tuner.cannot_start(w, e)
                        break
                    self._seeds[w] = pool._spec.sample_seed
                    self._plans.pop(w, None)
                    self._priority.started(w)  # at the main process's priority
                self._catch_up(w)
                self._num_workers = w + 1
            while self._num_workers > workers:
                self._num_workers -= 1
                self._retiring.add(self._num_workers)
        finally:
            n = self._num_workers
            self._tuner.workers = n  # the count in force, whatever happened
            self._priority.resize(n)
            self._active = [True] * n
            self._cycle = itertools.cycle(range(n))
        self._work_ahead.resize(n, depth)
        self._ring.set_slots_hint(self._work_ahead.slots_hint, lower=True)
        self._reap()
        self._dispatch()

    def _catch_up(self, w: int) -> None:
        """Send worker ``w`` the epoch's plan and per-sample seed it lacks."""
        if self._seeds.get(w) != self._sample_seed:
            self._pool.send(w, Reseed(self._gen, self._sample_seed))
            self._seeds[w] = self._sample_seed
        if self._plan is not None and self._plans.get(w) != self._gen:
            self._pool.send(w, UsePlan(self._gen, self._plan))
            self._plans[w] = self._gen

    def _reap(self) -> None:
        """Retire the retiring workers that hold nothing any more."""
        pool = self._elastic
        for w in sorted(self._retiring):
            if pool.idle(w):
                pool.retire(w)
                self._retiring.discard(w)


# -- thread workers the GIL holds back (the module's docstring) ---------------------------------

GIL_CORES = 1.5
#: the autotuners (one per loader) whose loader has been told already
_told: weakref.WeakSet[AutoTuner] = weakref.WeakSet()


class ThreadWorkersWarning(UserWarning):
    """``num_workers="auto"`` with ``worker_type="thread"`` saw the loop wait while more thread
    workers could not help: the work holds the GIL; ``worker_type="process"`` would run it on
    the other cores."""


def held_back(tuner: AutoTuner, win: Window, decided: int) -> str | None:
    """The warning's words, once per loader, when the decision on ``win`` (``decided``: the
    count of decisions before) held thread workers back and ``win`` shows the GIL (the
    module's docstring); else None."""
    if tuner.worker_type != "thread" or tuner in _told:
        return None
    stats = tuner.snapshot()
    if stats.decided == decided or not stats.decisions:
        return None
    last = stats.decisions[-1]
    grew_in_vain = last.kind == "revert" and last.workers[1] < last.workers[0]
    held = last.kind == "hold" and not last.reason.startswith(("the machine is too noisy",
                                                                "could not start"))
    if not (grew_in_vain or held) or win.input_bound < GROW_AT:
        return None
    cores, budget = win.cpu_cores, tuner.budgets.cpu_cores
    if cores is None or cores >= GIL_CORES or budget < 2:
        return None
    _told.add(tuner)
    return (f"num_workers='auto' with worker_type='thread': your loop waits for data "
            f"(input-bound {pct(win.input_bound)}) and more thread workers cannot help "
            f"({last.reason}): the whole process used {cores:.1f} of the {budget:g} cores it "
            "may use, so the dataset's work holds the GIL (pure Python) and threads run it one "
            "core at a time. worker_type='process' would run it on the other cores "
            "(gpufeed.DataLoader(..., num_workers='auto', worker_type='process')); auto never "
            "changes the worker type itself")


def make_tuner(num_workers: Any, *, max_workers: Any, memory_budget: Any, worker_type: str,
               prefetch_factor: int | None, iterable: bool) -> AutoTuner | None:
    """The loader's autotuner for ``num_workers="auto"`` (None for an int), after checking the
    arguments that go with it."""
    if isinstance(num_workers, str) and num_workers != "auto":
        raise TypeError(f"num_workers={num_workers!r} is not supported; use an int >= 0, or "
                         "'auto' to let gpufeed size the workers while it runs")
    auto = num_workers == "auto"
    for name, value in (("max_workers", max_workers), ("memory_budget", memory_budget)):
        if value is not None and not auto:
            raise ValueError(f"{name}={value!r} only applies to num_workers='auto' (with "
                             f"num_workers={num_workers!r} the count is fixed); drop {name} "
                             "or pass num_workers='auto'")
    if not auto:
        return None
    if iterable:
        raise ValueError(
            "num_workers='auto' needs a map-style dataset: an IterableDataset is split among "
            "workers (get_worker_info()), so the worker count decides which samples each "
            "batch holds, and changing it while training would change your data; pass an int "
            "num_workers (`gpufeed tune` measures the best one)")
    not_int = isinstance(max_workers, bool) or not isinstance(max_workers, int)
    if max_workers is not None and (not_int or max_workers < 1):
        raise (TypeError if not_int else ValueError)(
            f"max_workers={max_workers!r} is not supported: it is the most workers "
            "num_workers='auto' may run, an int >= 1 (None: 8 per usable CPU, at most 64)")
    budget = None
    if memory_budget is not None:
        try:
            budget = parse_bytes(memory_budget)
        except ValueError as e:
            raise ValueError(f"memory_budget={memory_budget!r}: {e} (the most bytes the "
                             "workers and the ring may hold together)") from None
    budgets = Budgets.default(budget)
    return AutoTuner(
        max_workers=max_workers or default_max_workers(budgets.cpu_cores),
        worker_type=worker_type, budgets=budgets, depth=prefetch_factor or 2,
        depth_fixed=prefetch_factor is not None)
