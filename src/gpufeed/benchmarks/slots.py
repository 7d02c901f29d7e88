"""Slots bound when a task starts, against slots bound at dispatch (NOTE [ Slots bound when a
task starts ] in ``_host/late_slots.py``): ``python -m gpufeed.benchmarks.slots``.

Two parts, the sides alternating in every round, medians (min-max) over ``--rounds``:

1. The CPU benchmark's jpeg workload (``benchmarks/workloads.py``: per-sample Pillow decodes,
   batch 64, ``--num-workers`` process workers, a loop that only counts): samples/s, the
   ring's slots carved and the process tree's peak PSS (its shared-memory part apart), for
   the stock loader, gpufeed with every slot bound at dispatch (``late_slots.ENABLED =
   False``) and gpufeed.
2. A loop with a training step: batches of about 32 ms of worker time that sleep (the cores
   stay free: only the scheduling differs), collated from samples or written by a batch
   source through ``gpufeed.batch_empty`` (whose request for its slot comes before any
   work), against steps of 0 to 30 ms: seconds per epoch, slots carved, and whether the
   iterator still bound slots late at the end (rule (e)).

Results: ``slots.json`` and ``slots.md`` in ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from .._host import late_slots
from .._host.output import batch_empty
from .._loader import DataLoader
from .._tools.peaks import PeakSampler
from .cpu import workload_variant
from .environment import environment, environment_line, write_documents

__all__ = ["SIDES", "STEPS_S", "main", "run_jpeg", "run_step"]

SIDES = ("stock", "gpufeed, slots at dispatch", "gpufeed")
STEPS_S = (0.0, 0.012, 0.016, 0.02, 0.03)
MiB = 2**20


class Sleepy(Dataset[torch.Tensor]):
    """``batches`` batches of 64 (3, 64, 64) uint8 samples, ``batch_s`` of sleep each."""

    def __init__(self, batches: int, batch_s: float) -> None:
        self.batches, self.batch_s = batches, batch_s

    def __len__(self) -> int:
        return 64 * self.batches

    def __getitem__(self, i: int) -> torch.Tensor:
        if i % 8 == 0:
            time.sleep(self.batch_s / 8)
        return torch.full((3, 64, 64), i % 251, dtype=torch.uint8)


class SleepySource(Sleepy):
    """``Sleepy`` whose ``__getitems__`` writes the batch through ``batch_empty``."""

    def __getitems__(self, indices: Sequence[int]) -> torch.Tensor:
        out = batch_empty((len(indices), 3, 64, 64), dtype=torch.uint8)
        for k, i in enumerate(indices):
            out[k] = self[i]
        return out


def _passthrough(batch: Any) -> Any:
    return batch


def _gpufeed_side(side: str) -> None:
    late_slots.ENABLED = side == "gpufeed"


def run_jpeg(side: str, *, num_workers: int, quick: bool) -> dict[str, Any]:
    """One epoch of the jpeg workload on ``side``: samples/s after 3 batches, slots carved,
    peak PSS (and its shared-memory part) of the process tree."""
    torch.set_num_threads(1)
    work, v = workload_variant("jpeg", "per-sample", quick=quick)
    cls = torch.utils.data.DataLoader if side == "stock" else DataLoader
    _gpufeed_side(side)
    try:
        sampler = PeakSampler().start_thread(0.02)
        it = iter(cls(v.dataset, batch_size=work.batch_size, shuffle=True,
                      num_workers=num_workers, generator=torch.Generator().manual_seed(0)))
        for _ in range(3):
            next(it)
        t0, samples = time.perf_counter(), 0
        for images, _labels in it:
            samples += len(images)
        rate = samples / (time.perf_counter() - t0)
        slots = it._ring.grows if side != "stock" else None  # type: ignore[attr-defined]
        sampler.stop()
    finally:
        late_slots.ENABLED = True
    return {"samples_per_s": rate, "slots": slots, "peak_pss_mib": sampler.peak.pss / MiB,
            "peak_shmem_mib": sampler.peak.shmem / MiB}


def run_step(side: str, source: bool, step_s: float, *, batches: int,
             num_workers: int) -> dict[str, Any]:
    """One epoch of ``Sleepy`` (``source``: ``SleepySource``) on a gpufeed ``side`` with a
    training step of ``step_s``: seconds, slots carved, still late at the end."""
    dataset = (SleepySource if source else Sleepy)(batches, 0.032)
    _gpufeed_side(side)
    try:
        loader = DataLoader(dataset, batch_size=64, num_workers=num_workers,
                            collate_fn=_passthrough if source else None)
        t0 = time.perf_counter()
        it = iter(loader)
        for _batch in it:
            if step_s:
                time.sleep(step_s)
        seconds = time.perf_counter() - t0
    finally:
        late_slots.ENABLED = True
    return {"seconds": seconds, "slots": it._ring.grows,
            "late_at_end": it._late.on}


def _spread(xs: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def _fmt(d: dict[str, float], spec: str) -> str:
    return f"{d['median']:{spec}} ({d['min']:{spec}}-{d['max']:{spec}})"


def render(env: dict[str, Any], args: argparse.Namespace, jpeg: dict[str, list[dict[str, Any]]],
           steps: list[dict[str, Any]]) -> str:
    lines = [
        "# Slots bound when a task starts, against slots bound at dispatch", "",
        environment_line(env), "",
        f"`python -m gpufeed.benchmarks.slots --rounds {args.rounds}`: {args.num_workers} "
        "workers, sides alternating in every round, medians (min-max) over the rounds (NOTE "
        "[ Slots bound when a task starts ] in `_host/late_slots.py`).", "",
        "The CPU benchmark's jpeg workload (per-sample Pillow decodes, batch 64, a loop that "
        "only counts; one epoch per run, the rate after 3 batches):", "",
        "| side | samples/s | slots carved | peak PSS MiB | of it shared memory MiB |",
        "| --- | ---: | ---: | ---: | ---: |"]
    for side in SIDES:
        runs = jpeg[side]
        slots = [r["slots"] for r in runs if r["slots"] is not None]
        lines.append(
            f"| {side} | {_fmt(_spread([r['samples_per_s'] for r in runs]), ',.0f')} | "
            f"{_fmt(_spread(slots), '.0f') if slots else '-'} | "
            f"{_fmt(_spread([r['peak_pss_mib'] for r in runs]), ',.0f')} | "
            f"{_fmt(_spread([r['peak_shmem_mib'] for r in runs]), ',.0f')} |")
    lines += [
        "", f"A loop with a training step: {args.batches} batches of about 32 ms of worker "
        "time each (sleeps), collated from samples or written by a batch source through "
        "`batch_empty`; seconds per epoch (ratio: slots when written over at dispatch, per "
        "round), slots carved, rounds still binding late at the end (rule (e)):", "",
        "| batches | step ms | at dispatch s | when written s | ratio | slots at dispatch | "
        "slots when written | still late |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in steps:
        eager, late = row["gpufeed, slots at dispatch"], row["gpufeed"]
        ratios = [b["seconds"] / a["seconds"] for a, b in zip(eager, late, strict=True)]
        lines.append(
            f"| {'batch source' if row['source'] else 'collated'} | {row['step_s'] * 1e3:.0f} | "
            f"{_fmt(_spread([r['seconds'] for r in eager]), '.3f')} | "
            f"{_fmt(_spread([r['seconds'] for r in late]), '.3f')} | "
            f"{_fmt(_spread(ratios), '.3f')} | "
            f"{_fmt(_spread([r['slots'] for r in eager]), '.0f')} | "
            f"{_fmt(_spread([r['slots'] for r in late]), '.0f')} | "
            f"{sum(r['late_at_end'] for r in late)}/{len(late)} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpufeed.benchmarks.slots",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--batches", type=int, default=40, help="batches per stepped epoch (40)")
    p.add_argument("--quick", action="store_true", help="tiny data and two steps (for tests)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    if args.rounds < 1 or args.batches < 4:
        p.error(f"--rounds {args.rounds} --batches {args.batches}: use --rounds >= 1 and "
                "--batches >= 4")
    env = environment()
    jpeg: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    for r in range(args.rounds):
        for side in SIDES[r % 3:] + SIDES[:r % 3]:
            jpeg[side].append(run_jpeg(side, num_workers=args.num_workers, quick=args.quick))
        print(f"jpeg round {r}: " + ", ".join(
            f"{s} {jpeg[s][-1]['samples_per_s']:,.0f} samples/s" for s in SIDES), flush=True)
    steps = []
    for source in (False, True):
        for step_s in (STEPS_S[0], STEPS_S[-1]) if args.quick else STEPS_S:
            row: dict[str, Any] = {"source": source, "step_s": step_s,
                                   "gpufeed, slots at dispatch": [], "gpufeed": []}
            for r in range(args.rounds):
                for side in SIDES[1:] if r % 2 == 0 else SIDES[:0:-1]:
                    row[side].append(run_step(side, source, step_s, batches=args.batches,
                                              num_workers=args.num_workers))
            steps.append(row)
            print(f"step {step_s * 1e3:.0f} ms, {'batch source' if source else 'collated'}: "
                  + ", ".join(f"{s} {statistics.median(x['seconds'] for x in row[s]):.3f} s"
                              for s in SIDES[1:]), flush=True)
    markdown = render(env, args, jpeg, steps)
    record = {"environment": env, "args": {k: str(v) for k, v in vars(args).items()},
              "jpeg": jpeg, "steps": steps}
    write_documents(record, args.out, "slots", markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
