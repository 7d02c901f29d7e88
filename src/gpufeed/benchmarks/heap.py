"""What following batches with the worker's heap saves (NOTE [ Worker heap ] in
``_memory/heap.py``): ``python -m gpufeed.benchmarks.heap``.

One loader of the CPU benchmark (``benchmarks/cpu.py``: same workloads, variants and settings)
per run, each run in a new interpreter, as a training script starts: a worker inherits its
main process's malloc state by fork, and in one long benchmark process that state is
whatever the runs before left (the CPU benchmark's own runs inherit raised thresholds, so
they do not show this). Sides, alternating in every round: the stock loader, gpufeed with
its workers' heap left as glibc has it (``heap.FOLLOW = False``), and gpufeed. Each run
times one epoch after 3 warm-up batches and counts its workers' minor page faults over the
same batches. Results: ``heap-<workload>-<variant>.json`` and ``.md`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil
import torch

from .._memory import heap
from .cpu import Settings, _factory, add_workload_options, workload_variant
from .environment import environment, environment_line, write_documents

__all__ = ["main", "one_run"]

SIDES = ("stock", "gpufeed, heap left alone", "gpufeed")
WARMUP = 3


def _workers_faults() -> int:
    """Minor page faults of this process's children so far (Linux; 0 elsewhere)."""
    total = 0
    for child in psutil.Process().children(recursive=True):
        try:
            with open(f"/proc/{child.pid}/stat") as f:
                total += int(f.read().rpartition(")")[2].split()[7])  # field 10: minflt
        except (OSError, ValueError, IndexError):
            pass
    return total


def one_run(side: str, workload: str, variant: str, *, num_workers: int = 2,
            quick: bool = False) -> dict[str, Any]:
    """One epoch of ``side``'s loader in this process: samples/s and workers' faults per
    batch after the warm-up."""
    torch.set_num_threads(1)
    heap.FOLLOW = side != "gpufeed, heap left alone"
    work, v = workload_variant(workload, variant, quick=quick)
    make = _factory("torch" if side == "stock" else "gpufeed", v, work,
                    Settings(num_workers=num_workers, quick=quick))
    it = iter(make())
    n = len(it)  # type: ignore[arg-type]
    for _ in range(WARMUP):
        next(it)
    t0, f0 = time.perf_counter(), _workers_faults()
    batches = samples = 0
    end = (t0, f0)
    for batch in it:
        batches += 1
        samples += len(batch[0]) if isinstance(batch, (tuple, list)) else len(batch)
        if batches == n - WARMUP:  # the workers still live: read their faults now
            end = (time.perf_counter(), _workers_faults())
    return {"samples_per_s": samples / (end[0] - t0), "batches": batches,
            "worker_faults_per_batch": (end[1] - f0) / max(batches, 1)}


def _child(side: str, args: argparse.Namespace) -> dict[str, Any]:
    code = ("import json; from gpufeed.benchmarks.heap import one_run; "
            f"print(json.dumps(one_run({side!r}, {args.workload!r}, {args.variant!r}, "
            f"num_workers={args.num_workers}, quick={args.quick})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=600)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _spread(xs: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def summarize(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Medians (min-max) per side, and per-round ratios of gpufeed to the other two."""
    sides = {s: {"samples_per_s": _spread([r[s]["samples_per_s"] for r in rounds]),
                 "worker_faults_per_batch": _spread(
                     [r[s]["worker_faults_per_batch"] for r in rounds])} for s in SIDES}
    ratios = {f"gpufeed / {other}": _spread(
        [r["gpufeed"]["samples_per_s"] / r[other]["samples_per_s"] for r in rounds])
        for other in SIDES[:2]}
    return {"sides": sides, "ratios": ratios}


def render(env: dict[str, Any], args: argparse.Namespace, summary: dict[str, Any]) -> str:
    def fmt(d: dict[str, float], spec: str) -> str:
        return f"{d['median']:{spec}} ({d['min']:{spec}}-{d['max']:{spec}})"

    lines = [
        "# A process worker's heap: following its batches, or left as glibc has it",
        "",
        environment_line(env),
        "",
        f"`python -m gpufeed.benchmarks.heap --workload {args.workload} --variant "
        f"{args.variant} --rounds {args.rounds}`: {args.num_workers} workers, one epoch per run "
        f"after {WARMUP} warm-up batches, every run in a new interpreter, the sides alternating "
        "in each round (NOTE [ Worker heap ] in `_memory/heap.py`). Medians (min-max) over the "
        "rounds.",
        "",
        "| side | samples/s | workers' minor faults per batch |",
        "| --- | ---: | ---: |",
    ]
    for side, d in summary["sides"].items():
        lines.append(f"| {side} | {fmt(d['samples_per_s'], ',.0f')} | "
                     f"{fmt(d['worker_faults_per_batch'], ',.0f')} |")
    lines += ["", "| ratio, per round | median (min-max) |", "| --- | ---: |"]
    for name, d in summary["ratios"].items():
        lines.append(f"| {name} | {fmt(d, '.2f')}x |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpufeed.benchmarks.heap",
                                description=__doc__.split("\n\n")[0])
    add_workload_options(p, workload="image-array", variant="per-sample")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: use 1 or more")
    env = environment()
    rounds = []
    for r in range(args.rounds):
        order = SIDES[r % 3:] + SIDES[:r % 3]
        runs = {side: _child(side, args) for side in order}
        print(f"round {r}: " + ", ".join(f"{s} {runs[s]['samples_per_s']:,.0f} samples/s"
                                         for s in SIDES), flush=True)
        rounds.append(runs)
    summary = summarize(rounds)
    record = {"environment": env, "args": {k: str(v) for k, v in vars(args).items()},
              "rounds": rounds, "summary": summary}
    markdown = render(env, args, summary)
    write_documents(record, args.out, f"heap-{args.workload}-{args.variant}", markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
