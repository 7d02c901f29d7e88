"""What a worker costs and gives: the one model ``gpufeed tune`` (offline, ``_tools/tuner.py``)
and the autotuner (online, ``num_workers="auto"``, ``_host/autotune.py``) both decide with.

NOTE [ What a worker costs ]
----------------------------
A worker turns wall time into batches: one batch every ``batch_s`` seconds (fetch and collate
as measured where it ran, so GIL waits and CPU contention are in it). The whole process tree
(the workers, the main process receiving batches, the training step's own CPU) spends
``cpu_s`` CPU seconds per delivered batch. So ``n`` workers deliver at most

    rate(n) = min(n / batch_s,  cpu_budget / cpu_s,  1 / step_s)

batches per second: the workers' own pace, what the CPU budget can pay for, and what the
training loop takes (its step of ``step_s`` seconds per batch). The fewest workers for a rate
``r`` are ``ceil(r * batch_s)``; past ``cpu_limit`` more workers only queue for the CPU. The
rule does not assume workers are CPU-bound: a worker that waits on I/O with the GIL released
has ``cpu_s`` far below ``batch_s``, and the CPU budget then allows many more workers than
cores (the right answer for latency-bound storage). Where the kernel says how long a worker
was runnable but waited for a core (its run-queue delay), a CPU-bound worker (computing most
of the time it does not wait for a core) that waits a large share of its runnable time is
*crowded*: the cores are busy (ours or another program's), and more workers would only
queue; a worker waiting on I/O is not, even when each wake-up queues. Memory: each worker
adds ``worker_bytes`` (a process worker's private memory; 0 for a thread) and each batch in
flight a ring slot of ``slot_bytes``; the ring is shared and pinned memory at once, counted
once.

Whether a change paid off is one rule too (:func:`pays_off`): the rate after must beat the
rate before by more than ``tolerance`` *and* by more than the noise (the slowest run after
faster than the fastest run before). ``tune`` stops its worker ladder when a rung does not pay
off, the autotuner reverts a growth that did not.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from .._base.system import local_ranks, memory_available, usable_cpus

__all__ = ["DEFAULT_MEMORY_SHARE", "HARD_MAX_WORKERS", "Budgets", "WorkerCost",
           "default_max_workers", "parse_bytes", "pays_off"]

#: the share of the memory available at start that the autotuner's default budget takes
#: (divided among the local ranks): the training itself needs the rest
DEFAULT_MEMORY_SHARE = 0.25
#: workers per usable CPU the autotuner may reach by default: workers waiting on I/O cost
#: little CPU, so the bound is well above the core count; the CPU budget does the rest
WORKERS_PER_CPU = 8
HARD_MAX_WORKERS = 64
#: a worker on a core this share of its batch time (less its wait for one) is CPU-bound ...
CPU_BOUND = 0.5
#: ... and one of those waiting for a core this share of its runnable time is crowded out
QUEUED = 0.25

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


def default_max_workers(cpu_cores: float | None = None) -> int:
    """The autotuner's default upper bound: ``WORKERS_PER_CPU`` per usable CPU (this rank's
    share), at least 2, at most ``HARD_MAX_WORKERS``."""
    cores = usable_cpus() if cpu_cores is None else cpu_cores
    return max(2, min(HARD_MAX_WORKERS, int(WORKERS_PER_CPU * cores)))


@dataclass(frozen=True)
class Budgets:
    """The hard limits of autotuning.

    Fields:
        cpu_cores: CPU the process tree may use, in cores (:func:`usable_cpus`: affinity,
            cgroup quota, divided among local ranks).
        memory_bytes: bytes the loader may hold: its workers' private memory plus the ring
            (shared, and pinned when pinned: the same bytes, counted once).
    """

    cpu_cores: float
    memory_bytes: int

    def most_workers(self, memory: Callable[[int], int], max_workers: int) -> int:
        """The most workers (at least 1, at most ``max_workers``) whose ``memory(workers)``
        fits the memory budget."""
        n = max_workers
        while n > 1 and memory(n) > self.memory_bytes:
            n -= 1
        return n

    @classmethod
    def default(cls, memory_bytes: int | None = None) -> Budgets:
        """This rank's usable CPUs, and ``memory_bytes`` or ``DEFAULT_MEMORY_SHARE`` of the
        memory available now divided among the local ranks."""
        if memory_bytes is None:
            memory_bytes = int(DEFAULT_MEMORY_SHARE * memory_available() / local_ranks())
        return cls(cpu_cores=usable_cpus(), memory_bytes=memory_bytes)


@dataclass(frozen=True)
class WorkerCost:
    """What one worker costs and gives (NOTE [ What a worker costs ]).

    Fields:
        batch_s: wall seconds one worker takes per batch.
        cpu_s: CPU seconds the process tree spends per delivered batch (0: unknown, no limit).
        worker_bytes: memory one more worker adds (0 for thread workers or unknown).
        slot_bytes: memory one more batch in flight takes (a ring slot; 0 before the first).
        worker_cpu_s: of ``batch_s``, the CPU seconds the worker itself spent (0: unknown).
        queued_s: of ``batch_s``, the seconds it was runnable but waited for a core.
    """

    batch_s: float
    cpu_s: float = 0.0
    worker_bytes: int = 0
    slot_bytes: int = 0
    worker_cpu_s: float = 0.0
    queued_s: float = 0.0

    @classmethod
    def observed(cls, *, workers: int, rate: float, cpu_cores: float = 0.0,
                 worker_bytes: int = 0, slot_bytes: int = 0) -> WorkerCost:
        """The cost seen in a run of ``workers`` workers that delivered ``rate`` batches/s
        using ``cpu_cores`` cores, when the workers were the bottleneck (a tuner trial
        without a step): each took ``workers / rate`` seconds per batch."""
        rate = max(rate, 1e-9)
        return cls(batch_s=workers / rate, cpu_s=cpu_cores / rate, worker_bytes=worker_bytes,
                   slot_bytes=slot_bytes)

    def rate(self, workers: int, *, cpu_cores: float | None = None, step_s: float = 0.0) -> float:
        """Batches/s ``workers`` workers can deliver within ``cpu_cores`` to a loop whose own
        step takes ``step_s`` per batch (0: a loop that only loads)."""
        rate = workers / max(self.batch_s, 1e-9)
        if cpu_cores is not None and self.cpu_s > 0:
            rate = min(rate, cpu_cores / self.cpu_s)
        if step_s > 0:
            rate = min(rate, 1.0 / step_s)
        return rate

    def workers_for(self, rate: float) -> int:
        """The fewest workers that deliver ``rate`` batches/s at this pace (at least 1)."""
        return max(1, math.ceil(rate * self.batch_s - 1e-9))

    def cpu_limit(self, cpu_cores: float) -> int:
        """The most workers before the CPU they use fills ``cpu_cores``: more only queue for
        the cores (``HARD_MAX_WORKERS`` when they use next to none)."""
        if self.cpu_s <= 0:
            return HARD_MAX_WORKERS
        return min(HARD_MAX_WORKERS, max(1, math.floor(cpu_cores / self.cpu_s * self.batch_s
                                                       + 1e-9)))

    def cpu_cores(self, workers: int, *, step_s: float = 0.0) -> float:
        """Cores the tree would use with ``workers`` workers (no CPU budget applied)."""
        return self.rate(workers, step_s=step_s) * self.cpu_s

    @property
    def crowded(self) -> bool:
        """The workers are CPU-bound (of their batch time not spent waiting for a core, at
        least ``CPU_BOUND`` on one: not waiting on I/O or a lock) and wait for a core at
        least ``QUEUED`` of the time they could run: more of them would only queue for the
        cores, whoever keeps the cores busy. A worker waiting on I/O on a busy machine also
        queues at each wake-up, but computes little: it is not crowded."""
        runnable = self.worker_cpu_s + self.queued_s
        awake = max(self.batch_s - self.queued_s, 1e-9)
        return self.worker_cpu_s >= CPU_BOUND * awake and self.queued_s >= QUEUED * runnable > 0

    def memory(self, workers: int, slots: int) -> int:
        """Bytes ``workers`` workers and a ring of ``slots`` slots hold."""
        return workers * self.worker_bytes + slots * self.slot_bytes


def pays_off(before: float, after: float, *, tolerance: float,
             before_hi: float | None = None, after_lo: float | None = None) -> bool:
    """Whether a change that took the rate from ``before`` to ``after`` paid off: ``after``
    beats ``before`` by more than ``tolerance`` (a fraction), and, when the ranges of the runs
    are known, ``after``'s slowest run (``after_lo``) beats ``before``'s fastest
    (``before_hi``): a gain inside the noise is no gain (NOTE [ What a worker costs ])."""
    if after < before * (1 + tolerance):
        return False
    return before_hi is None or after_lo is None or after_lo > before_hi
