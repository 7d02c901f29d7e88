"""Who gets a contended core first: the loop's thread, before its process workers.

NOTE [ Worker priority ]
------------------------
When the workers and the main process together want more cores than the process may use
(``num_workers + 1`` above ``usable_cpus()``, which divides the cores among torchrun's local
ranks), the kernel shares a core between the main thread and a worker: at equal priority
each gets half of it. On cheap batches the main thread is then the bottleneck, and its half
core sets the rate, while the workers, which have the rest, run ahead, hit the in-flight bound
and sleep, leaving their core idle: on the CPU benchmark's tabular workload (two process
workers on two cores, 23 us of main-thread CPU per 256-row batch against 35-45 us of a
worker's) the machine was 20-25% idle while the loop waited for the main thread.

So gpufeed lowers its process workers' priority (``nice`` +``NICE_STEP``, the kernel weight
of one falls to a third of the main thread's) when the loop is *main-bound*: the main thread's
CPU per batch handed out, everything the loop does between batches included, is above a
worker's time per batch over ``num_workers + 1``, the point past which, sharing the cores
evenly, the workers would produce batches faster than the main thread takes them. The main
thread then runs whenever it can, and the workers take what it leaves; with that rule the
workers lose nothing they needed. Measured on two cores (``bench/results/main-process.md``,
round 16): a fixed ``nice`` +5 gave tabular +14% and +24% samples/s, and cost jpeg, where the
workers are the bottleneck, 10%, which is why it is decided from the costs and not always
applied; the rule against ``worker_nice=0`` gave tabular 7.04M against 5.49M samples/s (6
alternating rounds), the machine 15% idle against 22%.

The rule is checked over windows of the loop (at least ``WINDOW_BATCHES`` batches and
``WINDOW_S`` seconds) and applied after ``WINDOWS`` main-bound windows in a row (the first
batches of a loop, a CUDA initialisation, would otherwise count). It is one way: an
unprivileged process cannot raise its priority back (``RLIMIT_NICE``), so a worker keeps it
until it exits; a non-persistent loader's next epoch starts new workers at the main process's
priority and decides again. Thread workers are never changed (a thread's nice would be the
thread's own, and the GIL, not the cores, is what they share with the loop).

``worker_nice=`` on the loader: None (default) decides as above; 0 never changes it (the
stock loader's workers); an int 1-19 lowers every process worker's priority by that much
from its start (before any batch; ``worker_init_fn`` runs first). The increment in force is
the ``worker_nice`` gauge of ``loader.stats()``.

A loop that waits for the GPU by spinning (CUDA's default synchronisation where it has cores
to spare) is busy to this rule: its workers then yield the shared core to the spin, which costs
them nothing while the GPU is the bottleneck, and some of their rate if they were close to it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from .._base.stats import StatsRecorder
from .._base.system import usable_cpus
from .messages import Nice

__all__ = ["NICE_STEP", "WorkerPriority", "check_worker_nice", "lower_priority"]

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
    """In a process worker: lower this process's priority by ``step`` (a no-op where the
    platform has no ``nice``; raising it back is what needs a privilege, not this)."""
    nice = getattr(os, "nice", None)
    if nice is not None and step > 0:
        try:
            nice(step)
        except OSError:
            pass


class WorkerPriority:
    """The main process's side: whether, and when, to lower the workers' priority.

    Args:
        setting: the loader's ``worker_nice`` (None: decide, 0: never, N: N from the start,
            sent at once, so before any task).
        num_workers: the workers now (``resize`` follows the autotuner).
        process: process workers (thread workers are never changed).
        send: the pool's ``send(worker, message)``.
        recorder: the loader's stats, whose ``worker_nice`` gauge it sets.
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
        """Worker ``w`` was just started, at the main process's priority (the autotuner)."""
        self._sent[w] = 0
        self.catch_up(w)

    def catch_up(self, w: int) -> None:
        """Bring worker ``w`` to the increment in force (one the autotuner had been retiring
        may have missed it)."""
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
        """Called as workers' answers arrive: ``yielded`` batches handed out so far this
        epoch, and the message's ``answered`` batches, which took ``busy_s`` worker seconds."""
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
