"""Per-sample batches collated as their samples come, against collated at the end (NOTE
[ Streamed collation ] in ``_host/streaming.py``): ``python -m gpufeed.benchmarks.streaming``.

Three per-sample ``Dataset``s with the default ``collate_fn``, batch 64, ``--num-workers``
process workers, one epoch per run and a loop that only counts, the sides alternating in every
round (stock loader, gpufeed with ``streaming.ENABLED = False``, gpufeed):

- ``jpeg``: the CPU benchmark's jpeg workload (Pillow decode + resize to 3x224x224, ~2 ms a
  sample);
- ``pillow-crop``: the data-source benchmark's Pillow ``Dataset`` on its jpeg-crop photos
  (open, decode, random 224 crop, flip: ~0.6 ms a sample);
- ``image-array``: the CPU benchmark's image-array ``per-sample`` variant (a 3x192x192 crop of
  a memory map, ~0.1 ms a sample: quicker than ``STREAM_MIN_S``, so collated at the end on
  both gpufeed sides; it shows that rule).

Per side: samples/s after 3 batches, and the process tree's peak PSS with its heap (anon) and
shared-memory parts (``measure_loader``, a sample every 20 ms); ratios round by round (the
median of each round's ratio). Results: ``streaming.json`` and ``streaming.md`` in ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from .._host import streaming
from .._loader import DataLoader
from .._tools.measure import measure_loader
from .cpu import workload_variant
from .environment import environment, environment_line, write_documents
from .summary import paired_ratio

__all__ = ["SIDES", "WORKLOADS", "main", "run"]

SIDES = ("stock", "gpufeed, collated at the end", "gpufeed")
WORKLOADS = ("jpeg", "pillow-crop", "image-array")
MiB = 2**20


def _dataset(name: str, quick: bool) -> Any:
    if name == "pillow-crop":
        from .photos import photo_set
        from .sources import PillowFolder
        from .workloads import default_cache_dir

        root = photo_set(default_cache_dir(), "jpeg-crop", 64 if quick else 2000,
                         (48, 64) if quick else (256, 256))
        files = sorted(str(p) for p in root.rglob("*.jpg"))
        return PillowFolder(files, 32 if quick else 224, False)
    return workload_variant(name, "per-sample", quick=quick)[1].dataset


def run(name: str, side: str, dataset: Any, *, num_workers: int, quick: bool
        ) -> dict[str, Any]:
    """One epoch of ``dataset`` on ``side``: samples/s, peak PSS and its parts (MiB)."""
    torch.set_num_threads(1)
    cls: Callable[..., Any] = torch.utils.data.DataLoader if side == "stock" else DataLoader
    streaming.ENABLED = side == "gpufeed"
    try:
        m = measure_loader(lambda: cls(dataset, batch_size=8 if quick else 64, shuffle=True,
                                       num_workers=num_workers),
                           warmup_batches=1 if quick else 3, sample_held=False)
    finally:
        streaming.ENABLED = True
    return {"samples_per_s": m.samples_per_s, "peak_pss_mib": m.peak_pss_bytes / MiB,
            "peak_anon_mib": m.peak_pss_anon_bytes / MiB,
            "peak_shmem_mib": m.peak_pss_shmem_bytes / MiB}


def _med(runs: Sequence[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def render(env: dict[str, Any], args: argparse.Namespace,
           results: dict[str, dict[str, list[dict[str, Any]]]]) -> str:
    lines = [
        "# Per-sample batches collated as their samples come, against at the end", "",
        environment_line(env), "",
        f"`python -m gpufeed.benchmarks.streaming --rounds {args.rounds}`: "
        f"{args.num_workers} process workers, batch 64, one epoch per run, sides alternating "
        "in every round; medians over the rounds, ratios round by round",
        "(NOTE [ Streamed collation ] in `_host/streaming.py`).", "",
        "| workload | side | samples/s | vs stock | peak PSS MiB | vs stock | heap (anon) MiB "
        "| shared memory MiB |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, sides in results.items():
        stock = sides["stock"]
        for side in SIDES:
            runs = sides[side]
            rate = paired_ratio(runs, stock, "samples_per_s")
            pss = paired_ratio(runs, stock, "peak_pss_mib")
            lines.append(
                f"| {name} | {side} | {_med(runs, 'samples_per_s'):,.0f} | "
                f"{rate or 0:.3f}x | {_med(runs, 'peak_pss_mib'):,.0f} | {pss or 0:.3f}x | "
                f"{_med(runs, 'peak_anon_mib'):,.0f} | {_med(runs, 'peak_shmem_mib'):,.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpufeed.benchmarks.streaming",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--quick", action="store_true", help="tiny data (for tests)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    if args.rounds < 1 or args.num_workers < 1:
        p.error(f"--rounds {args.rounds} --num-workers {args.num_workers}: use --rounds >= 1 "
                "and --num-workers >= 1")
    env = environment()
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for name in args.workloads:
        dataset = _dataset(name, args.quick)
        sides: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
        for r in range(args.rounds):
            for side in SIDES[r % 3:] + SIDES[:r % 3]:
                sides[side].append(run(name, side, dataset, num_workers=args.num_workers,
                                       quick=args.quick))
            print(f"{name} round {r}: " + ", ".join(
                f"{s} {sides[s][-1]['samples_per_s']:,.0f} samples/s "
                f"{sides[s][-1]['peak_pss_mib']:,.0f} MiB" for s in SIDES), flush=True)
        results[name] = sides
    markdown = render(env, args, results)
    write_documents({"environment": env, "args": {k: str(v) for k, v in vars(args).items()},
                     "results": results}, args.out, "streaming", markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
