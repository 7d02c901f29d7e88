"""Measuring a loader honestly: throughput, first-batch latency and process-tree memory.

``measure_loader`` times any iterable of batches (a ``gpufeed.DataLoader``, the stock
``torch.utils.data.DataLoader``, a ``torchdata.nodes.Loader``, a generator) the same way
(:class:`Measurement` says what each figure covers). Its memory figure is the peak PSS of this
process plus all its descendants, summed (NOTE [ Measuring honestly ] (1)), sampled by a daemon
thread. Reading PSS makes the kernel walk every page table of the tree (about 40 us per
resident MiB on the VMs we measure on), so the sampler waits at least ten times a sample's
cost: it takes at most about 10% of one core. One more sample is taken, untimed, when the pass
is about to end (the last batch of a ``len()``-known pass, or the batch that hits
``max_batches``/``max_seconds``) while the workers still run: memory that only grows during a
pass (mapped file pages) peaks there, and sparse samples would miss it by a varying amount.

The peak is also split by kind (``Pss_Anon``, ``Pss_File`` and ``Pss_Shmem`` of
``/proc/<pid>/smaps_rollup``, summed over the tree at the peak sample), because the kinds
behave differently when two loaders are compared:

- **anon**: heaps, decoded samples, copy-on-write copies of the dataset in forked workers,
  thread workers' batches;
- **file**: mapped file pages: shared libraries (whose PSS also falls when *other* processes
  map them) and memory-mapped data such as a ``numpy.memmap`` dataset, which grows with the
  samples read, so two loaders compare fairly only when they read the same samples;
- **shmem**: shared memory that some process of the tree maps (the stock loader's per-batch
  segments once received, gpufeed's slot ring).

Shared memory that the tree holds open but no process maps is in no PSS: the stock loader's
queued batches are such memory (a worker collates into a /dev/shm segment and passes its
descriptor on; the main process maps it when it takes the batch). So the sampler also reads it
(``probe.unmapped_shared_bytes``) and keeps the peak of PSS plus it, ``peak_held_bytes``.
Descriptors in transit inside a socket are in neither.

NOTE [ Measuring honestly ]
---------------------------
What the figures of ``measure_loader``, ``gpufeed bench`` and ``python -m bench``
rest on, so that two loaders are compared and not two conditions:

1. **PSS, not RSS.** PSS (proportional set size) divides every shared page (shared memory,
   memory-mapped files, copy-on-write pages after ``fork``) between the processes that map it,
   so the sum over the process tree counts each page once. Summed RSS counts a shared page once
   per process and overstates a multi-process loader several times over.
2. **One intra-op thread.** In ``gpufeed bench`` and the CPU benchmark every loader's workers
   start with :func:`one_intra_op_thread` as their ``worker_init_fn``: a worker left at torch's
   default of one thread per core oversubscribes the CPUs and collapses decode throughput on
   small machines. The CPU benchmark runs its main process with one torch thread too.
3. **A warm page cache.** The benchmark workloads that read files read every file once before
   any timing (``warm`` in ``bench/workloads.py``): no loader pays for the first read.
4. **Interleaved repeats.** Every configuration runs several times, round-robin with the others
   (``gpufeed bench``: NOTE [ Repeated measurement ] in ``_tools/repeat.py``; the CPU benchmark
   rotates the order of its loaders from one repeat to the next), and reports the median.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._memory.pinning import registered_bytes
from .probe import TreeMemory, process_tree_memory, shm_usage


@dataclass(frozen=True)
class Measurement:
    """What one pass of ``measure_loader`` saw.

    Attributes:
        samples, batches: delivered after the warm-up (the ones the rate counts).
        seconds: wall time from the end of the warm-up to the last counted batch.
        samples_per_s: ``samples / seconds``.
        bytes_per_s: bytes of tensor/array leaves delivered per second after the warm-up.
        first_batch_s: seconds from just before ``iter()`` (worker start-up included) to the
            first batch.
        peak_pss_bytes: the tree's highest PSS while the iterator was alive (0 unsampled).
        start_pss_bytes: the tree's PSS just before ``iter()`` (0 unsampled); the peak less
            this is the growth caused by iterating.
        warmup_batches: batches delivered before the rate clock started.
        memory_samples: PSS samples taken.
        peak_pss_anon_bytes, peak_pss_file_bytes, peak_pss_shmem_bytes: the peak sample by
            kind, adding up to ``peak_pss_bytes`` within rounding (0 unsampled, or where the
            kernel gives no split).
        peak_held_bytes: the highest PSS plus shared memory mapped by no process of the tree,
            in one sample; at least ``peak_pss_bytes`` when sampled.
        main_thread_cpu_s: CPU seconds of the iterating thread over the counted batches: the
            loader's work in the main thread (receiving, unpacking, releasing) and this loop's.
            It is what the loader costs the process that trains, which competes with its own
            workers for the cores.
        main_process_cpu_s: the same for every thread of this process but the PSS sampler's
            (a loader's helper threads, thread workers); worker processes are not in it.
        worker_nice: a gpufeed loader's workers' priority at the end (its stats gauge).
    """

    samples: int
    batches: int
    seconds: float
    samples_per_s: float
    bytes_per_s: float
    first_batch_s: float
    peak_pss_bytes: int
    start_pss_bytes: int = 0
    warmup_batches: int = 0
    memory_samples: int = 0
    peak_pss_anon_bytes: int = 0
    peak_pss_file_bytes: int = 0
    peak_pss_shmem_bytes: int = 0
    peak_held_bytes: int = 0
    main_thread_cpu_s: float = 0.0
    main_process_cpu_s: float = 0.0
    worker_nice: int = 0


def batch_samples_and_bytes(batch: Any) -> tuple[int, int]:
    """``(samples, bytes)`` of a batch: the first dimension of its first tensor or array leaf
    (``len(batch)`` when there is none), and the bytes of all tensor and array leaves, walking
    tuples, lists, dicts and namedtuples."""
    samples: int | None = None
    nbytes = 0
    stack: list[Any] = [batch]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            nbytes += item.element_size() * item.numel()
            if samples is None and item.dim() > 0:
                samples = int(item.shape[0])
        elif isinstance(item, np.ndarray):
            nbytes += int(item.nbytes)
            if samples is None and item.ndim > 0:
                samples = int(item.shape[0])
        elif isinstance(item, Mapping):
            stack.extend(reversed(list(item.values())))
        elif isinstance(item, (tuple, list)):
            stack.extend(reversed(item))
    if samples is None:
        samples = len(batch) if isinstance(batch, (tuple, list)) else 1
    return samples, nbytes


def one_intra_op_thread(worker_id: int = 0) -> None:
    """``worker_init_fn`` given to every loader measured side by side: one torch intra-op
    thread per worker (NOTE [ Measuring honestly ] (2))."""
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def measure_loader(
    make_iterable: Callable[[], Iterable[Any]],
    *,
    max_batches: int | None = None,
    max_seconds: float | None = None,
    warmup_batches: int = 2,
    consume: Callable[[Any], None] | None = None,
    sample_memory: bool = True,
    sample_interval_s: float = 0.02,
    sample_held: bool = True,
) -> Measurement:
    """Iterate one pass over ``make_iterable()`` and measure it.

    Args:
        make_iterable: builds the loader (or any iterable of batches), untimed.
        max_batches: stop after this many batches in all, warm-up included (``None``: the whole
            pass).
        max_seconds: stop this many seconds after the warm-up ended (``None``: no limit); the
            rate stays exact, the batches counted over the time they took.
        warmup_batches: batches delivered before the rate clock starts (worker start-up, first
            page faults, allocator growth); must leave at least one batch to time.
        consume: called on every batch (as a training step would be); its time counts in the
            rate. ``None``: the batch is dropped at once.
        sample_memory: sample the tree's PSS (see the module docstring); turn it off where PSS
            is not available.
        sample_held: also read the shared memory the tree holds but maps nowhere
            (``peak_held_bytes``): each process's descriptors and, when one is shared
            memory, its ``/proc/<pid>/maps`` (a few ms, mostly the kernel's, per sample).
        sample_interval_s: seconds between PSS samples (stretched to ten times the cost of a
            sample when that is longer). Shorter catches briefer peaks and costs more CPU.

    Raises:
        ValueError: bad knobs, or fewer batches than ``warmup_batches + 1``.
    """
    if warmup_batches < 0:
        raise ValueError(f"warmup_batches={warmup_batches} is negative; use 0 or more")
    if max_batches is not None and max_batches <= warmup_batches:
        raise ValueError(
            f"max_batches={max_batches} leaves no batch to time after "
            f"warmup_batches={warmup_batches}; use max_batches > warmup_batches"
        )
    if max_seconds is not None and max_seconds <= 0:
        raise ValueError(f"max_seconds={max_seconds} must be positive (or None for no limit)")
    if sample_interval_s <= 0:
        raise ValueError(f"sample_interval_s={sample_interval_s} must be positive")

    iterable = make_iterable()
    try:
        pass_len: int | None = len(iterable)  # type: ignore[arg-type]
    except TypeError:  # an iterable dataset, a generator: the end is not known ahead
        pass_len = None
    ends = [n for n in (pass_len, max_batches) if n is not None]
    last = min(ends) if ends else None  # the batch after which the pass ends, when known
    sampler = PeakSampler(held=sample_held).start_thread(sample_interval_s) \
        if sample_memory else None
    seen = samples = nbytes = 0
    first_batch_s = 0.0
    t_start = time.perf_counter()
    t_rate = t_start
    t_end = t_start
    # CPU clocks: read where the rate clock starts, and at the last batch (or the loop's end)
    cpu_rate = _cpu_now(sampler)
    cpu_end: tuple[float, float] | None = None
    iterator = iter(iterable)
    try:
        for batch in iterator:
            now = time.perf_counter()
            if seen == 0:
                first_batch_s = now - t_start
            if consume is not None:
                consume(batch)
                now = time.perf_counter()
            seen += 1
            if seen <= warmup_batches:
                t_rate = now
                cpu_rate = _cpu_now(sampler)
            else:
                n, b = batch_samples_and_bytes(batch)
                samples += n
                nbytes += b
                t_end = now
            timed_out = (max_seconds is not None and seen > warmup_batches
                         and now - t_rate >= max_seconds)
            ending = timed_out or (last is not None and seen >= last)
            if ending and seen > warmup_batches:
                cpu_end = _cpu_now(sampler)
            if sampler is not None and ending:
                sampler.sample()  # the end of the pass, workers still running (see the top)
            del batch
            if timed_out or (max_batches is not None and seen >= max_batches):
                break
        if cpu_end is None:
            cpu_end = _cpu_now(sampler)
    finally:
        close = getattr(iterator, "close", None)
        if callable(close):  # generators and gpufeed iterators; others stop when collected
            close()
        stats = getattr(iterable, "stats", None)  # gpufeed's: NOTE [ Worker priority ]
        nice = stats().counters.get("worker_nice", 0) if callable(stats) else 0
        del iterator, iterable
        gc.collect()  # loaders that stop their workers when collected stop them now
        if sampler is not None:
            sampler.stop()
    if seen <= warmup_batches:
        raise ValueError(
            f"the iterable gave {seen} batches, not enough to time after "
            f"warmup_batches={warmup_batches}; lower warmup_batches or use more data"
        )
    seconds = max(t_end - t_rate, 1e-9)
    return Measurement(
        samples=samples,
        batches=seen - warmup_batches,
        seconds=seconds,
        samples_per_s=samples / seconds,
        bytes_per_s=nbytes / seconds,
        first_batch_s=first_batch_s,
        peak_pss_bytes=sampler.peak.pss if sampler else 0,
        start_pss_bytes=sampler.start.pss if sampler else 0,
        warmup_batches=warmup_batches,
        memory_samples=sampler.count if sampler else 0,
        peak_pss_anon_bytes=sampler.peak.anon if sampler else 0,
        peak_pss_file_bytes=sampler.peak.file if sampler else 0,
        peak_pss_shmem_bytes=sampler.peak.shmem if sampler else 0,
        peak_held_bytes=sampler.held if sampler else 0,
        main_thread_cpu_s=cpu_end[0] - cpu_rate[0],
        # >= the thread's: the process clock lags a thread busy on another core by up to a tick
        main_process_cpu_s=max(cpu_end[1] - cpu_rate[1], cpu_end[0] - cpu_rate[0]),
        worker_nice=nice,
    )


def _cpu_now(sampler: PeakSampler | None) -> tuple[float, float]:
    """(CPU seconds of this thread, of this process without the PSS sampler's thread)."""
    own = sampler.thread_cpu_s() if sampler is not None else 0.0
    return time.thread_time(), time.process_time() - own


# -- the memory peaks: a process tree's, sampled by a thread or from the loop ---------------------

def _shm_used() -> int:
    usage = shm_usage()
    return usage[0] - usage[1] if usage is not None else 0


class PeakSampler:
    """Peaks of this process tree's memory, sampled on demand or by a daemon thread.

    ``peak``: the sample (``process_tree_memory``) with the highest PSS; ``start``: the first;
    ``count``: how many. ``held``: the highest PSS plus the shared memory the tree holds but
    maps nowhere (read only with ``held=True``, else it follows the PSS). With ``gauges=True``,
    :meth:`sample_gauges` keeps ``shm_used`` (bytes used on /dev/shm, machine-wide; ``shm_start``
    when built) and ``pinned`` (CUDA only: torch's caching host allocator plus the regions gpufeed
    registered, ``pinning.registered_bytes``).
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
        """Sample now, then every ``interval_s`` or more (see ``measure_loader``) in a daemon
        thread until :meth:`stop`."""
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
            stats = torch.cuda.host_memory_stats()
            pinned = int(stats.get("allocated_bytes.current", 0)) + int(registered_bytes())
            self.pinned = max(self.pinned, pinned)

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
