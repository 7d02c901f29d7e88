"""``python -m bench [cpu|gpu] ...``: run a benchmark, write JSON and Markdown.

``cpu`` (the default) runs ``bench.cpu`` and writes ``cpu.json`` and ``cpu.md`` to
``--out`` (default ``bench/results`` under the current directory: run it from the
repository root to update the committed figures). ``gpu`` hands the remaining arguments to
``bench.gpu.main``, ``autotune`` to ``bench.autotune.main``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .cpu import CEILING, EXTRA_LOADERS, LOADERS, STAND_IN, Settings, directory, run_cpu
from .summary import write_documents
from .workloads import WORKLOADS

DEFAULT_WORKLOADS = ("tabular", "image-array", "jpeg", "python-list")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="gpufeed vs the stock DataLoader (and torchdata.nodes), side by side.")
    p.add_argument("kind", nargs="?", choices=("cpu", "gpu"), default="cpu",
                   help="which benchmark (default cpu); `gpu ARGS...` hands ARGS to the GPU "
                        "benchmark (bench.gpu), which needs CUDA")
    p.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS),
                   default=list(DEFAULT_WORKLOADS), metavar="NAME",
                   help=f"workloads to run, from {', '.join(WORKLOADS)} "
                        f"(default: {' '.join(DEFAULT_WORKLOADS)})")
    p.add_argument("--loaders", nargs="+", choices=(*LOADERS, *EXTRA_LOADERS),
                   default=list(LOADERS), metavar="NAME",
                   help=f"loaders to compare, from {', '.join(LOADERS)} (default: these), "
                        f"{', '.join(EXTRA_LOADERS)} (gpufeed with worker_nice=0)")
    p.add_argument("--repeats", type=int, default=None,
                   help="runs per (loader, variant); medians are reported (default 3, quick 1)")
    p.add_argument("--num-workers", type=int, default=2, help="workers of every loader")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="cap each run at this many timed seconds after warm-up (default: no "
                        "cap, every run delivers one whole epoch, the same work for every "
                        "loader; with a cap faster loaders read more data, so peak PSS gets "
                        "no verdict)")
    p.add_argument("--out", type=directory, default=Path("bench/results"),
                   help="folder for cpu.json and cpu.md (default bench/results)")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="where workload files are built once and reused "
                        "(default $GPUFEED_BENCH_CACHE or <tmp>/gpufeed-bench)")
    p.add_argument("--no-ceiling", dest="ceiling", action="store_false",
                   help="skip the no-loader ceiling (num_workers plain processes fetching the "
                        "same batches with no loader; one more run per variant per repeat)")
    p.add_argument("--quick", action="store_true",
                   help="tiny workloads and short runs (seconds; for tests, not for figures)")
    return p


def _fmt(value: float | None, spec: str = ",.0f") -> str:
    return "-" if value is None else format(value, spec)


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _verdict(ok: bool | None) -> str:
    return "" if ok is None else ("pass" if ok else "**miss**")


def _ceiling_cells(sm: dict[str, Any]) -> list[str]:
    """Summary cells: the ceiling of gpufeed's best variant, gpufeed's and stock's best as %
    of the ceiling of their own variants (the stock one names its ceiling when it differs)."""
    c = sm.get("ceiling")
    if not c:
        return ["-", "-", "-"]
    ours = _fmt(c["gpufeed_variant_ceiling"])
    if c["gpufeed_variant"]:
        ours += f" ({c['gpufeed_variant']})"
    pct = [_fmt(None if c[f"{side}_of_ceiling"] is None else 100 * c[f"{side}_of_ceiling"])
           for side in ("gpufeed", "stock")]
    pct = [x if x == "-" else x + "%" + _spread(c.get(f"{side}_of_ceiling_range"))
           for x, side in zip(pct, ("gpufeed", "stock"), strict=True)]
    if c["stock_variant"] not in (None, c["gpufeed_variant"]) and pct[1] != "-":
        pct[1] += f" of {_fmt(c['stock_variant_ceiling'])} ({c['stock_variant']})"
    return [ours, *pct]


def _spread(lo_hi: list[float] | None) -> str:
    """" (lowest-highest%)" of the rounds' shares, or nothing (results from before)."""
    return "" if not lo_hi else f" ({100 * lo_hi[0]:.0f}-{100 * lo_hi[1]:.0f}%)"


def _bound_lines(workloads: list[dict[str, Any]]) -> list[str]:
    """One line per workload with a main-process bound (NOTE [ Main-process bound ])."""
    lines = []
    for w in workloads:
        c = (w.get("summary") or {}).get("ceiling") or {}
        sides = [f"{side} {100 * c[f'{side}_main_bound']:.0f}% (main process "
                 f"{c[f'{side}_main_us']:,.0f} us per batch)"
                 for side in ("gpufeed", "stock") if c.get(f"{side}_main_bound") is not None]
        if sides:
            lines.append(f"- {w['name']}: {', '.join(sides)}")
    if not lines:
        return []
    return ["Main-process bound (NOTE [ Main-process bound ] in `bench/summary.py`): the "
            "most of its variant's ceiling a loader can reach, round by round, with what its "
            "main process spent per batch, on these cores; a share near its bound gains little "
            "but from a cheaper main process:", "", *lines, ""]


def _main_cpu(m: dict[str, Any]) -> str:
    """Main-process CPU microseconds per batch, thread / process (results from before the
    figure was recorded have none)."""
    if "main_thread_cpu_s_per_batch" not in m:
        return "-"
    return (f"{m['main_thread_cpu_s_per_batch'] * 1e6:,.0f} / "
            f"{m['main_process_cpu_s_per_batch'] * 1e6:,.0f}")


def _niced(row: dict[str, Any]) -> str:
    """The runs whose workers ended at a lower priority (NOTE [ Worker priority ])."""
    niced = [run.get("worker_nice", 0) for run in row.get("runs", [])]
    n = sum(1 for x in niced if x)
    return f"; workers at nice +{max(niced)} in {n} of {len(niced)} runs" if n else ""


def render_markdown(doc: dict[str, Any]) -> str:
    """The results document as a Markdown report: a summary table and every median."""
    env, s = doc["environment"], doc["settings"]
    commit = (env.get("git_commit") or "no git")[:10] + (" (dirty)" if env.get("git_dirty") else "")
    lines = [
        "# gpufeed CPU benchmark", "",
        f"{env['date']} on `{env['hostname']}`: {env['cpu_model']}, {env['cpu_affinity']} usable "
        f"cores, {env['memory_bytes'] / 2**30:.0f} GiB; Python {env['python']}, torch "
        f"{env['torch']}, numpy {env['numpy']}, torchdata {env['torchdata']}, gpufeed "
        f"{env['gpufeed']} ({commit}); load average {env['loadavg_start'][0]:.2f} at start, "
        f"{env.get('loadavg_end', [float('nan')])[0]:.2f} at end.", "",
        f"num_workers={s['num_workers']} for every loader, "
        + (f"prefetch_factor={s['prefetch_factor']}," if s.get("prefetch_factor") else
           "prefetch_factor unset (each loader's default: 2 per worker; gpufeed works further "
           "ahead for cheap batches),") +
        f" shuffled (seed {s['seed']}), median of {s['repeats']} runs, loaders alternating; "
        f"{s['warmup_batches']} warm-up batch(es) excluded from each rate; "
        + (f"about {s['max_seconds']:g} s timed per run (python-list: a whole epoch). "
           if s["max_seconds"] else "whole epochs timed. ") +
        "Files are read once before timing (page cache warm). One torch thread per worker "
        "and in the main process. "
        "Peak PSS: the whole process tree, sampled in a thread every 20 ms (less often "
        "when sampling is slow, to stay under 10% of a core) and once more, untimed, at the "
        "last batch of each run while the workers still run." + (" **Quick mode: tiny data, "
        "figures mean nothing.**" if s["quick"] else ""), "",
        "Memory is compared on equal work: "
        + ("every run delivers one whole epoch, the same batches in the same order for every "
           "loader, and each run gets a fresh copy of the dataset. "
           if not s["max_seconds"] else
           "**runs were capped in time, so faster loaders read more data: peak PSS gets no "
           "verdict.** ") +
        "The figures committed up to 889f320 capped every run at 2 s and shared one "
        "dataset object between runs; on image-array that counted more of the 2.9 GB "
        "memory-mapped file against the faster loader, and left the file mapped in the main "
        "process after a thread-worker run. The peak is split by kind: anon (heaps, "
        "decoded samples, thread workers' batches), file (mapped files: libraries, whose "
        "PSS also varies with other processes on the machine, and memory-mapped data such as "
        "image-array's file) "
        "and shmem (shared memory a process maps: the stock loader's per-batch segments, "
        "gpufeed's process ring).", "",
    ]
    if doc["loaders"].get("gpufeed") == STAND_IN:
        lines += ["**gpufeed's core was not importable: the `gpufeed` rows ran the stock loader "
                  "as a stand-in.**", ""]
    lines += ["| workload | stock best | gpufeed best | ratio | target | | peak PSS vs stock | | "
              "peak held vs stock | no-loader ceiling | gpufeed % of ceiling | stock % of "
              "ceiling |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | "
              "--- |"]
    notes: list[str] = []
    also: list[str] = []
    for w in doc["workloads"]:
        if "skipped" in w:
            lines.append(f"| {w['name']} | skipped: {w['skipped']} | | | | | | | | | | |")
            continue
        sm = w["summary"]
        st, ours = sm["stock_best"], sm["gpufeed_best"]
        stock_txt = f"{_fmt(st['samples_per_s'])} ({st['variant']})" if st else "-"
        ours_txt = f"{_fmt(ours['samples_per_s'])} ({ours['loader']}, {ours['variant']})" \
            if ours else "-"
        target = f">= {sm['target_ratio']:g}x" if sm["target_ratio"] else "-"
        lines.append(f"| {w['name']} | {stock_txt} | {ours_txt} | {_fmt(sm['ratio'], '.2f')}x | "
                     f"{target} | {_verdict(sm['ratio_pass'])} | {_fmt(sm['pss_ratio'], '.2f')}x"
                     f" | {_verdict(sm['pss_pass'])} | {_times(sm.get('held_ratio'))} | "
                     f"{' | '.join(_ceiling_cells(sm))} |")
        notes += [f"- {w['name']}: {n}" for n in sm["notes"]]
        also += [f"- {w['name']}: {n}" for n in sm.get("also", [])]
    lines += ["", "Samples/s; ratio = gpufeed's best (loader, fetch variant) over the stock "
              "loader's best variant. PSS compares the same variant, round by round (the "
              "median of each round's ratio: `paired_ratio` in `summary.py`). Peak held: PSS "
              "plus shared memory the process tree holds open but maps nowhere (the stock "
              "loader's queued batches, in no PSS; `_tools/measure.py`), the same way.", ""]
    if s.get("ceiling", False):
        lines += [
            f"No-loader ceiling: {s['num_workers']} plain forked processes, one torch thread "
            "each, fetch and collate their share of the same epoch's batches (the variant's "
            "dataset and collate_fn; gpufeed.sources.ArrayDataset's one-op gather, as gpufeed's "
            "workers do it) and drop them, timed from one start signal to the last "
            "one done, alternating with the loaders. It is what these "
            f"{env['cpu_affinity']} cores do with {s['num_workers']} workers and no loader, an "
            "upper bound for a loader with as many workers, not a target: the main process's "
            "own work (receiving batches, bookkeeping) is not in it, and a loader's rate, "
            "which starts after warm-up batches with later ones under way, may come within "
            "noise of it; % of ceiling compares each best with its own variant's ceiling, "
            "the median of each round's share (the rounds' lowest and highest in "
            "brackets).", "", *_bound_lines(doc["workloads"])]
    if notes:
        lines += ["Misses:", "", *notes, ""]
    if also:
        lines += ["Not judged by the targets, above the stock loader's memory:", "", *also, ""]
    lines += ["## Every (workload, variant, loader), medians", "",
              "| workload | variant | loader | samples/s | MB/s | peak PSS MiB | anon / file / "
              "shmem MiB | PSS growth MiB | first batch ms | main CPU us/batch: thread / "
              "process |",
              "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for w in doc["workloads"]:
        ceiling = {c["variant"]: c for c in w.get("ceiling", [])}
        results = w.get("results", [])
        for variant in dict.fromkeys([r["variant"] for r in results] + list(ceiling)):
            for r in results:
                if r["variant"] != variant:
                    continue
                m = r["median"]
                kinds = " / ".join(_fmt(m.get(f"peak_pss_{k}_bytes", 0) / 2**20)
                                   for k in ("anon", "file", "shmem"))
                lines.append(
                    f"| {w['name']} | {variant} | {r['loader']} | {_fmt(m['samples_per_s'])} | "
                    f"{_fmt(m['bytes_per_s'] / 1e6)} | {_fmt(m['peak_pss_bytes'] / 2**20)} | "
                    f"{kinds} | {_fmt(m['pss_growth_bytes'] / 2**20)} | "
                    f"{_fmt(m['first_batch_s'] * 1e3)} | {_main_cpu(m)}{_niced(r)} |")
            if variant in ceiling:
                m = ceiling[variant]["median"]
                lines.append(f"| {w['name']} | {variant} | {CEILING} | "
                             f"{_fmt(m['samples_per_s'])} | {_fmt(m['bytes_per_s'] / 1e6)} | "
                             "- | - | - | - | - |")
    lines += ["", "anon / file / shmem: the peak sample split by kind (medians of each, so they "
              "need not add up to the peak exactly). main CPU: CPU microseconds of the main "
              "process per batch over the counted batches, of the iterating thread and of all "
              "its threads but the PSS sampler (thread workers included; worker processes not): "
              "what the loader takes from the cores its workers and the training loop share; "
              "then how many runs ended with gpufeed's workers at a lower priority "
              "(`worker_nice` in `loader.stats()`: README, Worker priority). "
              "The no-loader ceiling rows measure no memory, first batch or main CPU."]
    return "\n".join(lines) + "\n"


def write_results(doc: dict[str, Any], out: Path, stem: str = "cpu") -> tuple[Path, Path]:
    """Write ``<stem>.json`` and ``<stem>.md`` into ``out`` (created if needed)."""
    return write_documents(doc, out, stem, render_markdown(doc))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["autotune"]:  # num_workers="auto" against the static grid
        from .autotune import main as autotune_main

        return autotune_main(argv[1:])
    if argv[:1] == ["sources"]:  # data sources (bench.sources)
        from .sources import main as sources_main

        return sources_main(argv[1:])
    if argv[:1] == ["shards"]:  # JPEGs in tar shards (bench.shards)
        from .shards import main as shards_main

        return shards_main(argv[1:])
    if argv[:1] == ["gpu"]:  # the host-to-device path (bench.gpu; needs CUDA)
        from .gpu import main as gpu_main

        return gpu_main(argv[1:])
    args = _parser().parse_args(argv)
    settings = Settings(
        num_workers=args.num_workers,
        repeats=args.repeats or (1 if args.quick else 3),
        max_seconds=args.max_seconds,
        warmup_batches=1 if args.quick else 3,
        quick=args.quick,
        ceiling=args.ceiling)
    doc = run_cpu(args.workloads, settings=settings, loaders=args.loaders,
                  cache_dir=args.cache_dir, progress=lambda line: print(line, flush=True))
    output_path, md_path = write_results(doc, args.out)
    print()
    print(render_markdown(doc).split("## Every")[0].rstrip())
    print(f"\nwrote {output_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
