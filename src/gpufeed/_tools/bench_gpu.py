"""GPU benchmark: the host-to-device path, ``python -m bench gpu [--out DIR]``.

Host-to-device GB/s, one batch of ``batch_size`` uint8 3x224x224 images at a time (result keys):

    a_pageable_to                  pageable ``.to(device)`` (a loader without pin_memory)
    b_pin_memory_per_batch         ``.pin_memory().to(non_blocking=True)``: a pinned copy per batch
    c_stock_dataloader_pin_memory  stock DataLoader, pin_memory=True (shared memory, pin thread)
    d_gpufeed_dataloader           gpufeed.DataLoader(pin_memory=True, device=): page-locked ring
    d_to_device_pinned_region      to_device over views of one registered region (no workers)
    e_raw_pinned_copy              raw pinned ``copy_`` into one device buffer: the ceiling

and the overlap of a synthetic step (``torch.cuda._sleep`` calibrated to T, the measured time
of one copy) with that copy: a naive loop pays about 2T per step, ``to_device`` should pay T
(target <= 1.05 T, start-up included). Targets for bandwidth: d >= 0.9 e (for the loader only
when its workers gather faster than PCIe copies). Medians of ``repeats`` runs. Without CUDA it
says so and measures nothing (the lab's command then exits with status 0, writing nothing).

Steady state: the data is ``DISTINCT`` batches (more than a CPU's last-level cache), every page
touched before timing, read over and over; the loaders (c) and (d) read the same
``ArrayDataset`` over it (one gather per batch for both) through a sampler that cycles through
it. A worker process still page-faults on its first read of each page of the parent's data, so
a fresh worker runs several times slower than a warm one. Each run therefore warms up until
every worker has had the chance to read every distinct batch (``DISTINCT`` batches per worker)
and gpufeed's ring has stopped growing (no slot carved, so nothing registered with
``cudaHostRegister``, for ``warmup_batches`` batches in a row; at most ``WARMUP_CAP`` times the
least): page faults, registration and worker start-up stay outside the timed window. The stock
loader gets as many warm-up batches; a ring that still grew inside the window is reported in
``notes``.

Measurements: docs/how-it-works/measurements/tools.md#gpu-benchmark-warm-up.
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from .._device.stage import to_device
from .._memory import pinning as _pinning
from .environment import environment

logger = logging.getLogger(__name__)

SKIPPED = "no CUDA device: GPU benchmark skipped"
SCHEMA = "gpufeed-bench-gpu/1"
IMAGE = (3, 224, 224)
TARGET_D_OVER_E = 0.9
TARGET_OVERLAP = 1.05
PREFETCH_DEPTH = 2  # to_device depth in (d)
WARMUP_CAP = 4  # warm-up runs until the ring stops growing, at most this x its least length
DISTINCT = 8  # distinct batches in the data (308 MB at the defaults), read over and over


def _median_s(run: Callable[[], float], repeats: int) -> float:
    return statistics.median(run() for _ in range(repeats))


def _timed(body: Callable[[], None]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    body()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def warm_up(
    it: Iterator[Any], consume: Callable[[Any], None], grows: Callable[[], int],
    settle: int, cap: int, least: int = 0,
) -> int:
    """Consume batches until ``grows()`` (slots carved so far) has not changed for ``settle``
    batches in a row, at least ``max(settle, least)`` and at most ``cap`` of them; return how
    many."""
    done, last, steady = 0, grows(), 0
    while done < cap and (steady < settle or done < max(settle, least)):
        consume(next(it))
        done += 1
        now = grows()
        steady = steady + 1 if now == last else 0
        last = now
    return done


def _ring_grows(loader: Any) -> Callable[[], int]:
    """Slots a gpufeed loader's ring has carved so far; 0 for anything without a ring (the
    stock loader, ``to_device`` over views, whose stats have no counters)."""
    stats = getattr(loader, "stats", None)
    if stats is None or not hasattr(stats(), "counters"):
        return lambda: 0
    return lambda: int(stats().counters.get("ring_grow", 0))


def _loader_seconds(
    loader: Iterable[Any], n: int, warmup: int | tuple[int, int, int],
    consume: Callable[[Any], None], log: dict[str, int] | None = None,
) -> float:
    """Seconds for ``n`` batches of an iterable, after untimed warm-up batches.

    ``warmup``: a count, or ``(settle, cap, least)`` for :func:`warm_up`. ``log`` receives the
    warm-up batches and the slots carved inside the timed window. A prefetching iterable's
    copies ahead finish in the synchronize before the clock starts, and it copies
    ``PREFETCH_DEPTH`` batches beyond the last timed one: the source must hold
    ``cap + n + PREFETCH_DEPTH`` batches. The iterator is closed afterwards, so a gpufeed
    loader's page-locked ring and workers do not outlive their run.
    """
    grows = _ring_grows(loader)
    settle, cap, least = (warmup, warmup, 0) if isinstance(warmup, int) else warmup
    it = iter(loader)
    try:
        warmed = warm_up(it, consume, grows, settle, cap, least)
        before = grows()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            consume(next(it))
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        if log is not None:
            log["warmup_batches"] = warmed
            log["grew_in_window"] = grows() - before
        return seconds
    finally:
        close = getattr(it, "close", None)
        if callable(close):
            close()


def _bandwidth(
    data: torch.Tensor, bs: int, dev: torch.device, s: dict[str, Any]
) -> dict[str, Any]:
    n, reps, warm = s["batches"], s["repeats"], s["warmup_batches"]
    nbytes = bs * data[0].numel()
    views = [data[i * bs : (i + 1) * bs] for i in range(len(data) // bs)]
    gbps: dict[str, Any] = {}
    notes: list[str] = []

    def rate(seconds: float) -> float:
        return n * nbytes / seconds / 1e9

    src, dst = views[0].pin_memory(), torch.empty_like(views[0], device=dev)

    def raw() -> None:
        for _ in range(n):
            dst.copy_(src, non_blocking=True)

    def pageable() -> None:
        for i in range(n):  # each result is dropped at once: the allocator reuses its block
            views[i % len(views)].to(dev)

    def pin_per_batch() -> None:
        for i in range(n):
            views[i % len(views)].pin_memory().to(dev, non_blocking=True)

    for name, body in (("e_raw_pinned_copy", raw), ("a_pageable_to", pageable),
                       ("b_pin_memory_per_batch", pin_per_batch)):
        body()  # warm-up: allocator blocks, pinned cache
        gbps[name] = rate(_median_s(functools.partial(_timed, body), reps))

    gbps.update(loader_rates(data, bs, dev, s, notes, rate))

    gbps["d_to_device_pinned_region"] = None
    try:
        handle = _pinning.register(data)  # the whole region page-locked once, like the ring
    except RuntimeError as exc:
        notes.append(f"d_to_device_pinned_region not measured: {exc}")
    else:
        try:
            def ring() -> float:
                total = warm + n + PREFETCH_DEPTH
                it = to_device((views[i % len(views)] for i in range(total)), dev,
                               depth=PREFETCH_DEPTH)
                return _loader_seconds(it, n, warm, lambda b: None)

            gbps["d_to_device_pinned_region"] = rate(_median_s(ring, reps))
        finally:
            _pinning.unregister(handle)
    e = gbps["e_raw_pinned_copy"]
    ratios = {k: (v / e if v is not None else None) for k, v in gbps.items()}
    return {"gb_per_s": gbps, "over_raw": ratios, "batch_bytes": nbytes, "notes": notes}


def loader_rates(
    data: torch.Tensor, bs: int, dev: torch.device, s: dict[str, Any], notes: list[str],
    rate: Callable[[float], float],
) -> dict[str, float | None]:
    """Rows (c) and (d), warmed up as the module docstring says. Runs on CPU too (``dev``
    "cpu", ``torch.cuda.synchronize`` replaced): the tests do."""
    from torch.utils.data import DataLoader

    from .._loader import DataLoader as FeedLoader
    from .._sources.arrays import ArrayDataset

    n, reps, warm, workers = s["batches"], s["repeats"], s["warmup_batches"], s["num_workers"]
    least = (len(data) // bs) * max(1, workers)  # each worker can have read every batch
    cap = WARMUP_CAP * max(warm, least)
    cycle = [i % len(data) for i in range((cap + n + PREFETCH_DEPTH + 1) * bs)]
    dataset = ArrayDataset(data)  # the same dataset (one gather per batch) for c and d
    warmed: list[int] = []
    out: dict[str, float | None] = {"c_stock_dataloader_pin_memory": None,
                                    "d_gpufeed_dataloader": None}

    def stock() -> float:
        loader = DataLoader(dataset, batch_size=bs, sampler=cycle, num_workers=workers,
                            pin_memory=True, persistent_workers=False)
        count = max(warmed, default=max(warm, least))  # as many as gpufeed's ring needed
        return _loader_seconds(loader, n, count, lambda b: b[0].to(dev, non_blocking=True))

    try:
        def ours() -> float:
            loader = FeedLoader(dataset, batch_size=bs, sampler=cycle,
                                        num_workers=workers, pin_memory=True, device=dev,
                                        device_depth=PREFETCH_DEPTH)
            log: dict[str, int] = {}
            seconds = _loader_seconds(loader, n, (warm, cap, least), lambda b: None, log)
            warmed.append(log["warmup_batches"])
            if log["grew_in_window"]:
                notes.append(f"d: the ring still grew by {log['grew_in_window']} slot(s) in "
                             f"the timed window after {log['warmup_batches']} warm-up batches")
            return seconds

        out["d_gpufeed_dataloader"] = rate(_median_s(ours, reps))
    except Exception as exc:  # the core may be missing or fail: still report the rest
        notes.append(f"d (gpufeed.DataLoader) not measured: {type(exc).__name__}: {exc}")
        logger.warning("gpufeed.DataLoader run failed: %s", exc)
    out["c_stock_dataloader_pin_memory"] = rate(_median_s(stock, reps))
    return out


def _sleep_cycles_per_ms() -> float:
    torch.cuda._sleep(1_000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    return 20_000_000 / start.elapsed_time(end)


def _overlap(dev: torch.device, raw_gbps: float, s: dict[str, Any]) -> dict[str, Any]:
    """A step of T ms on the GPU, a copy of about T ms: naive loop vs to_device."""
    steps, k = s["overlap_steps"], 3
    numel = max(1 << 20, int(raw_gbps * 1e9 * s["step_ms"] / 1e3))
    bufs = [torch.full((numel,), i, dtype=torch.uint8).pin_memory() for i in range(k)]
    dst = torch.empty(numel, dtype=torch.uint8, device=dev)

    def copies() -> None:
        for i in range(steps):
            dst.copy_(bufs[i % k], non_blocking=True)

    def sleeps() -> None:
        for _ in range(steps):
            torch.cuda._sleep(cycles)

    def naive() -> None:  # copy then step, one stream: T + T per step
        for i in range(steps):
            x = bufs[i % k].to(dev, non_blocking=True)
            torch.cuda._sleep(cycles)
            del x

    def prefetch() -> None:  # timed from the first batch: start-up included
        for _ in to_device((bufs[i % k] for i in range(steps)), dev, depth=2):
            torch.cuda._sleep(cycles)

    copies()
    copy_ms = _median_s(lambda: _timed(copies), 3) / steps * 1e3
    cycles = int(_sleep_cycles_per_ms() * copy_ms)  # T := the measured copy time
    step_ms = _median_s(lambda: _timed(sleeps), 3) / steps * 1e3
    naive()
    naive_ms = _median_s(lambda: _timed(naive), 3) / steps * 1e3
    prefetch_ms = _median_s(lambda: _timed(prefetch), 3) / steps * 1e3
    return {"batch_bytes": numel, "transfer_ms": copy_ms, "step_ms": step_ms,
            "naive_ms_per_step": naive_ms, "to_device_ms_per_step": prefetch_ms,
            "naive_over_T": naive_ms / step_ms, "to_device_over_T": prefetch_ms / step_ms}


def run_gpu_benchmark(
    *,
    batch_size: int = 256,
    batches: int = 48,
    warmup_batches: int = 4,
    repeats: int = 3,
    num_workers: int = 4,
    step_ms: float = 4.0,
    overlap_steps: int = 200,
) -> dict[str, Any]:
    """Run the GPU benchmark; return the results (a JSON-ready dict).

    Args:
        batch_size: uint8 3x224x224 images per batch (256: 38.5 MB per batch).
        batches: timed batches per run; host memory used is ``DISTINCT`` (8) batches, plus
            the loaders' rings and pinned copies.
        warmup_batches: the gpufeed loader warms up until its ring has not grown for this
            many batches (see the module docstring); ``to_device`` over the registered region
            warms up this many batches.
        repeats: runs per figure; medians are reported. More is steadier, slower.
        num_workers: workers of the loaders (c) and (d); too few and the gather, not the
            copy, is measured.
        step_ms: the synthetic step's duration T is the copy time of ~step_ms of data.
        overlap_steps: steps per overlap run.
    """
    settings = {"batch_size": batch_size, "batches": batches, "warmup_batches": warmup_batches,
                "repeats": repeats, "num_workers": num_workers, "step_ms": step_ms,
                "overlap_steps": overlap_steps, "image": list(IMAGE)}
    env = environment()
    if not _pinning.cuda_usable():
        logger.info(SKIPPED)
        return {"schema": SCHEMA, "skipped": SKIPPED, "environment": env, "settings": settings}
    dev = torch.device("cuda", torch.cuda.current_device())
    env.update(gpu=torch.cuda.get_device_name(dev), cuda=torch.version.cuda,
               gpu_capability=list(torch.cuda.get_device_capability(dev)),
               gpu_count=torch.cuda.device_count())
    data = torch.empty((DISTINCT * batch_size, *IMAGE), dtype=torch.uint8)
    data.view(-1)[:: 4096].fill_(1)  # touch every page before timing
    bw = _bandwidth(data, batch_size, dev, settings)
    del data
    overlap = _overlap(dev, bw["gb_per_s"]["e_raw_pinned_copy"], settings)
    d_ring, d = bw["over_raw"]["d_to_device_pinned_region"], bw["over_raw"]["d_gpufeed_dataloader"]

    def meets(ratio: float | None) -> bool | None:
        return None if ratio is None else ratio >= TARGET_D_OVER_E

    return {
        "schema": SCHEMA, "environment": env, "settings": settings, "bandwidth": bw,
        "overlap": overlap,
        "targets": {
            "d_to_device_over_raw>=0.9": meets(d_ring),
            "d_gpufeed_dataloader_over_raw>=0.9": meets(d),
            "to_device_over_T<=1.05": overlap["to_device_over_T"] <= TARGET_OVERLAP,
        },
    }


def render_markdown(doc: dict[str, Any]) -> str:
    """The results as a short Markdown report."""
    env, bw, ov = doc["environment"], doc["bandwidth"], doc["overlap"]
    lines = ["# gpufeed GPU benchmark", "",
             f"{env['date']}: {env['gpu']} (CUDA {env['cuda']}), torch {env['torch']}, "
             f"{env['cpu_model']}. Batches of {doc['settings']['batch_size']} uint8 3x224x224 "
             f"images ({bw['batch_bytes'] / 1e6:.1f} MB), median of {doc['settings']['repeats']}.",
             "", "| path | GB/s | vs raw pinned copy |", "| --- | ---: | ---: |"]
    for name, v in bw["gb_per_s"].items():
        ratio = bw["over_raw"][name]
        lines.append(f"| {name} | {'-' if v is None else f'{v:.1f}'} | "
                     f"{'-' if ratio is None else f'{ratio:.2f}x'} |")
    lines += ["", f"Overlap: step T = {ov['step_ms']:.2f} ms, copy {ov['transfer_ms']:.2f} ms; "
              f"naive loop {ov['naive_ms_per_step']:.2f} ms/step ({ov['naive_over_T']:.2f} T), "
              f"to_device {ov['to_device_ms_per_step']:.2f} ms/step "
              f"({ov['to_device_over_T']:.2f} T).", "", "Targets: " + ", ".join(
                  f"{k}: {'-' if v is None else ('pass' if v else 'MISS')}"
                  for k, v in doc["targets"].items())]
    lines += [f"- {n}" for n in bw["notes"]]
    return "\n".join(lines) + "\n"
