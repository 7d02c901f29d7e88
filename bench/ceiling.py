"""The no-loader ceiling: what the machine does with ``processes`` workers and no loader.

``measure_no_loader`` bounds from above what a loader with that many workers on these cores
can deliver; the CPU benchmark reports each loader as a share of it.

NOTE [ No-loader ceiling ]
--------------------------
``processes`` plain processes are forked (so they inherit the dataset as a forking loader's
workers do); process ``k`` takes batches ``k, k + processes, ...`` (the stock loader's
round-robin), fetches and collates each with ``fetch`` and drops it: no queue, no batch leaves
the process. Each runs ``init`` (one torch thread) and fetches the first index of its share once
(lazy imports, a decoder's plugin registry, opening a memory map), says it is ready and waits for
one start event, which the parent sets once all are ready, so forking and start-up are not
timed. Each reads the clock after the event and after its last batch; ``time.perf_counter`` is
``CLOCK_MONOTONIC`` on Linux, one clock for every process, so the figure is all samples over
(last end - first start). What a loader adds (sending batches, the main process receiving them)
is not in it, which is why it bounds a loader with as many workers on the same cores from above
(up to noise: its first batches are timed, where a loader's rate skips whole warm-up batches).

What the benchmark adds is in it when asked: ``sample_memory=True`` runs the same PSS sampler
thread as ``measure_loader`` (same interval, same reads) in the parent for the length of the
pass. The benchmarks ask, because a loader's runs carry it: reading the PSS of a process tree
that maps image-array's 2.9 GB file costs enough CPU that, on two cores, gpufeed ran 6% slower
with it than without (median of 9 alternating rounds, 7 slower;
``round19/image-array/sampler-ab.json`` in the results' git history), and a ceiling without
it put that cost on the loaders' side.
"""

from __future__ import annotations

import multiprocessing
import queue
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpufeed._tools.measure import PeakSampler, batch_samples_and_bytes

__all__ = ["NoLoaderMeasurement", "measure_no_loader"]


@dataclass(frozen=True)
class NoLoaderMeasurement:
    """What one pass of ``measure_no_loader`` saw (NOTE [ No-loader ceiling ]).

    Attributes:
        samples: samples fetched by all processes together.
        batches: batches fetched by all processes together.
        seconds: wall time from the first process's start to the last one's end.
        samples_per_s: ``samples / seconds``.
        bytes_per_s: bytes of tensor/array leaves fetched per second.
        processes: how many processes fetched.
        process_seconds: each process's own time from the start event to its last batch
            (their spread shows how evenly the work fell).
        memory_samples: PSS samples taken during the pass (``sample_memory``; else 0).
        peak_pss_bytes: the highest PSS of the process tree they saw (0 without samples).
    """

    samples: int
    batches: int
    seconds: float
    samples_per_s: float
    bytes_per_s: float
    processes: int
    process_seconds: tuple[float, ...]
    memory_samples: int = 0
    peak_pss_bytes: int = 0


def _no_loader_process(k: int, fetch: Callable[[list[int]], Any], batches: Sequence[Sequence[int]],
                       init: Callable[[], None] | None, warmup: bool,
                       count: Callable[[Any], tuple[int, int]], max_seconds: float | None,
                       start: Any, results: Any) -> None:
    """Body of process ``k`` of ``measure_no_loader``: report ready, wait, fetch, report."""
    try:
        if init is not None:
            init()
        if warmup and batches:
            count(fetch([batches[0][0]]))  # untimed: first-call set-up (see the NOTE)
        results.put(("ready", k))
        start.wait()
        t0 = time.perf_counter()
        samples = nbytes = done = 0
        for indices in batches:
            n, b = count(fetch(list(indices)))  # the batch is dropped at once
            samples, nbytes, done = samples + n, nbytes + b, done + 1
            if max_seconds is not None and time.perf_counter() - t0 >= max_seconds:
                break
        results.put(("done", k, samples, nbytes, done, t0, time.perf_counter()))
    except BaseException:
        results.put(("error", k, traceback.format_exc()))


def _next_message(results: Any, procs: Sequence[Any], done: Mapping[int, Any], deadline: float,
                  timeout_s: float) -> tuple[Any, ...] | None:
    """The next message of ``measure_no_loader``'s processes, or None after 0.2 s without one;
    raises when a process died without a result or the pass ran past its deadline."""
    try:
        return tuple(results.get(timeout=0.2))
    except queue.Empty:
        pass
    dead = [k for k, p in enumerate(procs) if k not in done and not p.is_alive()]
    if dead:  # a process that exits normally has put its message before exiting
        try:
            return tuple(results.get(timeout=1.0))
        except queue.Empty:
            raise RuntimeError(
                f"no-loader process {dead[0]} exited with code {procs[dead[0]].exitcode} "
                "without a result (killed, e.g. out of memory?)") from None
    if time.monotonic() > deadline:
        raise RuntimeError(f"the no-loader pass ran past timeout_s={timeout_s:g}")
    return None


def measure_no_loader(
    fetch: Callable[[list[int]], Any],
    batches: Sequence[Sequence[int]],
    *,
    processes: int,
    init: Callable[[], None] | None = None,
    warmup: bool = True,
    max_seconds: float | None = None,
    count: Callable[[Any], tuple[int, int]] = batch_samples_and_bytes,
    timeout_s: float = 3600.0,
    sample_memory: bool = False,
    sample_interval_s: float = 0.02,
) -> NoLoaderMeasurement:
    """Fetch ``batches`` in ``processes`` forked processes with no loader and time it: the
    ceiling of a loader with that many workers (NOTE [ No-loader ceiling ]).

    Args:
        fetch: indices -> batch (e.g. ``__getitems__`` or ``__getitem__`` per index, then the
            collate function); its result is counted with ``count`` and dropped.
        batches: the index lists of the pass; process ``k`` takes every ``processes``-th from
            ``k``.
        processes: processes that fetch (a loader's ``num_workers``).
        init: run in each process before the start signal (untimed), e.g. to set torch threads.
        warmup: each process fetches the first index of its share once before the start signal
            (untimed; not counted), so first-call set-up is not timed. False: time it.
        max_seconds: each process stops after the batch that passes this many seconds
            (``None``: every batch). Bounds the run time on large data sets.
        count: ``(samples, bytes)`` of a batch, as for ``measure_loader``.
        timeout_s: give up (and kill the processes) after this many seconds in all.
        sample_memory: run ``measure_loader``'s PSS sampler (every ``sample_interval_s``, with
            the held shared memory) during the pass, so that the ceiling bears its cost as a
            loader's run does (see the NOTE); its peak is ``peak_pss_bytes``.

    Raises:
        ValueError: bad knobs. RuntimeError: a process failed (its traceback is in the message),
            died, or the pass ran past ``timeout_s``. Needs the ``fork`` start method (Linux).
    """
    if processes < 1:
        raise ValueError(f"processes={processes} must be at least 1")
    if max_seconds is not None and max_seconds <= 0:
        raise ValueError(f"max_seconds={max_seconds} must be positive (or None for no limit)")
    if not batches:
        raise ValueError("batches is empty: give at least one batch of indices to fetch")
    ctx = multiprocessing.get_context("fork")
    start, results = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_no_loader_process, name=f"gpufeed-no-loader-{k}", daemon=True,
                         args=(k, fetch, batches[k::processes], init, warmup, count, max_seconds,
                               start, results)) for k in range(processes)]
    ready: set[int] = set()
    done: dict[int, tuple[Any, ...]] = {}
    deadline = time.monotonic() + timeout_s
    sampler = None
    try:
        for p in procs:
            p.start()
        if sample_memory:  # the processes exist: the sampler reads the tree they make
            sampler = PeakSampler(held=True).start_thread(sample_interval_s)
        while len(done) < processes:
            msg = _next_message(results, procs, done, deadline, timeout_s)
            if msg is None:
                continue
            if msg[0] == "error":
                raise RuntimeError(f"no-loader process {msg[1]} failed:\n{msg[2]}")
            if msg[0] == "ready":
                ready.add(msg[1])
                if len(ready) == processes:
                    start.set()
            else:
                done[msg[1]] = msg[2:]
    finally:
        if sampler is not None:
            sampler.stop()
        for p in procs:  # after a failure the others may wait for a start that never comes
            if p.pid is not None:
                p.join(timeout=10.0 if len(done) == processes else 0.0)
                if p.is_alive():
                    p.kill()
                    p.join()
        results.close()
        results.join_thread()
    samples = sum(d[0] for d in done.values())
    seconds = max(max(d[4] for d in done.values()) - min(d[3] for d in done.values()), 1e-9)
    return NoLoaderMeasurement(
        samples=samples, batches=sum(d[2] for d in done.values()), seconds=seconds,
        samples_per_s=samples / seconds, bytes_per_s=sum(d[1] for d in done.values()) / seconds,
        processes=processes, process_seconds=tuple(done[k][4] - done[k][3] for k in sorted(done)),
        memory_samples=sampler.count if sampler else 0,
        peak_pss_bytes=sampler.peak.pss if sampler else 0)
