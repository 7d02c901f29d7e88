"""What a worker costs and gives: the one model ``gpufeed tune`` (offline, ``_tools/tuner.py``)
and the autotuner (online, ``num_workers="auto"``, ``_host/autotune.py``) both decide with.

NOTE [ What a worker costs ]
----------------------------
A worker turns wall time into batches: one every ``batch_s`` seconds (fetch and collate as
measured where it ran, GIL waits and CPU contention included). The whole process tree (the
workers, the main process receiving batches, the step's own CPU) spends ``cpu_s`` CPU seconds
per delivered batch. So ``n`` workers deliver at most

    rate(n) = min(n / batch_s,  cpu_budget / cpu_s,  1 / step_s)

batches per second: the workers' own pace, what the CPU budget can pay for, and what the
training loop takes (a step of ``step_s`` seconds per batch). The fewest workers for a rate
``r`` are ``ceil(r * batch_s)``; past ``cpu_limit`` more workers only queue for the CPU. A
worker that waits on I/O with the GIL released has ``cpu_s`` far below ``batch_s``, so the CPU
budget then allows many more workers than cores (right for latency-bound storage). A CPU-bound
worker that waits for a core (its run-queue delay, where the kernel says) a large share of its
runnable time is *crowded*: the cores are busy, ours or another program's, and more workers
would only queue; a worker waiting on I/O is not, even when each wake-up queues. Memory: each
worker adds ``worker_bytes`` (a process worker's private memory; 0 for a thread) and each batch
in flight a ring slot of ``slot_bytes`` (shared and pinned at once, counted once).

Whether a change paid off is one rule too (:func:`pays_off`): the rate after must beat the
rate before by more than ``tolerance`` *and* by more than the noise. ``tune`` stops its worker
ladder when a rung does not pay off; the autotuner reverts a growth that did not.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .._base.system import local_ranks, memory_available, usable_cpus

#: the autotuner's default memory budget, a share of what is available at start (divided
#: among the local ranks): the training itself needs the rest
DEFAULT_MEMORY_SHARE = 0.25
#: the default bound per usable CPU: I/O-bound workers cost little CPU; the CPU budget binds
WORKERS_PER_CPU = 8
HARD_MAX_WORKERS = 64
#: :attr:`WorkerCost.crowded`'s thresholds
CPU_BOUND = 0.5
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


def default_max_workers(cpu_cores: float) -> int:
    """``WORKERS_PER_CPU`` per usable CPU of this rank, at least 2, at most the hard max."""
    return max(2, min(HARD_MAX_WORKERS, int(WORKERS_PER_CPU * cpu_cores)))


@dataclass(frozen=True)
class Budgets:
    """The hard limits of autotuning: the cores the process tree may use
    (:func:`usable_cpus`), and the bytes the loader may hold (its workers' private memory
    plus the ring, counted once)."""

    cpu_cores: float
    memory_bytes: int

    @classmethod
    def default(cls, memory_bytes: int | None = None) -> Budgets:
        """This rank's usable CPUs, and ``memory_bytes`` or the default share."""
        if memory_bytes is None:
            memory_bytes = int(DEFAULT_MEMORY_SHARE * memory_available() / local_ranks())
        return cls(cpu_cores=usable_cpus(), memory_bytes=memory_bytes)


@dataclass(frozen=True)
class WorkerCost:
    """What one worker costs and gives (NOTE [ What a worker costs ]; its memory is
    ``Gauges.memory`` in ``_host/window.py``); 0: unknown (no CPU limit for ``cpu_s``).
    ``worker_cpu_s`` and ``queued_s`` are the parts of ``batch_s`` the worker spent on a core
    and waiting for one."""

    batch_s: float
    cpu_s: float = 0.0
    worker_cpu_s: float = 0.0
    queued_s: float = 0.0

    @classmethod
    def observed(cls, *, workers: int, rate: float, cpu_cores: float = 0.0) -> WorkerCost:
        """The cost seen in a run whose workers were the bottleneck (a tuner trial without a
        step): each took ``workers / rate`` seconds per batch."""
        rate = max(rate, 1e-9)
        return cls(batch_s=workers / rate, cpu_s=cpu_cores / rate)

    def workers_for(self, rate: float) -> int:
        """The fewest workers (at least 1) that deliver ``rate`` batches/s."""
        return max(1, math.ceil(rate * self.batch_s - 1e-9))

    def cpu_limit(self, cpu_cores: float) -> int:
        """The most workers before their CPU fills ``cpu_cores`` (more only queue)."""
        if self.cpu_s <= 0:
            return HARD_MAX_WORKERS
        return min(HARD_MAX_WORKERS, max(1, math.floor(cpu_cores / self.cpu_s * self.batch_s
                                                       + 1e-9)))

    @property
    def crowded(self) -> bool:
        """CPU-bound (on a core ``CPU_BOUND`` of their batch time less the wait for one) and
        waiting for a core ``QUEUED`` of their runnable time (NOTE [ What a worker costs ])."""
        runnable = self.worker_cpu_s + self.queued_s
        awake = max(self.batch_s - self.queued_s, 1e-9)
        return self.worker_cpu_s >= CPU_BOUND * awake and self.queued_s >= QUEUED * runnable > 0


def pays_off(before: float, after: float, *, tolerance: float,
             before_hi: float | None = None, after_lo: float | None = None) -> bool:
    """Whether ``after`` beats ``before`` by more than ``tolerance`` (a fraction) and, when
    known, its slowest run (``after_lo``) beats ``before``'s fastest (``before_hi``): a gain
    inside the noise is no gain (NOTE [ What a worker costs ])."""
    if after < before * (1 + tolerance):
        return False
    return before_hi is None or after_lo is None or after_lo > before_hi
