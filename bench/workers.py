"""Where each worker's epoch goes, against the no-loader ceiling.

``python -m bench.workers [--workload W --variant V --rounds N]``.

The CPU benchmark's no-loader ceiling (NOTE [ No-loader ceiling ] in ``ceiling.py``) fetches an
epoch's batches in bare forked processes. When a loader's rate stays under it, the question is
whether its workers fetch more slowly or fetch as fast and do other things besides. This tool
runs one loader of the CPU benchmark (``bench/cpu.py``: same workloads, variants and
settings; a fresh loader per epoch, as there) under ``gpufeed.trace``, alternating with the
ceiling on the same batches, and splits each worker's epoch (its first task's start to its last
task's end) into:

- **fetch at the median**: batches times the worker's median fetch time: the work itself, to
  set against the ceiling's seconds per batch;
- **fetch above the median**: the rest of the fetch time, what slower fetches took beyond the
  median less what faster ones saved (the first writes into a new ring's pages, cold files, a
  core taken by another process mid-fetch);
- **pack**: describing the batch for the main process (the trace's ``collate`` span);
- **between batches**: the rest: waiting for a task, handing a result over, or no core (the
  main process and the other workers share the machine's).

The ceiling's figures are each process's time from its start signal (its processes up, a
first call made) over the batches it fetched; gpufeed's rate is the whole epoch's from the
loader's creation, worker start-up included: compare the parts, the rates only roughly.
Results: ``--json``, and lines on stdout. gpufeed loaders only (the trace records their
workers).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from gpufeed._tools.environment import environment

from .cpu import Settings, _ceiling, _factory, _fresh, add_workload_options, workload_variant

__all__ = ["main", "split_epochs", "worker_budget"]

PARTS = ("fetch at the median", "fetch above the median", "pack", "between batches")


def worker_budget(trace: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per worker track of a ``Trace.to_dict()``: batches, span and the four parts of
    it (milliseconds), and the median fetch (ms per batch)."""
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans: dict[tuple[int, int], list[tuple[float, float, str]]] = defaultdict(list)
    for e in trace["traceEvents"]:
        key = (e.get("pid"), e.get("tid"))
        if e.get("ph") == "X" and str(names.get(key, "")).startswith("worker"):
            spans[key].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    rows = []
    for key, track in sorted(spans.items(), key=lambda kv: names[kv[0]]):
        fetch = [b - a for a, b, n in track if n == "fetch"]
        if not fetch:
            continue
        median = statistics.median(fetch)
        span = max(b for _, b, _ in track) - min(a for a, _, _ in track)
        pack = sum(b - a for a, b, n in track if n == "collate")
        parts = {"fetch at the median": median * len(fetch),
                 "fetch above the median": sum(fetch) - median * len(fetch), "pack": pack}
        parts["between batches"] = span - sum(parts.values())
        rows.append({"worker": names[key], "batches": len(fetch), "span_ms": span / 1e3,
                     "median_fetch_ms": median / 1e3,
                     "parts_ms": {k: v / 1e3 for k, v in parts.items()}})
    return rows


def _loader_epoch(make: Any) -> dict[str, Any]:
    import gpufeed

    with gpufeed.trace() as tr:
        t0, samples = time.perf_counter(), 0
        loader = make()
        for batch in loader:
            samples += len(batch[0]) if isinstance(batch, (tuple, list)) else len(batch)
    seconds = time.perf_counter() - t0
    counters = getattr(loader.stats(), "counters", {})
    return {"samples_per_s": samples / seconds, "seconds": seconds,
            "ring_slots": counters.get("ring_slots"), "workers": worker_budget(tr.to_dict())}


def split_epochs(workload: str, variant: str, *, rounds: int = 3, num_workers: int = 2,
                 quick: bool = False) -> list[dict[str, Any]]:
    """``rounds`` pairs of (a gpufeed epoch split by :func:`worker_budget`, the ceiling)."""
    work, v = workload_variant(workload, variant, quick=quick)
    torch.set_num_threads(1)
    s = Settings(num_workers=num_workers, quick=quick)
    out = []
    for _ in range(rounds):
        loader = _loader_epoch(_factory("gpufeed", _fresh(v), work, s))
        c = _ceiling(_fresh(v), work, s)
        per_process = c["batches"] / max(c["processes"], 1)
        out.append({"loader": loader, "ceiling": {
            "samples_per_s": c["samples_per_s"], "fetch": c["fetch"],
            "process_ms": [1e3 * x for x in c["process_seconds"]],
            "ms_per_batch": [1e3 * x / per_process for x in c["process_seconds"]]}})
    return out


def render(rounds: Sequence[Mapping[str, Any]]) -> str:
    lines = []
    for k, r in enumerate(rounds):
        lo, ce = r["loader"], r["ceiling"]
        lines.append(f"round {k}: gpufeed {lo['samples_per_s']:,.0f} samples/s "
                     f"({lo['ring_slots']} ring slots), no-loader ceiling "
                     f"{ce['samples_per_s']:,.0f} "
                     f"({100 * lo['samples_per_s'] / ce['samples_per_s']:.0f}%); "
                     f"ceiling per batch "
                     f"{', '.join(f'{x:.2f}' for x in ce['ms_per_batch'])} ms, per process "
                     f"{', '.join(f'{x:.0f}' for x in ce['process_ms'])} ms")
        for w in lo["workers"]:
            parts = ", ".join(f"{name} {ms:.0f}" for name, ms in w["parts_ms"].items())
            lines.append(f"  {w['worker']}: {w['batches']} batches in {w['span_ms']:.0f} ms "
                         f"(median fetch {w['median_fetch_ms']:.2f} ms): {parts}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.workers",
                                description=__doc__.split("\n\n")[0])
    add_workload_options(p, workload="image-array", variant="getitems-slot")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args(argv)
    env = environment()
    rounds = split_epochs(args.workload, args.variant, rounds=args.rounds,
                          num_workers=args.num_workers, quick=args.quick)
    print(render(rounds))
    if args.json is not None:
        env["loadavg_end"] = list(os.getloadavg())
        args.json.write_text(json.dumps({"environment": env, "args": vars(args) | {
            "json": str(args.json)}, "rounds": rounds}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
