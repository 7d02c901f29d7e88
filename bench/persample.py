"""The per-sample path, measured and profiled: ``python -m bench.persample``.

The workload is image-array's ``per-sample`` variant: ``__getitem__`` crops (6/7 of the side)
and maybe flips one uint8 CHW image of a memory map with numpy, and returns
``(tensor, int)``; batch 64, 2 workers, the default collate function.

``compare``: the stock DataLoader and gpufeed's, side by side, repeated and interleaved
(NOTE [ Repeated measurement ] in ``_tools/repeat.py``); the ratio with its range. Wall-clock
figures:
run it on a quiet machine.

``profile``: where the time goes, in figures that hold on a loaded machine (CPU time of this
process and of the workers, context switches, cProfile's relative costs), not wall-clock ratios:

- **worker side, in this process**: one worker's work per batch (fetch the 64 samples, collate
  into a slot, pack the leaves) with gpufeed's own functions, against the stock worker's
  (fetch, ``default_collate``; in this process it stacks into ordinary memory where a stock
  worker allocates shared memory, so the stock figure is a little low), under cProfile: CPU us
  per batch and the top functions by own time;
- **whole loader**: CPU seconds per batch of the main process and of the workers, and
  voluntary context switches (wake-ups) per batch of each, for both loaders; then the main
  process's top functions under cProfile for gpufeed.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import psutil
import torch
from torch.utils.data import default_collate

from gpufeed._tools.output import json_output
from gpufeed._tools.probe import descendants

from .workloads import FULL_SIZES, build

__all__ = ["compare", "main", "profile_loaders", "profile_worker"]

BATCH = 64
WORKERS = 2


def _dataset(quick: bool, count: int | None) -> Any:
    if count is None:
        work = build("image-array", quick=quick)
    else:  # the full workload's images, fewer of them (a smaller file to write and cache)
        from .workloads import default_cache_dir, image_array

        work = image_array(default_cache_dir(), count=count,
                           side=FULL_SIZES["image-array"]["side"])
    return next(v.dataset for v in work.variants if v.name == "per-sample"), work.description


def _top(prof: cProfile.Profile, n: int) -> list[dict[str, Any]]:
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (file, line, name), (_cc, calls, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{Path(file).name}:{line}:{name}", "calls": calls,
                     "own_s": tt, "cum_s": ct})
    rows.sort(key=lambda r: -r["own_s"])
    total = sum(r["own_s"] for r in rows) or 1.0
    for r in rows:
        r["own_share"] = r["own_s"] / total
    return rows[:n]


def profile_worker(dataset: Any, batches: int = 40, top: int = 12) -> dict[str, Any]:
    """One worker's work per batch, gpufeed's and the stock one's, in this process."""
    from gpufeed._host.collate import pack
    from gpufeed._host.fetch import MapFetcher
    from gpufeed._host.writer import SlotWriter

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the loaders' workers (one_intra_op_thread)
    try:
        return _profile_worker(dataset, batches, top, MapFetcher, SlotWriter, pack)
    finally:
        torch.set_num_threads(threads)


def _profile_worker(dataset: Any, batches: int, top: int, fetcher_cls: Any, writer_cls: Any,
                    pack: Callable[..., Any]) -> dict[str, Any]:
    fetcher = fetcher_cls(dataset, auto_collation=True, collate_fn=None)
    sample = dataset[0][0]
    slot = 2 * BATCH * sample.numel() * sample.element_size() + (1 << 16)
    region = torch.empty(slot, dtype=torch.uint8)
    writer = writer_cls(region, shared_fallback=False)
    n = len(dataset)

    def gpufeed_batch(b: int) -> None:
        writer.begin(0, slot)
        data = fetcher.fetch([(b * BATCH + k) % n for k in range(BATCH)], writer)
        pack(data, writer)

    def stock_batch(b: int) -> None:  # torch's worker minus the shared-memory allocation
        default_collate([dataset[(b * BATCH + k) % n] for k in range(BATCH)])

    out: dict[str, Any] = {}
    for name, fn in (("gpufeed", gpufeed_batch), ("stock", stock_batch)):
        for b in range(3):
            fn(b)  # warm: page cache, allocator
        prof = cProfile.Profile()
        t0 = time.process_time()
        prof.enable()
        for b in range(batches):
            fn(b)
        prof.disable()
        cpu = time.process_time() - t0
        out[name] = {"cpu_us_per_batch_profiled": cpu / batches * 1e6, "top": _top(prof, top)}
        t0 = time.process_time()
        for b in range(batches):
            fn(b)
        out[name]["cpu_us_per_batch"] = (time.process_time() - t0) / batches * 1e6
    return out


def _counters(proc: psutil.Process) -> tuple[float, int]:
    t = proc.cpu_times()
    return t.user + t.system, proc.num_ctx_switches().voluntary


def _loader_totals(make: Callable[[list[int]], Any], batches: int, n: int,
                   prof: cProfile.Profile | None = None) -> tuple[float, int, float, int, int]:
    """CPU seconds and voluntary context switches of the main process and of the workers
    from ``iter()`` to the last of exactly ``batches`` batches (the workers are alive and
    have done all their work then: the sampler holds exactly those batches)."""
    me = psutil.Process()
    loader = make([i % n for i in range(batches * BATCH)])
    main0 = _counters(me)
    it = iter(loader)
    kids = descendants(me)
    kids0 = {k.pid: _counters(k) for k in kids}
    if prof is not None:
        prof.enable()
    for _ in range(batches):
        next(it)
    if prof is not None:
        prof.disable()
    main1 = _counters(me)
    kids1 = {}
    for k in kids:
        try:
            kids1[k.pid] = _counters(k)
        except psutil.Error:
            continue
    del it, loader
    return (main1[0] - main0[0], main1[1] - main0[1],
            sum(kids1[p][0] - kids0[p][0] for p in kids1),
            sum(kids1[p][1] - kids0[p][1] for p in kids1), len(kids1))


def _loader_run(make: Callable[[list[int]], Any], batches: int, n: int) -> dict[str, Any]:
    """Per-batch costs as the difference of a long and a short pass (start-up cancels out).

    CPU times come in clock ticks (10 ms on Linux) and the two passes start differently, so
    a difference over few batches can come out below zero: it is read as 0 (no cost can be
    negative), and only runs of many batches (the default 60) give figures worth reading.
    """
    short = _loader_totals(make, 8, n)
    long = _loader_totals(make, 8 + batches, n)
    d = [max(b - a, 0) for a, b in zip(short, long, strict=True)]
    return {"main_cpu_ms_per_batch": d[0] / batches * 1e3,
            "main_wakeups_per_batch": d[1] / batches,
            "worker_cpu_ms_per_batch": d[2] / batches * 1e3,
            "worker_wakeups_per_batch": d[3] / batches,
            "worker_processes": long[4]}


def _with_sampler(make: Callable[..., Any], order: list[int]) -> Any:
    return make(sampler=order)


def profile_loaders(dataset: Any, batches: int = 60, top: int = 12) -> dict[str, Any]:
    """CPU time and wake-ups per batch of the main process and the workers, both loaders."""
    import gpufeed
    from gpufeed._tools.measure import one_intra_op_thread

    common: dict[str, Any] = {"batch_size": BATCH, "num_workers": WORKERS,
                              "worker_init_fn": one_intra_op_thread}
    n = len(dataset)
    makers: dict[str, Callable[..., Any]] = {
        "stock": partial(torch.utils.data.DataLoader, dataset, **common),
        "gpufeed": partial(gpufeed.DataLoader, dataset, **common)}
    out: dict[str, Any] = {name: _loader_run(partial(_with_sampler, m), batches, n)
                           for name, m in makers.items()}
    prof = cProfile.Profile()
    _loader_totals(partial(_with_sampler, makers["gpufeed"]), batches, n, prof)
    out["gpufeed_main_top"] = _top(prof, top)
    return out


def compare(dataset: Any, *, seconds: float, runs: int) -> dict[str, Any]:
    """Stock vs gpufeed on the per-sample path, repeated and interleaved."""
    from gpufeed._tools import bench as _bench

    rows = _bench.configs({"per-sample": (dataset, None)}, [WORKERS], BATCH)
    load = _bench.run_bench(rows, seconds=seconds, runs=runs, target_spread=0.05)
    comparisons = _bench.compare(rows)
    print(_bench.render("per-sample image-array, batch 64", rows, comparisons, load, seconds))
    return {"rows": [r.to_dict() for r in rows],
            "comparisons": [c.to_dict() for c in comparisons], "machine": load.to_dict()}


def _print_top(title: str, rows: Sequence[dict[str, Any]]) -> None:
    print(title)
    for r in rows:
        print(f"  {r['own_share']:6.1%}  {r['calls']:>8}  {r['function']}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.persample",
                                description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("what", choices=("compare", "profile", "both"), nargs="?", default="both")
    p.add_argument("--quick", action="store_true", help="512 images of 64x64 (smoke test)")
    p.add_argument("--count", type=int,
                   help="images of the full size (224x224) to use (default: the full 20,000)")
    p.add_argument("--seconds", type=float, default=2.0, help="timed seconds per run (2)")
    p.add_argument("--runs", type=int, default=5, help="runs per loader (5)")
    p.add_argument("--batches", type=int, default=60, help="batches profiled (60)")
    p.add_argument("--json", metavar="FILE",
                   help="write the figures as JSON to FILE (- for stdout, the rest to stderr)")
    args = p.parse_args(argv)
    with json_output(args.json) as emit:
        emit(_run(args))
    return 0


def _run(args: argparse.Namespace) -> dict[str, Any]:
    dataset, description = _dataset(args.quick, args.count)
    doc: dict[str, Any] = {"workload": description, "batch_size": BATCH, "workers": WORKERS}
    if args.what in ("compare", "both"):
        doc["compare"] = compare(dataset, seconds=args.seconds, runs=args.runs)
    if args.what in ("profile", "both"):
        w = profile_worker(dataset, batches=args.batches)
        loaders = profile_loaders(dataset, batches=args.batches)
        doc["worker"], doc["loaders"] = w, loaders
        for name in ("gpufeed", "stock"):
            print(f"worker side, {name}: {w[name]['cpu_us_per_batch']:,.0f} us CPU per batch")
            _print_top(f"  top functions by own time ({name} worker, share, calls):",
                       w[name]["top"])
        for name in ("stock", "gpufeed"):
            r = loaders[name]
            print(f"{name}: main {r['main_cpu_ms_per_batch']:.2f} ms CPU and "
                  f"{r['main_wakeups_per_batch']:.1f} wake-ups per batch; workers "
                  f"{r['worker_cpu_ms_per_batch']:.2f} ms CPU and "
                  f"{r['worker_wakeups_per_batch']:.1f} wake-ups per batch")
        _print_top("gpufeed main process, top functions by own time:",
                   loaders["gpufeed_main_top"])
    return doc


if __name__ == "__main__":
    raise SystemExit(main())
