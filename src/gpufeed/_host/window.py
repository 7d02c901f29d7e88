"""What the autotuner reads, returns and remembers: one measuring window, the memory gauges,
the move it returns, the change it verifies and the memos of what did not pay (NOTE
[ Autotuning decisions ] in ``_host/autotune.py``; ``_host/auto_iter.py`` measures)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .cost import WorkerCost


class Gauges(NamedTuple):
    """Memory figures the iterator reads without cost: one worker's private memory (0 for
    threads, or before it was read), a ring slot, the ring now, the work-ahead chunking gives
    each worker regardless of depth (``2 * chunk`` when cheap batches are chunked, else 0),
    and the slots the consumer holds beyond those in flight."""

    worker_bytes: int = 0
    slot_bytes: int = 0
    ring_bytes: int = 0
    chunk_ahead: int = 0
    held: int = 0

    def slots(self, workers: int, depth: int) -> int:
        return workers * max(depth, self.chunk_ahead) + self.held

    def memory(self, workers: int, depth: int) -> int:
        return workers * self.worker_bytes + self.slots(workers, depth) * self.slot_bytes


_NO_GAUGES = Gauges()


@dataclass(frozen=True)
class Window:
    """What the loop and the workers did over one window (see NOTE [ Autotuning decisions ])."""

    workers: int
    depth: int
    batches: int
    seconds: float
    wait_s: float  # the loop blocked in next()
    starved_s: float  # of which nothing was ready: waiting for workers
    step_s: float  # the loop's own time between batches
    busy_s: float  # worker seconds (fetch + collate) of the batches answered
    answered: int
    cpu_s: float | None  # process-tree CPU seconds; None: not measured
    gauges: Gauges = _NO_GAUGES
    worker_cpu_s: float = 0.0  # of cpu_s, the workers' own
    queued_s: float = 0.0  # seconds the workers were runnable but waited for a core

    @property
    def rate(self) -> float:
        return self.batches / self.seconds if self.seconds > 0 else 0.0

    @property
    def input_bound(self) -> float:
        loop = self.wait_s + self.step_s
        return self.starved_s / loop if loop > 0 else 0.0

    @property
    def step_per_batch(self) -> float:
        return self.step_s / self.batches if self.batches else 0.0

    @property
    def cpu_cores(self) -> float | None:
        return None if self.cpu_s is None or self.seconds <= 0 else self.cpu_s / self.seconds

    def cost(self) -> WorkerCost:
        batch_s = self.busy_s / self.answered if self.answered else self.workers / max(
            self.rate, 1e-9)
        cpu = self.cpu_s / self.batches if self.cpu_s is not None and self.batches else 0.0
        per = 1 / self.answered if self.answered else 0.0
        return WorkerCost(batch_s, cpu, self.worker_cpu_s * per, self.queued_s * per)

    def memory_used(self) -> int:
        return self.workers * self.gauges.worker_bytes + self.gauges.ring_bytes


class Move(NamedTuple):
    """Settings for the iterator to apply now: the worker count and batches ahead per worker."""

    workers: int
    depth: int


class Change(NamedTuple):
    """A change being verified: its kind, the window that led to it, (before, after), the
    rate it must beat (the better of the last two windows before it: a dip is no baseline),
    and how many windows after it paid already."""

    kind: str
    before: Window
    workers: tuple[int, int]
    depth: tuple[int, int]
    baseline: float = 0.0
    confirmed: int = 0


class Memo(NamedTuple):
    """A count (or depth) that did not pay, or that the loop needed, under a step of
    ``step_s`` per batch, remembered until ``until`` (``time.monotonic``)."""

    value: int
    step_s: float
    until: float


def ratio(a: float, b: float) -> float:
    """How many times larger the larger of two positive figures is (1.0 if either is 0)."""
    return max(a, b) / min(a, b) if min(a, b) > 0 else 1.0


def pct(x: float) -> str:
    return f"{x:.0%}"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"
