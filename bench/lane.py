"""A worker's cost per batch on gathered batches: ``python -m bench.lane``.

Runs, in one process and one thread, the work a worker does for each batch of the CPU
benchmark's tabular workload (``ArrayDataset`` over a structured array's fields, shuffled,
batch 256), three ways, alternating, best of ``--repeats`` passes of ``--batches`` batches:

- ``bare gather``: ``index_select(out=)`` of each array straight into a ring of slot views,
  the floor any way of doing the batch pays;
- ``general way``: ``_host/worker.py``'s ``_run_task``: the plan's slice, ``fetch``, the
  writer's views, ``pack`` (what every batch took before NOTE [ Gather lane ]);
- ``gather lane``: ``GatherLane.run`` (NOTE [ Gather lane ] in ``_host/lane.py``).

Each batch goes to the next of ``--slots`` slots, as a ring hands them out; the three ways
are checked to give the same batch first. Single-threaded and uncontended: it measures the
Python around the gather, not the hand-off between processes (``mainproc`` measures that).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import BatchSampler, RandomSampler, default_collate

from gpufeed._host import worker as worker_mod
from gpufeed._host.collate import unpack
from gpufeed._host.fetch import MapFetcher
from gpufeed._host.lane import GatherLane
from gpufeed._host.messages import Slot, Task
from gpufeed._host.writer import SlotWriter
from gpufeed._order.plan import make_plan
from gpufeed._sources.arrays import ArrayDataset
from gpufeed._tools.environment import environment
from gpufeed._tools.measure import one_intra_op_thread

from .workloads import tabular_data

__all__ = ["main", "measure"]

BATCH = 256


def measure(rows: int = 1_000_000, batches: int = 3000, slots: int = 256, repeats: int = 7
            ) -> dict[str, float]:
    """Microseconds per batch of each way, best of ``repeats`` (see the module docstring)."""
    data = tabular_data(rows, seed=0)
    dataset = ArrayDataset(data["x"], data["y"])
    fetcher = MapFetcher(dataset, auto_collation=True, collate_fn=default_collate)
    sampler = BatchSampler(RandomSampler(range(rows), generator=torch.Generator().manual_seed(0)),
                           BATCH, drop_last=True)
    fetcher.plan = plan = make_plan(sampler, shared=True)  # as a process worker gets it
    batches = min(batches, plan.n_batches)
    lane = GatherLane.make(fetcher.arrays)
    if lane is None:
        raise RuntimeError("gpufeed internal error: the tabular arrays take no gather lane")
    slot_bytes = 80 << 10
    region = torch.zeros(slots * slot_bytes, dtype=torch.uint8)
    writer = SlotWriter(region, shared_fallback=False)
    ring = [Slot(s, s * slot_bytes, slot_bytes) for s in range(slots)]
    tasks = [Task(k, True, None, ring[k % slots]) for k in range(batches)]
    sources = lane.sources
    outs = []  # the bare gather's destinations: the lane's own views of each slot
    for s in ring:
        kept = lane._carve(writer, s, BATCH)
        if kept is None:
            raise RuntimeError("gpufeed internal error: a tabular batch does not fit 80 KiB")
        outs.append(kept[0])

    def bare() -> None:
        for k in range(batches):
            idx = torch.from_numpy(plan.batch_array(k))
            for src, out in zip(sources, outs[k % slots], strict=True):
                torch.index_select(src, 0, idx, out=out)

    def general() -> None:
        for task in tasks:
            worker_mod._run_task(0, "w", fetcher, writer, task, 1, 0, [], None, _no_late)

    def laned() -> None:
        for task in tasks:
            lane.run(fetcher, task.batch, task.slot, writer)  # type: ignore[arg-type]

    _check(fetcher, lane, writer, region, tasks[:8])
    ways: dict[str, Callable[[], None]] = {
        "bare gather": bare, "general way": general, "gather lane": laned}
    best = dict.fromkeys(ways, float("inf"))
    one_intra_op_thread()  # as in a worker (NOTE [ Measuring honestly ] (2))
    for _ in range(repeats):
        for name, way in ways.items():
            t0 = time.perf_counter()
            way()
            best[name] = min(best[name], (time.perf_counter() - t0) / batches * 1e6)
    return best


def _no_late(gen: int, batch: int) -> None:
    raise RuntimeError("gpufeed internal error: a task bound at dispatch asked for its slot")


def _check(fetcher: Any, lane: GatherLane, writer: SlotWriter, region: torch.Tensor,
           tasks: Sequence[Task]) -> None:
    for task in tasks:
        slot = task.slot
        assert slot is not None
        bytes_ = region.numpy()[slot.offset:]
        general = worker_mod._run_task(0, "w", fetcher, writer, task, 1, 0, [], None, _no_late)
        expected = [t.clone() for t in unpack(general.packed, bytes_)]  # type: ignore[union-attr]
        ours = lane.run(fetcher, task.batch, slot, writer)
        if ours is None or not all(torch.equal(a, b) for a, b in zip(
                unpack(ours.packed, bytes_), expected, strict=True)):
            raise RuntimeError(f"gpufeed internal error: the lane's batch {task.batch} differs")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lane", description=__doc__)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--batches", type=int, default=3000)
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args(argv)
    best = measure(args.rows, args.batches, args.slots, args.repeats)
    floor = best["bare gather"]
    for name, us in best.items():
        print(f"{name:12s} {us:6.2f} us per batch, {us - floor:+6.2f} beside the bare gather")
    if args.json is not None:
        doc = {"environment": environment(), "settings": vars(args) | {"json": str(args.json)},
               "us_per_batch_best": best}
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
