"""``num_workers="auto"`` on thread workers the GIL holds back: what is lost, and when it says so.

``held_back`` in ``_host/auto_iter.py`` (and NOTE [ Autotuning decisions ]): auto never
changes the worker type; on thread workers that cannot scale it warns once
(``ThreadWorkersWarning``), naming ``worker_type="process"``. This measures, on a GIL-bound
dataset (pure-Python work per sample), the rate of ``num_workers="auto"`` on threads and on
processes and of a static count of each, sides alternating over rounds, and the batch at which
the warning came.

    python -m bench.autotune_threads [--rounds 3] [--seconds 4]

Results: ``bench/results/autotune_threads.md`` and ``.json`` (current figures only).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

import gpufeed
from gpufeed._tools.environment import environment
from gpufeed.errors import ThreadWorkersWarning

from .summary import environment_line, write_documents

LOOPS = 4000  # pure-Python iterations per sample: about 0.3 ms here, holding the GIL
BATCH = 8
STEP_S = 0.001


class PurePython(Dataset[torch.Tensor]):
    """Each sample runs ``LOOPS`` iterations of pure Python (the GIL held throughout)."""

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, i: int) -> torch.Tensor:
        s = 0
        for k in range(LOOPS):
            s += k * k % 7
        return torch.full((16,), float(i + s % 2))


CONFIGS: dict[str, dict[str, Any]] = {
    "auto, thread": dict(num_workers="auto", worker_type="thread"),
    "auto, process": dict(num_workers="auto", worker_type="process"),
    "2 threads": dict(num_workers=2, worker_type="thread"),
    "2 processes": dict(num_workers=2, worker_type="process"),
}


def one_run(kwargs: dict[str, Any], seconds: float) -> dict[str, Any]:
    """Iterate for ``seconds`` after 5 warm-up batches with a ``STEP_S`` step; the rate and
    the batch at which a ThreadWorkersWarning came (None: none)."""
    loader = gpufeed.DataLoader(PurePython(), batch_size=BATCH, **kwargs)
    warned_at = None
    n = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ThreadWorkersWarning)
        it = iter(loader)
        t0 = None
        for n, _ in enumerate(it, 1):
            time.sleep(STEP_S)
            if warned_at is None and any(issubclass(w.category, ThreadWorkersWarning)
                                         for w in caught):
                warned_at = n
            if n == 5:
                t0, start_n = time.perf_counter(), n
            if t0 is not None and time.perf_counter() - t0 >= seconds:
                break
        if t0 is None:
            raise RuntimeError(f"the loader gave {n} batches: too few to time (5 are warm-up)")
        rate = (n - start_n) * BATCH / (time.perf_counter() - t0)
        said = sum(issubclass(w.category, ThreadWorkersWarning) for w in caught)
        del it
    return {"samples_per_s": rate, "warned_at_batch": warned_at, "warnings": said,
            "workers_at_end": loader.num_workers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()
    env = environment()
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGS}
    for r in range(args.rounds):
        for name, kwargs in CONFIGS.items():  # sides alternate within each round
            runs[name].append(one_run(kwargs, args.seconds))
            print(f"round {r + 1} {name}: {runs[name][-1]}", flush=True)
    best = max(statistics.median(x["samples_per_s"] for x in v) for v in runs.values())
    rows = []
    for name, v in runs.items():
        rates = [x["samples_per_s"] for x in v]
        med = statistics.median(rates)
        rows.append({"config": name, "median": med, "lo": min(rates), "hi": max(rates),
                     "of_best": med / best, "warned_at": [x["warned_at_batch"] for x in v],
                     "warnings": [x["warnings"] for x in v],
                     "workers_at_end": [x["workers_at_end"] for x in v]})
    doc = {"environment": env, "rounds": args.rounds, "seconds": args.seconds,
           "loops": LOOPS, "batch_size": BATCH, "step_s": STEP_S, "rows": rows}
    lines = ["# num_workers='auto' on thread workers the GIL holds back", "",
             environment_line(env) + " The machine was shared with other jobs.", "",
             f"Pure-Python samples ({LOOPS:,} loop iterations each, the GIL held), batch "
             f"{BATCH}, a {STEP_S * 1e3:g} ms step; {args.rounds} rounds of {args.seconds:g} s "
             "per configuration, configurations alternating in each round.", "",
             "| configuration | samples/s median (range) | of the best | warning at batch "
             "(per round) | warnings per run | workers at the end |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['config']} | {row['median']:,.0f} ({row['lo']:,.0f}-"
                     f"{row['hi']:,.0f}) | {row['of_best']:.2f}x | {row['warned_at']} | "
                     f"{row['warnings']} | {row['workers_at_end']} |")
    write_documents(doc, Path(__file__).parent / "results", "autotune_threads",
                    "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
