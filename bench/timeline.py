"""What recording a trace costs: ``python -m bench.timeline``.

The worst case for ``gpufeed.trace`` is the cheapest batches: the tabular workload (256 rows
of 64 float32 + an int64 label per batch, one vectorised gather each, ~60 us of machine time
per batch on 2 cores), ``gpufeed.DataLoader`` with 2 process workers, whole shuffled epochs.
Each repeat runs every mode once, the order rotating from one repeat to the next:

    off       no trace (the hooks cost one check per batch and stage)
    on        ``with gpufeed.trace():`` around the epoch, unbounded
    on-last   ``gpufeed.trace(last_batches=1000)``, the bound a long run would use

and measures samples/s (wall clock, after 3 warm-up batches) and the CPU seconds the whole
process tree spent per batch (this process plus its reaped workers, ``getrusage``), which a
loaded machine disturbs less than wall time. The figures are ratios to "off": the median of
the per-repeat ratios (each "on" run against the "off" run of its own repeat) and their
range, and the ratio of the medians.

All the recording happens in the main thread, so the finest measure of its cost is that
thread's CPU time: ``repeats // 2`` more epochs switch tracing on and off every 200 batches
(``toggled``), the same loader and workers on both sides, and compare the main thread's CPU
per batch of adjacent phases; as many epochs again switch nothing (an A/A control), whose
differences show how small a difference this machine can resolve at the moment. It also
times the recorder's per-batch calls alone.
Results: ``timeline.json`` and ``timeline.md`` in ``--out`` (``bench/results``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
import timeit
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from gpufeed._tools.environment import environment
from gpufeed._tools.measure import measure_loader, one_intra_op_thread

from .workloads import build

__all__ = ["MODES", "main", "recorder_cost_ns", "run"]

MODES = ("off", "on", "on-last")
TARGET = 0.03  # on: within 3% of off's throughput


def _cpu_s() -> tuple[float, float]:
    """CPU seconds of this process, and of this process plus its reaped children."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    mine = own.ru_utime + own.ru_stime
    return mine, mine + kids.ru_utime + kids.ru_stime


def _one(dataset: Any, mode: str, seed: int) -> dict[str, float]:
    import gpufeed

    def make() -> Any:
        return gpufeed.DataLoader(dataset, batch_size=256, shuffle=True, num_workers=2,
                                  generator=torch.Generator().manual_seed(seed),
                                  worker_init_fn=one_intra_op_thread)

    main0, tree0 = _cpu_s()
    if mode == "off":
        m = measure_loader(make, sample_memory=False, warmup_batches=3)
    else:
        with gpufeed.trace(last_batches=1000 if mode == "on-last" else None):
            m = measure_loader(make, sample_memory=False, warmup_batches=3)
    main1, tree1 = _cpu_s()  # the workers are joined (reaped) when the epoch ends
    n = m.batches + 3
    return {"samples_per_s": m.samples_per_s, "cpu_us_per_batch": (tree1 - tree0) / n * 1e6,
            "main_cpu_us_per_batch": (main1 - main0) / n * 1e6}


def toggled(dataset: Any, seed: int, *, phase: int = 200, start_on: bool = False,
            control: bool = False) -> dict[str, list[float]]:
    """One epoch with tracing switched on and off every ``phase`` batches (first on when
    ``start_on``; alternate it between epochs so neither mode always has the epoch's first
    phase, with the ring still growing): the main thread's
    CPU microseconds per batch (``time.thread_time``: not the workers', not other
    processes') and wall microseconds per batch, per phase. Both modes share the loader,
    its workers and the machine's state of the moment, so their difference is what the
    recording costs the main process, where all of it happens. ``control``: the "on" phases
    record nothing either (an A/A run: its differences are the method's noise floor)."""
    import gpufeed

    loader = gpufeed.DataLoader(dataset, batch_size=256, shuffle=True, num_workers=2,
                                generator=torch.Generator().manual_seed(seed),
                                worker_init_fn=one_intra_op_thread)
    out: dict[str, list[float]] = {"off_cpu": [], "on_cpu": [], "off_wall": [], "on_wall": [],
                                   "added_cpu": []}
    it = iter(loader)
    for _ in range(5):  # warm-up: workers started, ring carved
        next(it)
    on, done = start_on, False
    while not done:
        recording = gpufeed.trace().start() if on and not control else None
        cpu0, wall0, n = time.thread_time(), time.perf_counter(), 0
        for _ in range(phase):
            try:
                next(it)
            except StopIteration:
                done = True
                break
            n += 1
        cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
        if recording is not None:
            recording.stop()
        if n == phase:
            mode = "on" if on else "off"
            out[f"{mode}_cpu"].append(cpu / n * 1e6)
            out[f"{mode}_wall"].append(wall / n * 1e6)
            if len(out["on_cpu"]) == len(out["off_cpu"]):  # a pair of adjacent phases
                out["added_cpu"].append(out["on_cpu"][-1] - out["off_cpu"][-1])
        on = not on
    return out


def recorder_cost_ns(number: int = 100_000) -> dict[str, float]:
    """Nanoseconds of the recorder's calls for one batch of a worker-pool loader, alone."""
    from gpufeed._base.timeline import Timeline

    tl, owner = Timeline(), object()

    def batch() -> None:
        tl.worker_batch(owner, 0, 7, 0, 1.0, 0.001, 0.0002, 65536, False)
        tl.handout(owner, 7, 0, 1.0, 1.5, 2.0, 2.1)

    def nothing() -> None:
        return None

    best = min(timeit.repeat(batch, number=number, repeat=5))
    base = min(timeit.repeat(nothing, number=number, repeat=5))
    return {"per_batch_ns": (best - base) / number * 1e9}


def _spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run(*, repeats: int = 10, quick: bool = False, seed: int = 0) -> dict[str, Any]:
    """Measure every mode ``repeats`` times, interleaved; the results document."""
    torch.set_num_threads(1)
    work = build("tabular", quick=quick)
    dataset = next(v.dataset for v in work.variants if v.name == "array")
    env = environment()
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    for r in range(repeats):
        for mode in MODES[r % len(MODES):] + MODES[:r % len(MODES)]:
            runs[mode].append(_one(dataset, mode, seed))
    rows: dict[str, Any] = {}
    off_median = statistics.median(x["samples_per_s"] for x in runs["off"])
    for mode in MODES:
        rates = [x["samples_per_s"] for x in runs[mode]]
        cpus = [x["cpu_us_per_batch"] for x in runs[mode]]
        mains = [x["main_cpu_us_per_batch"] for x in runs[mode]]
        row: dict[str, Any] = {"samples_per_s": _spread(rates), "cpu_us_per_batch": _spread(cpus),
                               "main_cpu_us_per_batch": _spread(mains), "runs": runs[mode]}
        if mode != "off":
            paired = [a["samples_per_s"] / b["samples_per_s"]
                      for a, b in zip(runs[mode], runs["off"], strict=True)]
            paired_cpu = [a["cpu_us_per_batch"] / b["cpu_us_per_batch"]
                          for a, b in zip(runs[mode], runs["off"], strict=True)]
            row["throughput_ratio"] = _spread(paired)
            row["throughput_ratio_of_medians"] = statistics.median(rates) / off_median
            row["cpu_ratio"] = _spread(paired_cpu)
            # what tracing adds to the main process (where it records), as a share of all
            # the CPU time a batch costs without it
            added = statistics.median(mains) - statistics.median(
                x["main_cpu_us_per_batch"] for x in runs["off"])
            row["main_cpu_added_us_per_batch"] = added
            row["main_cpu_added_share"] = added / statistics.median(
                x["cpu_us_per_batch"] for x in runs["off"])
        rows[mode] = row
    phases: dict[str, list[float]] = {"off_cpu": [], "on_cpu": [], "off_wall": [], "on_wall": [],
                                      "added_cpu": []}
    phase = 10 if quick else 200
    control: list[float] = []
    for r in range(max(1, repeats // 2)):
        for key, values in toggled(dataset, seed + r, phase=phase, start_on=r % 2 == 1).items():
            phases[key] += values
        control += toggled(dataset, seed + r, phase=phase, start_on=r % 2 == 1,
                           control=True)["added_cpu"]
    n = len(phases["added_cpu"])
    added = statistics.median(phases["added_cpu"])
    off_tree = statistics.median(x["cpu_us_per_batch"] for x in runs["off"])
    main_thread: dict[str, Any] = {
        "phase_batches": phase, "phase_pairs": n, "added_cpu_us_spread": _spread(
            phases["added_cpu"]),
        "control_added_cpu_us_per_batch": statistics.median(control),
        "control_added_cpu_us_spread": _spread(control), "control_pairs": len(control),
        "off_cpu_us_per_batch": _spread(phases["off_cpu"]),
        "on_cpu_us_per_batch": _spread(phases["on_cpu"]),
        "added_cpu_us_per_batch": added, "added_share_of_batch_cpu": added / off_tree,
        "wall_ratio": statistics.median(phases["on_wall"]) / statistics.median(phases["off_wall"]),
        "phases": phases,
    }
    return {"schema": "gpufeed-bench-timeline/1", "workload": work.description,
            "loader": "gpufeed.DataLoader, 2 process workers, batch 256, shuffled, whole epochs",
            "repeats": repeats, "quick": quick, "modes": rows, "target": TARGET,
            "recorder": recorder_cost_ns(), "main_thread": main_thread, "environment": env,
            "loadavg_end": list(os.getloadavg())}


def render_markdown(doc: dict[str, Any]) -> str:
    env = doc["environment"]
    load0 = ", ".join(f"{x:.1f}" for x in env["loadavg_start"])
    load1 = ", ".join(f"{x:.1f}" for x in doc["loadavg_end"])
    lines = [
        "# What recording a trace costs (`gpufeed.trace`)", "",
        f"{env['date']} on `{env['hostname']}`: {env['cpu_model']}, {env['cpu_affinity']} "
        f"usable cores; Python {env['python']}, torch {env['torch']}, gpufeed "
        f"{env['gpufeed']} ({(env['git_commit'] or '')[:10]}); load average {load0} at start, "
        f"{load1} at end.", "",
        f"Workload: tabular, {doc['workload']} ({doc['loader']}); {doc['repeats']} repeats, "
        "modes interleaved with the order rotating; rates after 3 warm-up batches. CPU: the "
        "whole process tree's CPU seconds per batch (main process and workers).", "",
        "| mode | samples/s median (min-max) | ratio to off: per repeat, median (min-max) "
        "| ratio of medians | CPU us/batch median | CPU ratio per repeat, median (min-max) "
        "| main-process CPU us/batch median | added by tracing, share of a batch's CPU |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for mode, row in doc["modes"].items():
        s = row["samples_per_s"]
        rate = f"{s['median']:,.0f} ({s['min']:,.0f}-{s['max']:,.0f})"
        if mode == "off":
            ratio = ratio_m = cpu_r = added = "-"
        else:
            t, c = row["throughput_ratio"], row["cpu_ratio"]
            ratio = f"{t['median']:.3f} ({t['min']:.3f}-{t['max']:.3f})"
            ratio_m = f"{row['throughput_ratio_of_medians']:.3f}"
            cpu_r = f"{c['median']:.3f} ({c['min']:.3f}-{c['max']:.3f})"
            added = (f"{row['main_cpu_added_us_per_batch']:+.1f} us "
                     f"({row['main_cpu_added_share']:+.1%})")
        cpu = f"{row['cpu_us_per_batch']['median']:.1f}"
        main = f"{row['main_cpu_us_per_batch']['median']:.1f}"
        lines.append(f"| {mode} | {rate} | {ratio} | {ratio_m} | {cpu} | {cpu_r} | {main} "
                     f"| {added} |")
    mt = doc["main_thread"]
    spread = mt["added_cpu_us_spread"]
    lines += ["", f"Tracing switched on and off every {mt['phase_batches']} batches within an "
              f"epoch ({mt['phase_pairs']} pairs of adjacent phases, same loader and workers): "
              f"the main thread's CPU per batch off {mt['off_cpu_us_per_batch']['median']:.1f} "
              f"us, on {mt['on_cpu_us_per_batch']['median']:.1f} us; added per batch (median "
              f"over the pairs, range {spread['min']:+.1f} to {spread['max']:+.1f}) "
              f"{mt['added_cpu_us_per_batch']:+.2f} us = "
              f"{mt['added_share_of_batch_cpu']:+.2%} of the CPU time a batch costs in all "
              f"(process tree, off). Wall time per batch, on / off: {mt['wall_ratio']:.3f}. "
              f"The same epochs with nothing switched (an A/A control, {mt['control_pairs']} "
              f"pairs) differ by {mt['control_added_cpu_us_per_batch']:+.2f} us (range "
              f"{mt['control_added_cpu_us_spread']['min']:+.1f} to "
              f"{mt['control_added_cpu_us_spread']['max']:+.1f}): the noise floor of this "
              "measure on this machine now."]
    rec = doc["recorder"]["per_batch_ns"]
    off_cpu = doc["modes"]["off"]["cpu_us_per_batch"]["median"]
    lines += ["", f"The recorder's calls for one batch (a worker's spans and a handover), timed "
              f"alone: {rec:,.0f} ns, {rec / 1e3 / off_cpu:.2%} of the CPU time a batch costs "
              f"without tracing ({off_cpu:.1f} us). Target: tracing on within "
              f"{doc['target']:.0%} of off.", "",
              "Reading: on a quiet machine the whole-epoch ratios are the figure to quote; on "
              "a loaded one their range is wider than the effect, and the main thread's CPU "
              "per batch in alternating phases, set against its A/A control, and the "
              "recorder's cost per batch against a batch's CPU time bound what tracing costs."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.timeline",
                                description="What gpufeed.trace costs on the cheapest batches.")
    p.add_argument("--repeats", type=int, default=10, help="runs of each mode (10)")
    p.add_argument("--out", type=Path, default=Path("bench/results"),
                   help="folder for timeline.json and timeline.md (bench/results)")
    p.add_argument("--quick", action="store_true", help="a tiny workload (tests)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats}: at least 1")
    t0 = time.perf_counter()
    doc = run(repeats=args.repeats, quick=args.quick)
    doc["elapsed_s"] = round(time.perf_counter() - t0, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "timeline.json").write_text(json.dumps(doc, indent=2) + "\n")
    text = render_markdown(doc)
    (args.out / "timeline.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
