"""Peaks of a process tree's memory while a loader runs: ``PeakSampler``, sampled by a thread
or from the loop, and its cheap gauges (/dev/shm use, pinned bytes). ``_tools/measure.py`` says
what the kinds of memory hold and why shared memory mapped nowhere is read too."""

from __future__ import annotations

import threading
import time

import torch

from .._memory.pinning import registered_bytes
from .probe import TreeMemory, process_tree_memory, shm_usage


def pinned_bytes() -> int:
    """Pinned host bytes (CUDA only): torch's caching host allocator plus the regions gpufeed
    registered (``pinning.registered_bytes``)."""
    stats = torch.cuda.host_memory_stats()
    return int(stats.get("allocated_bytes.current", 0)) + int(registered_bytes())


def _shm_used() -> int:
    usage = shm_usage()
    return usage[0] - usage[1] if usage is not None else 0


class PeakSampler:
    """Peaks of this process tree's memory, sampled on demand or by a daemon thread.

    ``peak``: the sample (``process_tree_memory``) with the highest PSS; ``start``: the first;
    ``count``: how many. ``held``: the highest PSS plus the shared memory the tree holds but
    maps nowhere (read only with ``held=True``, else it follows the PSS). With ``gauges=True``,
    :meth:`sample_gauges` keeps ``shm_used`` (bytes used on /dev/shm, machine-wide; ``shm_start``
    when built) and ``pinned`` (:func:`pinned_bytes`, CUDA only).
    """

    def __init__(self, *, gauges: bool = False, held: bool = False) -> None:
        self.start = self.peak = TreeMemory(0)
        self.held = 0
        self._read_unmapped = held
        self.count = 0
        self.interval_s = 0.0
        self.shm_start = self.shm_used = _shm_used() if gauges else 0
        self.pinned = 0
        self._cuda = gauges and torch.cuda.is_available() and hasattr(torch.cuda,
                                                                      "host_memory_stats")
        self._next = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start_thread(self, interval_s: float) -> PeakSampler:
        """Sample now, then every ``interval_s`` (stretched to ten times the cost of a sample
        when that is longer) in a daemon thread until :meth:`stop`."""
        self.interval_s = interval_s
        self.sample()
        self._thread = threading.Thread(target=self._run, name="gpufeed-pss", daemon=True)
        self._thread.start()
        return self

    def sample(self) -> float:
        """Take one sample now (any thread); return what it cost in seconds."""
        t0 = time.perf_counter()
        value = process_tree_memory(unmapped=self._read_unmapped)
        with self._lock:
            if self.count == 0:
                self.start = self.peak = value
            elif value.pss > self.peak.pss:
                self.peak = value
            self.held = max(self.held, value.held)
            self.count += 1
        return time.perf_counter() - t0

    def maybe_sample(self, every_s: float) -> None:
        """Sample when ``every_s`` seconds have passed since this method last sampled (the
        first call samples)."""
        now = time.perf_counter()
        if now >= self._next:
            self.sample()
            self._next = now + every_s

    def sample_gauges(self) -> None:
        """Read /dev/shm use and pinned bytes (``gauges=True``) and keep their peaks."""
        self.shm_used = max(self.shm_used, _shm_used())
        if self._cuda:
            self.pinned = max(self.pinned, pinned_bytes())

    def thread_cpu_s(self) -> float:
        """CPU seconds the sampling thread has used so far (0 without one)."""
        thread = self._thread
        try:  # (AttributeError, OSError): no per-thread CPU clocks here, or it has ended
            return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))  # type: ignore[union-attr,arg-type]
        except (AttributeError, OSError, TypeError):
            return 0.0

    def _run(self) -> None:
        wait = self.interval_s
        while not self._stop.wait(wait):
            cost = self.sample()
            wait = max(self.interval_s, 10.0 * cost)

    def stop(self) -> None:
        """Stop the thread (if started) and take a last sample."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()
