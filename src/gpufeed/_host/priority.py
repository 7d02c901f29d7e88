"""Who gets a contended core first: the loop's thread, before its process workers.

NOTE [ Worker priority ]
------------------------
When the workers and the main thread want more cores than the process may use (``num_workers
+ 1`` above ``usable_cpus()``, this rank's share), the kernel gives a shared core half to each.
On cheap batches the main thread is then the bottleneck, its half core setting the rate, while
the workers run ahead, hit the in-flight bound and sleep, leaving their core idle.

So gpufeed lowers its process workers' priority (``nice`` +``NICE_STEP``: a worker's kernel
weight falls to a third of the main thread's) when the loop is *main-bound*: the main thread's
CPU per batch handed out (everything the loop does between batches included) is above a
worker's time per batch over ``num_workers + 1``, past which the workers, sharing the cores
evenly, would produce batches faster than the main thread takes them. The workers then lose
nothing they needed. Decided from the costs, not always applied: a fixed ``nice`` cost the
workers 10% where they are the bottleneck.
Measurements: docs/how-it-works/measurements/host.md#worker-priority.

The rule is checked over windows (at least ``WINDOW_BATCHES`` batches and ``WINDOW_S``
seconds) and applied after ``WINDOWS`` main-bound windows in a row (a loop's first batches,
a CUDA initialisation, would otherwise count). It is one way: an unprivileged process cannot
raise its priority back (``RLIMIT_NICE``); a non-persistent loader's next epoch starts new
workers and decides again. Thread workers are never changed (the GIL, not the cores, is what
they share with the loop).

``worker_nice=``: None (default) decides as above; 0 never changes it (as stock); an int 1-19
lowers every process worker's priority by that much from its start (after ``worker_init_fn``,
before any batch). The increment in force is the ``worker_nice`` gauge of ``loader.stats()``.

A loop that waits for the GPU by spinning (CUDA's default where it has cores to spare) is busy
to this rule: its workers yield the shared core to the spin, which costs them nothing while the
GPU is the bottleneck, and some of their rate if they were close to it.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

from .._base.stats import StatsRecorder
from .._base.system import usable_cpus
from .messages import Nice

NICE_STEP = 5  # the increment of the automatic rule
WINDOW_BATCHES = 64
WINDOW_S = 0.005
WINDOWS = 2


def check_worker_nice(value: Any) -> None:
    """Raise for a ``worker_nice`` the loader cannot take (None, or an int 0-19)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"worker_nice must be an int from 0 to 19 or None (decide from the "
                        f"loop's costs), got {value!r}")
    if not 0 <= value <= 19:
        raise ValueError(f"worker_nice={value} is out of range: an increment from 0 (the "
                         "workers keep the main process's priority) to 19, or None")


def lower_priority(step: int) -> None:
    """In a process worker: lower this process's priority by ``step`` (where there is ``nice``)."""
    nice = getattr(os, "nice", None)
    if nice is not None and step > 0:
        with contextlib.suppress(OSError):
            nice(step)


class WorkerPriority:
    """The main process's side: whether, and when, to lower the workers' priority.

    ``setting`` is the loader's ``worker_nice`` (N > 0 is sent at once, before any task);
    ``resize`` follows the autotuner; ``recorder`` gets the ``worker_nice`` gauge.
    """

    def __init__(self, setting: int | None, *, num_workers: int, process: bool,
                 send: Callable[[int, Any], None], recorder: StatsRecorder) -> None:
        self.applied = 0  # the increment the workers run at
        self._watching = process and setting is None
        self._num_workers = num_workers
        self._send, self._recorder = send, recorder
        self._windows = 0  # main-bound windows in a row
        self._start: tuple[float, float, int] | None = None  # wall, main CPU, batches
        self._busy = (0, 0.0)  # the window's batches answered, and their worker seconds
        self._sent: dict[int, int] = {}  # worker -> the increment it has been sent
        if process and setting:
            self._lower(setting)
        elif process and recorder.counter("worker_nice"):
            recorder.gauge("worker_nice", 0)  # new workers: a last epoch's is not in force

    def resize(self, num_workers: int) -> None:
        self._num_workers = num_workers

    def started(self, w: int) -> None:
        """The autotuner started worker ``w``, at the main process's priority."""
        self._sent[w] = 0
        self.catch_up(w)

    def catch_up(self, w: int) -> None:
        """Bring worker ``w`` to the increment in force (a retiring one may have missed it)."""
        step = self.applied - self._sent.get(w, 0)
        if step > 0:
            self._send(w, Nice(0, step))  # (messages of any generation apply)
            self._sent[w] = self.applied

    def _lower(self, step: int) -> None:
        self.applied += step
        for w in range(self._num_workers):
            self.catch_up(w)
        self._recorder.gauge("worker_nice", self.applied)

    def observe(self, yielded: int, answered: int, busy_s: float) -> None:
        """A workers' answer of ``answered`` batches in ``busy_s`` worker seconds came, after
        ``yielded`` batches handed out this epoch."""
        if not self._watching:
            return
        now, cpu = time.perf_counter(), time.thread_time()
        start = self._start
        if start is None or yielded < start[2]:  # the first call, or a new epoch
            self._start, self._busy = (now, cpu, yielded), (0, 0.0)
            return
        answered, busy_s = self._busy[0] + answered, self._busy[1] + busy_s
        self._busy = (answered, busy_s)
        batches = yielded - start[2]
        if batches < WINDOW_BATCHES or now - start[0] < WINDOW_S or not answered:
            return
        main_s = (cpu - start[1]) / batches
        self._start, self._busy = (now, cpu, yielded), (0, 0.0)
        bound = main_s > busy_s / answered / (self._num_workers + 1)
        self._windows = self._windows + 1 if bound else 0
        if self._windows >= WINDOWS and oversubscribed(self._num_workers):
            self._watching = False
            self._lower(NICE_STEP)


def oversubscribed(num_workers: int) -> bool:
    """The workers and the main thread want more cores than this rank may use."""
    return num_workers + 1 > usable_cpus(per_rank=True)
