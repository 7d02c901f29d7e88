"""The cost of gpufeed's per-sample random state: ``python -m bench.seeding``.

Three measurements, each the median of ``--repeats`` runs:

1. global seeding (process workers, ``num_workers=0``): a ``seeded`` fetch against a plain list
   comprehension over a trivial ``__getitem__``: microseconds per sample (hash + three
   re-seeds) and per batch (state save/restore);
2. the per-sample generators: microseconds a sample pays for its scope (every sample) and for
   each generator it asks for (``sample_generator``, ``sample_rng``, ``sample_random``);
3. thread workers: samples/s of ``gpufeed.DataLoader`` with 4 thread workers on a dataset that
   sleeps 5 ms a sample (the GIL free, as in decoding or I/O) and makes one draw, from
   ``sample_generator()`` or from torch's global generator, with and without ``seed=``. The
   ceiling is ``workers / 5 ms`` = 800 samples/s.

``--json FILE`` writes the figures with the environment. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from gpufeed._loader import DataLoader
from gpufeed._order.sample_rng import SampleScope, sample_generator, sample_random, sample_rng
from gpufeed._order.seeding import seeded
from gpufeed._tools.environment import environment

__all__ = ["main", "measure", "measure_generators", "measure_threads"]


def _get(index: int) -> int:
    return index


def _timed(fn: Callable[[], Any], repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def measure(samples: int = 10_000, batch: int = 64, repeats: int = 5) -> dict[str, float]:
    """Global seeding: microseconds per sample and per batch."""
    indices = list(range(batch))
    batches = samples // batch

    def plain() -> None:
        for _ in range(batches):
            [_get(i) for i in indices]

    def seeded_fetch() -> None:
        for _ in range(batches):
            with seeded(7, 1) as reseed:  # as a seeded fetch does
                for i in indices:
                    reseed(i)
                    _get(i)

    def per_batch() -> None:
        for _ in range(batches):
            with seeded(7, 1):
                pass

    base, full, fixed = (_timed(f, repeats) for f in (plain, seeded_fetch, per_batch))
    return {"per_sample_us": (full - base - fixed) / (batches * batch) * 1e6,
            "per_batch_us": fixed / batches * 1e6}


def measure_generators(samples: int = 10_000, repeats: int = 5) -> dict[str, float]:
    """Per-sample generators: microseconds per sample for the scope and for each generator."""
    scope = SampleScope()

    def loop(draw: Callable[[], object] | None) -> Callable[[], None]:
        def run() -> None:
            scope.open(7, 1)
            try:
                for i in range(samples):
                    scope.at(i)
                    if draw is not None:
                        draw()
            finally:
                scope.close()
        return run

    def plain() -> None:
        for i in range(samples):
            _get(i)

    base = _timed(plain, repeats)
    bare = _timed(loop(None), repeats)
    out = {"scope_us": (bare - base) / samples * 1e6}
    for name, fn in (("sample_generator_us", sample_generator), ("sample_rng_us", sample_rng),
                     ("sample_random_us", sample_random)):
        out[name] = (_timed(loop(fn), repeats) - bare) / samples * 1e6
    return out


class _Sleepy(Dataset[torch.Tensor]):
    """``seconds`` of sleep a sample, then one draw (per-sample generator or global)."""

    def __init__(self, n: int, seconds: float, draw: str) -> None:
        self.n, self.seconds, self.draw = n, seconds, draw

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.seconds)
        gen = sample_generator() if self.draw == "sample_generator" else None
        return torch.rand(2, generator=gen)


def measure_threads(samples: int = 400, workers: int = 4, seconds: float = 0.005,
                    repeats: int = 3) -> list[dict[str, Any]]:
    """Samples/s of thread workers on a sleeping dataset, per draw kind and seed."""
    rows = []
    for draw in ("sample_generator", "global"):
        for seed in (None, 0):
            dataset = _Sleepy(samples, seconds, draw)

            def run(dataset: _Sleepy = dataset, seed: int | None = seed) -> None:
                loader = DataLoader(dataset, batch_size=4, num_workers=workers,
                                    worker_type="thread", seed=seed)
                for _ in loader:
                    pass

            with warnings.catch_warnings():  # the global draws warn: measured all the same
                warnings.simplefilter("ignore")
                elapsed = _timed(run, repeats)
            rows.append({"draw": draw, "seed": seed, "samples_per_s": samples / elapsed,
                         "ceiling": workers / seconds})
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.seeding [--samples N] [--batch B] [--repeats R]
    [--json FILE]``."""
    p = argparse.ArgumentParser(prog="python -m bench.seeding",
                                description="The cost of gpufeed's per-sample random state.")
    p.add_argument("--samples", type=int, default=10_000, help="samples per run (10000)")
    p.add_argument("--batch", type=int, default=64, help="samples per batch (64)")
    p.add_argument("--repeats", type=int, default=5, help="runs of each loop; the median (5)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args(argv)
    if args.samples < args.batch or min(args.batch, args.repeats) < 1:
        p.error(f"need --samples >= --batch >= 1 and --repeats >= 1, got --samples "
                f"{args.samples} --batch {args.batch} --repeats {args.repeats}")
    glob = measure(args.samples, args.batch, args.repeats)
    print(f"global seeding: {glob['per_sample_us']:.1f} us per sample, "
          f"{glob['per_batch_us']:.1f} us per batch (save/restore)")
    gens = measure_generators(args.samples, args.repeats)
    print("per-sample generators: scope {scope_us:.2f} us per sample; when asked for: "
          "sample_generator {sample_generator_us:.1f} us, sample_rng {sample_rng_us:.1f} us, "
          "sample_random {sample_random_us:.1f} us".format(**gens))
    threads = measure_threads(repeats=min(args.repeats, 3))
    for row in threads:
        print(f"4 thread workers, 5 ms/sample, {row['draw']} draw, seed={row['seed']}: "
              f"{row['samples_per_s']:.0f} samples/s (ceiling {row['ceiling']:.0f})")
    if args.json is not None:
        args.json.write_text(json.dumps({"environment": environment(), "global_seeding": glob,
                                         "generators": gens, "thread_workers": threads},
                                        indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
