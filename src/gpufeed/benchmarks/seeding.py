"""The cost of gpufeed's per-sample seeding: ``python -m gpufeed.benchmarks.seeding``.

Times ``fetch_seeded`` against a plain list comprehension over a trivial ``__getitem__`` and
prints microseconds per sample (hash + three re-seeds) and per batch (state save/restore).
Median of 5 runs; run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

from .._order.seeding import fetch_seeded, seeded

__all__ = ["main", "measure"]


def _get(index: int) -> int:
    return index


def measure(samples: int = 10_000, batch: int = 64, repeats: int = 5) -> None:
    """Time the three loops (median of ``repeats`` runs each) and print the costs."""
    indices = list(range(batch))
    batches = samples // batch

    def plain() -> None:
        for _ in range(batches):
            [_get(i) for i in indices]

    def seeded_fetch() -> None:
        for _ in range(batches):
            fetch_seeded(_get, indices, seed=7, epoch=1)

    def per_batch() -> None:
        for _ in range(batches):
            with seeded(7, 1):
                pass

    def timed(fn: Callable[[], None]) -> float:
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - start)
        return statistics.median(runs)

    base, full, fixed = timed(plain), timed(seeded_fetch), timed(per_batch)
    per_batch_us = fixed / batches * 1e6
    per_sample_us = (full - base - fixed) / (batches * batch) * 1e6
    print(f"per sample: {per_sample_us:.1f} us   per batch (save/restore): {per_batch_us:.1f} us")
    print(f"batch of {batch}: {(full - base) / batches * 1e6 / batch:.1f} us per sample in all")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gpufeed.benchmarks.seeding [--samples N] [--batch B] [--repeats R]``."""
    p = argparse.ArgumentParser(prog="python -m gpufeed.benchmarks.seeding",
                                description="The cost of gpufeed's per-sample seeding.")
    p.add_argument("--samples", type=int, default=10_000, help="samples per run (10000)")
    p.add_argument("--batch", type=int, default=64, help="samples per batch (64)")
    p.add_argument("--repeats", type=int, default=5, help="runs of each loop; the median (5)")
    args = p.parse_args(argv)
    if args.samples < args.batch or min(args.batch, args.repeats) < 1:
        p.error(f"need --samples >= --batch >= 1 and --repeats >= 1, got --samples "
                f"{args.samples} --batch {args.batch} --repeats {args.repeats}")
    measure(args.samples, args.batch, args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
