"""Measure the cost of gpufeed's per-sample seeding: ``python tests/dist_seeding_cost.py``.

Times ``fetch_seeded`` against a plain list comprehension over a trivial ``__getitem__`` and
prints microseconds per sample (hash + three re-seeds) and per batch (state save/restore).
Median of 5 runs; run it on an otherwise idle machine.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from gpufeed._order.seeding import fetch_seeded, seeded


def _get(index: int) -> int:
    return index


def main(samples: int = 10_000, batch: int = 64, repeats: int = 5) -> None:
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

    def timed(fn: object) -> float:
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()  # type: ignore[operator]
            runs.append(time.perf_counter() - start)
        return statistics.median(runs)

    base, full, fixed = timed(plain), timed(seeded_fetch), timed(per_batch)
    per_batch_us = fixed / batches * 1e6
    per_sample_us = (full - base - fixed) / (batches * batch) * 1e6
    print(f"per sample: {per_sample_us:.1f} us   per batch (save/restore): {per_batch_us:.1f} us")
    print(f"batch of {batch}: {(full - base) / batches * 1e6 / batch:.1f} us per sample in all")


if __name__ == "__main__":
    main()
