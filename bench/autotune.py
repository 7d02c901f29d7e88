"""``python -m bench autotune``: ``num_workers="auto"`` against every static setting.

On each workload, side by side in one run: the static grid (1, 2, 4, 8, 16 workers, process
and thread) and ``"auto"`` (process and thread), each from its default, in a training loop
whose step is a sleep (a GPU step is the CPU waiting). Each configuration is a fresh loader
over a sequential sampler; the order of the configurations rotates from workload to workload.

- ``io``: each sample sleeps ``IO_MS`` with the GIL released (latency-bound storage), a short
  step: the best static setting has far more workers than cores.
- ``gil``: pure-Python samples (a loop holding the GIL): more workers than cores only hurt.
- ``step``: a 50 ms step over cheap data: the loader must not spend what it does not need.
- ``phase``: latency-bound samples, and the step gets 10x faster halfway (20 ms -> 2 ms).

Per phase of a run: the rate (batches/s, after ``WARM_S``, and for ``"auto"`` after its last
change too: its steady rate; its whole-phase rate as well), the loop's input-bound share
(its time blocked in ``next()`` over wait + step), the process tree's CPU use, its PSS sampled
three times (growth over the PSS before ``iter()``), and for ``"auto"`` when it converged: the
seconds and batches from the phase's start to its last change. ``gpufeed tune`` runs on each
phase's step too, and its recommendation is looked up in the grid. ``summary`` and
``render_markdown`` (``autotune_report.py``) judge the targets.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

from gpufeed._base.system import TreeCpu
from gpufeed._host.config import WORKER_TYPES, WorkerType
from gpufeed._loader import DataLoader
from gpufeed._tools.measure import one_intra_op_thread
from gpufeed._tools.probe import descendants, process_tree_pss
from gpufeed._tools.tuner import tune

__all__ = ["GRID", "WORKLOADS", "AutoWorkload", "main", "run_autotune", "run_config"]

IO_MS = 4.0
PHASE_IO_MS = 1.0
GIL_LOOPS = 20_000
WARM_S = 0.5
N = 10**7  # samples: no run reaches the end of the epoch
GRID: tuple[tuple[int | str, WorkerType], ...] = (
    *((n, wt) for wt in WORKER_TYPES for n in (1, 2, 4, 8, 16)),
    ("auto", "process"), ("auto", "thread"))


class IOSamples(Dataset[torch.Tensor]):
    """Each sample waits ``ms`` with the GIL released, then is a small tensor."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.ms / 1000)
        return torch.full((64,), float(i))


class PythonSamples(Dataset[torch.Tensor]):
    """Each sample runs ``loops`` iterations of pure Python, holding the GIL."""

    def __init__(self, loops: int) -> None:
        self.loops = loops

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        s = 0
        for k in range(self.loops):
            s += k * k % 7
        return torch.full((64,), float(i + s % 2))


class CheapSamples(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((256,), float(i))


@dataclass(frozen=True)
class AutoWorkload:
    """A dataset, a batch size and the step of each phase (seconds per batch)."""

    name: str
    describe: str
    dataset: Callable[[], Dataset[Any]]
    batch_size: int
    steps: tuple[float, ...]


WORKLOADS = {w.name: w for w in (
    AutoWorkload("io", f"samples wait {IO_MS:g} ms each with the GIL released, batch 8 "
                 "(32 ms of waiting per batch), 2 ms step", lambda: IOSamples(IO_MS), 8,
                 (0.002,)),
    AutoWorkload("gil", f"pure-Python samples ({GIL_LOOPS:,} loop iterations each, holding the "
                 "GIL), batch 8, 1 ms step", lambda: PythonSamples(GIL_LOOPS), 8, (0.001,)),
    AutoWorkload("step", "cheap samples (a 1 KiB tensor), batch 32, 50 ms step", CheapSamples,
                 32, (0.05,)),
    AutoWorkload("phase", f"samples wait {PHASE_IO_MS:g} ms each, batch 8; the step goes from "
                 "20 ms to 2 ms halfway", lambda: IOSamples(PHASE_IO_MS), 8, (0.02, 0.002)),
)}


def _sample_time(dataset: Dataset[Any], n: int = 20) -> float:
    t0 = time.perf_counter()
    for i in range(n):
        dataset[i]
    return (time.perf_counter() - t0) / n


def run_config(workload: AutoWorkload, num_workers: int | str, worker_type: WorkerType,
               seconds: float) -> dict[str, Any]:
    """One configuration over every phase of ``workload``, ``seconds`` per phase."""
    pss0 = process_tree_pss()
    cpu = TreeCpu()
    phases: list[dict[str, Any]] = []
    with warnings.catch_warnings():  # more workers than cores is the point here
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        loader = DataLoader(workload.dataset(), batch_size=workload.batch_size,
                            num_workers=num_workers,  # type: ignore[arg-type]
                            worker_type=worker_type, worker_init_fn=one_intra_op_thread)
        tuner = loader._autotune
        it = iter(loader)
        try:
            for step_s in workload.steps:
                phases.append(_phase(it, loader, cpu, step_s, seconds, pss0))
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()
    out: dict[str, Any] = {"num_workers": num_workers, "worker_type": worker_type,
                           "phases": phases}
    if tuner is not None:
        snap = tuner.snapshot()
        out.update(budget_memory_bytes=snap.memory_budget, budget_cpu_cores=snap.cpu_budget,
                   max_workers=snap.max_workers,
                   decisions=[str(d) for d in snap.decisions], decided=snap.decided)
    return out


def _phase(it: Any, loader: DataLoader[Any], cpu: TreeCpu, step_s: float, seconds: float,
           pss0: int) -> dict[str, Any]:
    start = time.perf_counter()
    cpu0 = cpu.read(p.pid for p in descendants()).total
    times: list[float] = []  # when each batch arrived, from the phase's start
    waits: list[float] = []
    changes: list[tuple[float, int, int]] = []  # (t, batches so far, workers) at each change
    workers = loader.num_workers
    depth = _depth(loader)
    pss: list[int] = []
    marks = [0.4 * seconds, 0.7 * seconds, 0.95 * seconds]
    while True:
        t0 = time.perf_counter()
        next(it)
        t1 = time.perf_counter()
        times.append(t1 - start)
        waits.append(t1 - t0)
        time.sleep(step_s)
        now = time.perf_counter() - start
        if (loader.num_workers, _depth(loader)) != (workers, depth):
            workers, depth = loader.num_workers, _depth(loader)
            changes.append((now, len(times), workers))
        if marks and now >= marks[0]:
            marks.pop(0)
            pss.append(process_tree_pss())
        if now >= seconds:
            break
    elapsed = time.perf_counter() - start
    cores = (cpu.read(p.pid for p in descendants()).total - cpu0) / elapsed
    from_t = max(changes[-1][0] if changes else 0.0, WARM_S)
    steady = [i for i, t in enumerate(times) if t >= from_t]
    wait = sum(waits[i] for i in steady)
    loop = elapsed - from_t
    return {
        "step_s": step_s, "seconds": elapsed, "batches": len(times),
        "rate": len(steady) / loop if loop > 0 else 0.0,
        "rate_whole": len(times) / elapsed,
        "input_bound": wait / (wait + step_s * len(steady)) if steady else None,
        "cpu_cores": cores, "pss_peak_bytes": max(pss, default=0),
        "pss_growth_bytes": max(0, max(pss, default=pss0) - pss0),
        "workers_end": workers, "workers_max": max([loader.num_workers, *(
            c[2] for c in changes)]), "depth_end": depth,
        "converged_s": changes[-1][0] if changes else 0.0,
        "converged_batches": changes[-1][1] if changes else 0,
        "changes": [list(c) for c in changes],
    }


def _depth(loader: DataLoader[Any]) -> int:
    return loader._autotune.depth if loader._autotune is not None else 0


def _tune(workload: AutoWorkload, step_s: float, budget_s: float) -> dict[str, Any]:
    def step(_: Any) -> None:
        time.sleep(step_s)

    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = tune(workload.dataset(), batch_size=workload.batch_size, step=step,
                      trial_seconds=0.3, runs=3, time_budget_s=budget_s)
    return {"step_s": step_s, "recommended": result.recommended,
            "trials": len(result.trials), "seconds": time.perf_counter() - t0,
            "chosen_samples_per_s": result.chosen.samples_per_s,
            "chosen_input_bound": result.chosen.input_bound}


def run_autotune(names: Sequence[str], *, seconds_static: float, seconds_auto: float,
                 grid: Sequence[tuple[int | str, WorkerType]] = GRID, with_tune: bool = True,
                 tune_budget_s: float = 30.0,
                 progress: Callable[[str], None] = lambda line: None) -> list[dict[str, Any]]:
    """Every configuration of ``grid`` on each workload named; one dict per workload."""
    out = []
    for k, name in enumerate(names):
        w = WORKLOADS[name]
        order = list(grid)[k % len(grid):] + list(grid)[:k % len(grid)]
        runs = []
        sample_s = _sample_time(w.dataset())
        progress(f"{name}: {w.describe}; one sample takes {sample_s * 1e3:.2f} ms here")
        for n, wt in order:
            seconds = seconds_auto if n == "auto" else seconds_static
            r = run_config(w, n, wt, seconds)
            runs.append(r)
            progress(f"  {wt:7} {n!s:>4}: " + "; ".join(
                f"{p['rate']:,.0f} batches/s, input-bound {p['input_bound'] or 0:.0%}, "
                f"{p['workers_end']} workers" for p in r["phases"]))
        tunes = [_tune(w, s, tune_budget_s) for s in w.steps] if with_tune else []
        for t in tunes:
            progress(f"  tune (step {t['step_s'] * 1e3:g} ms): {t['recommended']} "
                     f"in {t['seconds']:.0f} s")
        out.append({"name": name, "describe": w.describe, "sample_s": sample_s,
                    "batch_size": w.batch_size, "steps": list(w.steps), "runs": runs,
                    "tune": tunes})
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench autotune [--workloads ...] [--quick] [--out DIR]``."""
    import argparse
    import os
    from pathlib import Path

    from gpufeed._tools.environment import environment

    from .autotune_report import render_markdown, summarize, write_results

    p = argparse.ArgumentParser(
        prog="python -m bench autotune",
        description='num_workers="auto" against every static setting (1, 2, 4, 8, 16 '
                    "workers, process and thread), side by side.")
    p.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=list(WORKLOADS),
                   metavar="NAME", help=f"from {', '.join(WORKLOADS)} (default: all)")
    p.add_argument("--seconds-static", type=float, default=None,
                   help="seconds per phase of each static setting (default 3)")
    p.add_argument("--seconds-auto", type=float, default=None,
                   help='seconds per phase of "auto" (default 12: it must converge within 10)')
    p.add_argument("--no-tune", dest="tune", action="store_false",
                   help="skip gpufeed tune on each phase's step")
    p.add_argument("--quick", action="store_true",
                   help="a second per run, no tune (for tests, not for figures)")
    p.add_argument("--out", type=Path, default=Path("bench/results"),
                   help="folder for autotune.json and autotune.md (default bench/results)")
    args = p.parse_args(argv)
    static = args.seconds_static or (1.0 if args.quick else 3.0)
    auto = args.seconds_auto or (1.5 if args.quick else 12.0)
    env = environment()
    workloads = run_autotune(args.workloads, seconds_static=static, seconds_auto=auto,
                             with_tune=args.tune and not args.quick,
                             progress=lambda line: print(line, flush=True))
    env["loadavg_end"] = list(os.getloadavg())
    for w in workloads:
        w["summary"] = summarize(w)
    doc = {"environment": env, "settings": {"seconds_static": static, "seconds_auto": auto,
                                            "warm_s": WARM_S, "quick": args.quick},
           "workloads": workloads}
    output_path, md_path = write_results(doc, args.out)
    print(render_markdown(doc).split("<details>")[0])
    print(f"wrote {output_path} and {md_path}")
    return 0
