"""CPU benchmark: gpufeed against the stock DataLoader (and torchdata.nodes), side by side.

For every workload, every repeat runs each (loader, fetch variant) pair once, rotating the order
of the loaders from one repeat to the next so that neither side always runs first on a warm or a
busy machine. All loaders get identical settings: same dataset object, batch size, shuffled order
(a seeded generator), ``num_workers``, ``prefetch_factor``, ``collate_fn`` and a worker start-up
hook that sets one intra-op torch thread per worker (a pool worker left at the default collapses
decode throughput on small machines). The main process also runs with one torch thread, so a
thread-worker run cannot change the conditions of the runs after it. Figures are medians over
the repeats; the ratio of a workload compares gpufeed's best (loader, variant) with the stock
loader's best variant.

Each repeat also measures, for every variant and in the same rotation as the loaders, the
**no-loader ceiling**: ``num_workers`` plain forked processes with one torch thread each, fetching
and collating their share of the same epoch's batches and dropping them (NOTE [ No-loader
ceiling ] in ``bench/ceiling.py``), each batch fetched the fastest way gpufeed's workers know
for the variant (``_ceiling_fetch``). It is what the machine does with that many workers and no
loader at all; each loader's best is also reported as a share of it. The targets stay ratios to
the stock loader.

NOTE [ Equal work for memory ]
------------------------------
Peak PSS is compared only between runs that did the same work. By default every run delivers
one whole epoch, the same batches in the same (seeded) order for every loader. A time cap
(``max_seconds``) would let a faster loader read more samples, and memory that grows with the
samples read then counts against it: image-array's images are a 2.9 GB ``numpy.memmap`` whose
pages count in PSS once touched, so in 2 s a loader 4x faster maps several hundred MiB more of
the same file. With a time cap the summary reports no PSS verdict. Each run also gets its own
shallow copy of the dataset: datasets open per-process state lazily (image-array's memory map)
and a thread-worker run opens it in the main process, where a shared dataset object would keep
it, and the pages it touched, for every later run of every loader.
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, default_collate

from gpufeed._tools.environment import environment
from gpufeed._tools.measure import Measurement, measure_loader, one_intra_op_thread
from gpufeed._tools.probe import descendants

from .ceiling import measure_no_loader
from .summary import PSS_TOLERANCE, TARGETS, summarize
from .workloads import WORKLOADS, Variant, Workload, WorkloadUnavailable, build

__all__ = ["CEILING", "EXTRA_LOADERS", "LOADERS", "PSS_TOLERANCE", "TARGETS", "Settings",
           "directory", "environment", "main_cpu_s_per_batch", "pss_growth_bytes", "run_cpu",
           "summarize"]

LOADERS = ("torch", "gpufeed", "gpufeed-thread", "torchdata.nodes")
#: By name only: gpufeed's process workers at the main process's priority (``worker_nice=0``)
EXTRA_LOADERS = ("gpufeed-nice0",)
#: Name of the no-loader ceiling in the results and progress lines.
CEILING = "no-loader ceiling"
SCHEMA = "gpufeed-bench-cpu/1"
STAND_IN = "stand-in: torch.utils.data.DataLoader (gpufeed.DataLoader is not importable)"


@dataclass(frozen=True)
class Settings:
    """Knobs of a benchmark run (recorded in the results).

    Attributes:
        num_workers: workers of every loader (the issue's comparison is at 2).
        repeats: runs of each (loader, variant); medians are reported. More is steadier, slower.
        prefetch_factor: batches in flight per worker, for every loader. None (default):
            each loader's default, as a user who leaves it unset gets (stock and
            torchdata.nodes: 2 per worker; gpufeed: 2 per worker, more when batches are cheap,
            see ``gpufeed.DataLoader``).
        warmup_batches: batches excluded from each rate (worker start-up, first faults).
        max_seconds: timed seconds per run after warm-up. None (default): every run delivers
            one whole epoch, the same work for every loader, which the peak PSS comparison
            needs (NOTE [ Equal work for memory ]); a cap gives quicker rates but no PSS
            verdict. Whole-epoch workloads such as python-list always run to the end.
        max_batches: cap on batches per run, warm-up included (None: no cap).
        seed: data, shuffle order and per-sample randomness.
        quick: tiny workloads, for tests.
        ceiling: also measure the no-loader ceiling of every variant (one more run per variant
            per repeat, about as long as a loader's run).
    """

    num_workers: int = 2
    repeats: int = 3
    prefetch_factor: int | None = None
    warmup_batches: int = 3
    max_seconds: float | None = None
    max_batches: int | None = None
    seed: int = 0
    quick: bool = False
    ceiling: bool = True

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError(f"num_workers={self.num_workers}: the comparison needs workers (>= 1)")
        if self.repeats < 1:
            raise ValueError(f"repeats={self.repeats} must be at least 1")


class _FetchBatch:
    """torchdata.nodes map function: indices -> collated batch, as the stock fetcher does it."""

    def __init__(self, dataset: Any, collate_fn: Callable[[Any], Any] | None) -> None:
        self.dataset, self.collate_fn = dataset, collate_fn or default_collate

    def __call__(self, indices: list[int]) -> Any:
        one_intra_op_thread()
        getitems = getattr(self.dataset, "__getitems__", None)
        samples = getitems(indices) if getitems else [self.dataset[i] for i in indices]
        return self.collate_fn(samples)


def _gpufeed_loader() -> Callable[..., Iterable[Any]] | None:
    try:
        loader = getattr(importlib.import_module("gpufeed"), "DataLoader", None)
    except ImportError:
        return None
    return loader if isinstance(loader, type) and issubclass(loader, DataLoader) else None


def available_loaders() -> dict[str, str]:
    """Each loader name -> ``"ok"`` or why it cannot run here."""
    real = _gpufeed_loader() is not None
    gpufeed = "ok" if real else STAND_IN
    only_real = "ok" if real else "gpufeed.DataLoader is not importable (core missing)"
    try:
        importlib.import_module("torchdata.nodes")
        nodes = "ok"
    except ImportError:
        nodes = "torchdata is not installed (pip install --no-deps torchdata)"
    return {"torch": "ok", "gpufeed": gpufeed, "gpufeed-thread": only_real,
            "torchdata.nodes": nodes, "gpufeed-nice0": only_real}


def _factory(loader: str, variant: Variant, work: Workload,
             s: Settings) -> Callable[[], Iterable[Any]]:
    ds, collate = variant.dataset, variant.collate_fn

    def sampler_gen() -> torch.Generator:
        return torch.Generator().manual_seed(s.seed)

    common: dict[str, Any] = {
        "batch_size": work.batch_size, "shuffle": True, "num_workers": s.num_workers,
        "collate_fn": collate, "worker_init_fn": one_intra_op_thread}
    if s.prefetch_factor is not None:
        common["prefetch_factor"] = s.prefetch_factor
    if loader == "torch":
        return lambda: DataLoader(ds, generator=sampler_gen(), **common)
    if loader == "gpufeed-nice0":
        common["worker_nice"], loader = 0, "gpufeed"
    if loader in ("gpufeed", "gpufeed-thread"):
        cls = _gpufeed_loader()
        if cls is None and loader == "gpufeed":  # stand-in until the core imports
            return lambda: DataLoader(ds, generator=sampler_gen(), **common)
        if cls is None:
            raise RuntimeError("gpufeed.DataLoader is not importable")
        kind = "thread" if loader == "gpufeed-thread" else "process"
        return lambda: cls(ds, generator=sampler_gen(), worker_type=kind, **common)
    if loader == "torchdata.nodes":
        nodes = importlib.import_module("torchdata.nodes")

        def make() -> Iterable[Any]:
            batches = BatchSampler(RandomSampler(ds, generator=sampler_gen()), work.batch_size,
                                   drop_last=False)
            node = nodes.ParallelMapper(nodes.SamplerWrapper(batches), _FetchBatch(ds, collate),
                                        num_workers=s.num_workers, method="process")
            node = nodes.Prefetcher(node, prefetch_factor=(s.prefetch_factor or 2) * s.num_workers)
            return nodes.Loader(node)

        return make
    raise ValueError(f"unknown loader {loader!r}; choose from {', '.join(LOADERS)}")


class _PeerTeardownErrors:
    """Counts (instead of printing) the OSErrors that torchdata.nodes' ordering thread raises
    when a run stops early: it may still be unpickling a batch whose sending worker has exited.
    Anything else goes to the previous hook."""

    def __init__(self) -> None:
        self.count = 0
        self._previous = threading.excepthook

    def __call__(self, args: Any) -> None:
        name = args.thread.name if args.thread is not None else ""
        if "_sort_worker" in name and isinstance(args.exc_value, OSError):
            self.count += 1
        else:
            self._previous(args)

    def __enter__(self) -> _PeerTeardownErrors:
        threading.excepthook = self
        return self

    def __exit__(self, *exc: object) -> None:
        threading.excepthook = self._previous


class _Gather:
    """Ceiling fetch of an array dataset: one vectorised gather per array into new tensors."""

    def __init__(self, gather: Callable[..., Any], arrays: Sequence[Any]) -> None:
        self.gather, self.arrays = gather, arrays

    def __call__(self, indices: list[int]) -> Any:
        return self.gather(self.arrays, indices, lambda shape, dtype: torch.empty(shape,
                                                                                  dtype=dtype))


def _ceiling_fetch(variant: Variant) -> tuple[str, Callable[[list[int]], Any]]:
    """(name, fetch) of the variant's fastest batch fetch: the vectorised gather where
    gpufeed's workers use one (``gpufeed.sources.ArrayDataset`` or a ``TensorDataset`` with the
    default collate), else ``__getitems__`` or ``__getitem__`` per index and the collate
    function, as the stock fetcher does. The stock path of an ArrayDataset (rows, then a stack)
    would put the ceiling below gpufeed's own rate."""
    if variant.collate_fn is None:
        try:
            datasets: Any = importlib.import_module("gpufeed._sources.arrays")
        except ImportError:  # gpufeed's core not importable: the stand-in has no gather
            datasets = None
        arrays = None if datasets is None else datasets.gather_arrays(variant.dataset)
        if arrays is not None:
            return "gather", _Gather(datasets.gather, arrays)
    name = "__getitems__" if getattr(variant.dataset, "__getitems__", None) else "__getitem__"
    return name, _FetchBatch(variant.dataset, variant.collate_fn)


def _ceiling(variant: Variant, work: Workload, s: Settings) -> dict[str, Any]:
    """One no-loader pass over the variant: the epoch's shuffled batches (as the loaders get
    them, capped as their runs are), ``num_workers`` forked processes, one torch thread each."""
    order = RandomSampler(variant.dataset, generator=torch.Generator().manual_seed(s.seed))
    batches = list(BatchSampler(order, work.batch_size, drop_last=False))
    capped = not work.full_epoch
    if capped and s.max_batches is not None:
        batches = batches[:s.max_batches]
    how, fetch = _ceiling_fetch(variant)
    m = measure_no_loader(fetch, batches, processes=s.num_workers, init=one_intra_op_thread,
                          max_seconds=s.max_seconds if capped else None, sample_memory=True)
    return {**asdict(m), "fetch": how}


def _wait_for_children(timeout_s: float = 10.0) -> int:
    """Wait until the loaders' worker processes are gone; return how many are left."""
    deadline = time.monotonic() + timeout_s
    while (left := descendants()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(left)


_MEDIAN_KEYS = ("samples_per_s", "bytes_per_s", "peak_pss_bytes", "pss_growth_bytes",
                "first_batch_s", "samples", "peak_pss_anon_bytes", "peak_pss_file_bytes",
                "peak_pss_shmem_bytes", "peak_held_bytes", "main_thread_cpu_s_per_batch",
                "main_process_cpu_s_per_batch")
_CEILING_MEDIAN_KEYS = ("samples_per_s", "bytes_per_s", "samples", "seconds")


def pss_growth_bytes(m: Measurement) -> int:
    """Peak PSS minus the PSS before ``iter()``: the memory the iteration itself cost."""
    return max(0, m.peak_pss_bytes - m.start_pss_bytes)


def main_cpu_s_per_batch(m: Measurement) -> tuple[float, float]:
    """``(main_thread_cpu_s, main_process_cpu_s)`` per counted batch."""
    n = max(m.batches, 1)
    return m.main_thread_cpu_s / n, m.main_process_cpu_s / n


def _median_row(runs: list[dict[str, Any]],
                keys: Sequence[str] = _MEDIAN_KEYS) -> dict[str, float]:
    return {k: float(statistics.median(r[k] for r in runs)) for k in keys}


def workload_variant(workload: str, variant: str, *, quick: bool = False
                     ) -> tuple[Workload, Variant]:
    """The workload ``workload`` built, and its variant named ``variant`` (a ValueError naming
    the variants there are otherwise): what the one-loader tools run."""
    work = build(workload, quick=quick)
    v = next((x for x in work.variants if x.name == variant), None)
    if v is None:
        names = ", ".join(x.name for x in work.variants)
        raise ValueError(f"workload {workload!r} has no variant {variant!r}; choose from {names}")
    return work, v


def directory(text: str) -> Path:
    """An ``argparse`` type for a folder of result files (``--out``): ``-`` (stdout, as for
    ``--json``) is refused, naming the fix, instead of making a folder named ``-``."""
    if text == "-":
        raise argparse.ArgumentTypeError(
            "'-' (stdout) cannot take a folder of result files; give a folder, e.g. "
            "bench/results")
    return Path(text)


def add_workload_options(p: argparse.ArgumentParser, *, workload: str, variant: str) -> None:
    """The options every one-loader tool takes (``--workload``, ``--variant``,
    ``--num-workers``, ``--quick``), for :func:`workload_variant`."""
    p.add_argument("--workload", default=workload, choices=sorted(WORKLOADS))
    p.add_argument("--variant", default=variant,
                   help=f"the workload's variant (default {variant})")
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="tiny data (for tests)")


def _fresh(variant: Variant) -> Variant:
    """The variant with a shallow copy of its dataset: the data is shared, per-process state
    that the dataset drops when pickled (an open memory map) starts anew (NOTE [ Equal work
    for memory ])."""
    return Variant(variant.name, copy.copy(variant.dataset), variant.collate_fn)


def _run_workload(work: Workload, loaders: Sequence[str], s: Settings,
                  say: Callable[[str], None]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every (loader, variant) pair ``s.repeats`` times, and the no-loader ceiling of every
    variant (``s.ceiling``), in rotating order. Returns (loader rows, ceiling rows)."""
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    ceiling: dict[str, list[dict[str, Any]]] = {}
    entries = [*loaders, CEILING] if s.ceiling else list(loaders)
    for rep in range(s.repeats * bool(entries)):
        order = [*entries[rep % len(entries):], *entries[:rep % len(entries)]]
        for variant in work.variants:
            for loader in order:
                gc.collect()  # nothing of the previous run may still hold memory
                left = _wait_for_children()
                if loader == CEILING:
                    c = {**_ceiling(_fresh(variant), work, s), "repeat": rep,
                         "children_left_before": left}
                    ceiling.setdefault(variant.name, []).append(c)
                    say(f"{work.name:12} {variant.name:10} {loader:17} rep {rep}: "
                        f"{c['samples_per_s']:12,.0f} samples/s  ({c['processes']} processes, "
                        f"{', '.join(f'{x:.2f}' for x in c['process_seconds'])} s each; "
                        f"{c['fetch']})")
                    continue
                m = measure_loader(
                    _factory(loader, _fresh(variant), work, s), warmup_batches=s.warmup_batches,
                    max_seconds=None if work.full_epoch else s.max_seconds,
                    max_batches=None if work.full_epoch else s.max_batches)
                thread_s, process_s = main_cpu_s_per_batch(m)
                row = {**asdict(m), "pss_growth_bytes": pss_growth_bytes(m), "repeat": rep,
                       "main_thread_cpu_s_per_batch": thread_s,
                       "main_process_cpu_s_per_batch": process_s,
                       "children_left_before": left}
                runs.setdefault((loader, variant.name), []).append(row)
                say(f"{work.name:12} {variant.name:10} {loader:17} rep {rep}: "
                    f"{m.samples_per_s:12,.0f} samples/s  peak PSS "
                    f"{m.peak_pss_bytes / 2**20:8,.0f} MiB (anon/file/shmem "
                    f"{m.peak_pss_anon_bytes / 2**20:,.0f}/{m.peak_pss_file_bytes / 2**20:,.0f}/"
                    f"{m.peak_pss_shmem_bytes / 2**20:,.0f})  first batch "
                    f"{m.first_batch_s * 1e3:6.0f} ms  main CPU "
                    f"{thread_s * 1e6:,.0f} us/batch")
    rows = [{"loader": lo, "variant": va, "median": _median_row(rs), "runs": rs}
            for (lo, va), rs in runs.items()]
    return rows, [{"loader": CEILING, "variant": va, "fetch": cs[0]["fetch"],
                   "median": _median_row(cs, _CEILING_MEDIAN_KEYS), "runs": cs}
                  for va, cs in ceiling.items()]


def run_cpu(workloads: Sequence[str], *, settings: Settings | None = None,
            loaders: Sequence[str] = LOADERS, cache_dir: Path | None = None,
            progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the CPU benchmark and return the results (the JSON document).

    Args:
        workloads: names from ``workloads.WORKLOADS``.
        settings: knobs (default ``Settings()``).
        loaders: subset of ``LOADERS``; ones that cannot run here are recorded as skipped.
        cache_dir: where workload files live (default: see ``default_cache_dir``).
        progress: called with one line per run (the CLI prints them).
    """
    s = settings or Settings()
    say = progress or (lambda line: None)
    unknown = [name for name in loaders if name not in (*LOADERS, *EXTRA_LOADERS)]
    if unknown:
        raise ValueError(f"unknown loaders {unknown}; choose from "
                         f"{', '.join((*LOADERS, *EXTRA_LOADERS))}")
    status = available_loaders()
    usable = [name for name in loaders if status[name] in ("ok", STAND_IN)]
    torch.set_num_threads(1)
    doc: dict[str, Any] = {"schema": SCHEMA, "kind": "cpu", "environment": environment(),
                           "settings": asdict(s), "loaders": {k: status[k] for k in loaders},
                           "targets": {"ratio": TARGETS, "pss_tolerance": PSS_TOLERANCE},
                           "page_cache": "every file is read once before timing",
                           "memory": ("peak PSS of the process tree; compared only on equal "
                                      "work (whole epochs); split anon/file/shmem at the peak"),
                           "main_cpu": ("CPU seconds of the main process per batch over "
                                        "the counted batches: main_thread_ (the iterating "
                                        "thread) and main_process_ (all its threads but the "
                                        "PSS sampler; with thread workers, them too)"),
                           "ceiling": (f"{CEILING}: num_workers forked processes, one torch "
                                       "thread each, fetch and collate their share of the "
                                       "epoch's batches (vectorised gather for array datasets, "
                                       "as gpufeed's workers) and drop them; samples over the "
                                       "time from one start signal to the last one done"
                                       if s.ceiling else None),
                           "workloads": []}
    for name in workloads:
        try:
            work = build(name, cache_dir=cache_dir, quick=s.quick, seed=s.seed)
        except WorkloadUnavailable as exc:
            say(f"{name}: skipped: {exc}")
            doc["workloads"].append({"name": name, "skipped": str(exc)})
            continue
        with _PeerTeardownErrors() as teardown:
            rows, ceiling = _run_workload(work, usable, s, say)
        doc["workloads"].append({
            "name": name, "description": work.description, "batch_size": work.batch_size,
            "samples": work.samples, "full_epoch": work.full_epoch, "meta": work.meta,
            "peer_teardown_errors": teardown.count, "results": rows, "ceiling": ceiling,
            "summary": summarize(name, rows, ceiling, doc["environment"]["cpu_affinity"])})
        del work
    doc["environment"]["loadavg_end"] = list(os.getloadavg())
    return doc
