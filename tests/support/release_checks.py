"""What the release-fence tests share: the batches a synchronous copy would give, the
problems a simulated run shows, a consumer kernel that records what it read, and a thread
that drops the batches it is handed (tests/memory/test_release_*.py, test_ring_lifetime.py)."""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

from .sim_cuda import SimCuda

WIDTH = 16  # IndexDataset's default width


def batch_sum(first: int, rows: int = 4, width: int = WIDTH) -> float:
    """The checksum of ``rows`` IndexDataset samples from ``first`` on."""
    return float((torch.arange(width * rows, dtype=torch.float64) + first * width).sum())


def expected(n: int, bs: int) -> list[tuple[int, float]]:
    """What a synchronous copy of batch k holds: (first index, checksum)."""
    return [(k * bs, batch_sum(k * bs, bs)) for k in range(n)]


def problems(sim: SimCuda, seen: list[Any], want: list[Any]) -> list[str]:
    """The simulator's violations, and the batches that differ from a synchronous copy."""
    out = list(dict.fromkeys(sim.violations))[:5]
    bad = [k for k, (a, b) in enumerate(itertools.zip_longest(seen, want)) if a != b]
    if bad:
        out.append(f"{len(bad)} of {len(want)} batches differ from a synchronous copy, "
                   f"first {bad[:5]}")
    return out


def recorder(seen: list[tuple[int, float]]) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """A consumer kernel: records (first index, checksum) of the batch when it runs."""

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        seen.append((int(y[0]), float(x.double().sum())))

    return step


class InterruptOnce:
    """An event whose first wait is interrupted by a Ctrl-C (then it has completed)."""

    def __init__(self) -> None:
        self.waits = 0

    def query(self) -> bool:
        return self.waits > 1

    def synchronize(self) -> None:
        self.waits += 1
        if self.waits == 1:
            raise KeyboardInterrupt


class Dropper:
    """A thread that drops what it is handed: ``give(obj)``, drop your own reference, then
    ``wait()`` returns once the thread has let go of it (the last reference went there)."""

    def __init__(self) -> None:
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._dropped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._inbox.get()) is not None:
            del item
            self._dropped.set()

    def give(self, obj: Any) -> None:
        self._dropped.clear()
        self._inbox.put(obj)

    def wait(self) -> None:
        self._dropped.wait(10)

    def stop(self) -> None:
        self._inbox.put(None)
        self._thread.join(10)
