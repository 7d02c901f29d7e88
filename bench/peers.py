"""Per-sample loading side by side with the peers: the stock loader, gpufeed's process and
thread workers, torchdata.nodes' thread ``ParallelMapper`` and SPDL's thread pipeline.

The workload: a uint8 memory map of ``count`` 3 x 256 x 256 images on disk; each sample is a
random 224 x 224 crop with a random horizontal flip, copied out of the map by a per-sample
``__getitem__`` (numpy, as most datasets written for the stock loader do), with its label;
batches of 64 collated by ``default_collate``. Every side runs 2 workers (threads or processes)
in a new interpreter, reads ``--samples`` samples after 3 warm-up batches, and reports
samples/s; the sides alternate in every round, and the figures are medians (min-max) over the
rounds.

Run from a checkout::

    python -m bench.peers --rounds 3

Sides whose library is not installed are left out and named in the results.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from gpufeed._tools.repeat import _tree_cpu_s

from .summary import paragraph, shared_machine_note

SIDE, CROP, BATCH, WORKERS, WARMUP = 256, 224, 64, 2, 3
SIDES = ("stock-process", "gpufeed-process", "gpufeed-thread", "nodes-thread", "spdl-thread")
LABELS = {
    "stock-process": "stock loader, process workers",
    "gpufeed-process": "gpufeed, process workers",
    "gpufeed-thread": "gpufeed, thread workers",
    "nodes-thread": "torchdata.nodes, thread ParallelMapper",
    "spdl-thread": "SPDL pipeline, threads",
}
RESULTS = Path(__file__).resolve().parent / "results"


class RandomCrops(Dataset[tuple[torch.Tensor, int]]):
    """``count`` images in a uint8 memory map (``path``), each sample a random ``crop``
    square, flipped left-right at random, from numpy's generator seeded by the index (the same
    crops for every side). The map is opened lazily in each process."""

    def __init__(self, path: str, count: int, length: int) -> None:
        self.path, self.count, self.length = path, count, length
        self._map: np.ndarray | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_map": None}

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        images = self._map
        if images is None:
            images = self._map = np.memmap(self.path, dtype=np.uint8, mode="r",
                                           shape=(self.count, 3, SIDE, SIDE))
        rng = np.random.default_rng(i)
        top, left = rng.integers(0, SIDE - CROP + 1, 2)
        crop = images[i % self.count, :, top:top + CROP, left:left + CROP]
        if rng.random() < 0.5:
            crop = crop[:, :, ::-1]
        return torch.from_numpy(np.ascontiguousarray(crop)), i % 10


def write_images(path: Path, count: int) -> None:
    """The image file: ``count`` random uint8 3 x SIDE x SIDE images (kept between runs)."""
    if path.exists() and path.stat().st_size == count * 3 * SIDE * SIDE:
        return
    tmp = path.with_suffix(".tmp")
    out = np.memmap(tmp, dtype=np.uint8, mode="w+", shape=(count, 3, SIDE, SIDE))
    rng = np.random.default_rng(0)
    for start in range(0, count, 256):
        stop = min(count, start + 256)
        out[start:stop] = rng.integers(0, 256, (stop - start, 3, SIDE, SIDE), dtype=np.uint8)
    out.flush()
    del out
    os.replace(tmp, path)


def _batches(side: str, dataset: RandomCrops) -> Iterator[Any]:
    """The batches of one epoch (shuffled) on ``side``."""
    sampler = torch.utils.data.RandomSampler(dataset, generator=torch.Generator().manual_seed(0))
    if side == "stock-process":
        yield from DataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=WORKERS)
    elif side.startswith("gpufeed"):
        import gpufeed

        worker_type: Any = side.split("-")[1]
        yield from gpufeed.DataLoader(dataset, batch_size=BATCH, sampler=sampler,
                                      num_workers=WORKERS, worker_type=worker_type)
    elif side == "nodes-thread":
        from torchdata import nodes

        node: Any = nodes.SamplerWrapper(sampler)
        node = nodes.ParallelMapper(node, map_fn=dataset.__getitem__, num_workers=WORKERS,
                                    method="thread")
        node = nodes.Batcher(node, batch_size=BATCH, drop_last=False)
        node = nodes.Mapper(node, default_collate)
        node = nodes.Prefetcher(node, prefetch_factor=2 * WORKERS)
        yield from nodes.Loader(node)
    elif side == "spdl-thread":
        from spdl.pipeline import PipelineBuilder

        builder: Any = PipelineBuilder()
        pipeline = (builder.add_source(iter(sampler))
                    .pipe(dataset.__getitem__, concurrency=WORKERS, output_order="input")
                    .aggregate(BATCH).pipe(default_collate).add_sink(2 * WORKERS)
                    .build(num_threads=WORKERS))
        with pipeline.auto_stop():
            yield from pipeline.get_iterator()
    else:
        raise ValueError(f"unknown side {side!r}; one of {', '.join(SIDES)}")


def run_side(side: str, path: str, count: int, samples: int) -> dict[str, Any]:
    """One side's run in this process: samples/s after the warm-up batches, and the CPU
    seconds per sample of the process and its workers over the same window (taken at the last
    batch, while the workers still run)."""
    torch.set_num_threads(1)
    dataset = RandomCrops(path, count, samples + WARMUP * BATCH)
    last = len(dataset) // BATCH + (len(dataset) % BATCH > 0) - 1
    n, start, cpu0, cpu1, end = 0, 0.0, 0.0, 0.0, 0.0
    total = 0
    for k, (images, _labels) in enumerate(_batches(side, dataset)):
        total += images.shape[0]
        if k == WARMUP - 1:
            start, cpu0 = time.perf_counter(), _tree_cpu_s()
        elif k >= WARMUP:
            n += images.shape[0]
        if k == last:
            end, cpu1 = time.perf_counter(), _tree_cpu_s()
    if total != len(dataset):
        raise RuntimeError(f"{side}: {total} samples delivered, {len(dataset)} expected")
    elapsed = end - start
    return {"side": side, "samples": n, "seconds": elapsed, "rate": n / elapsed,
            "cpu_us": 1e6 * (cpu1 - cpu0) / n}


def available(side: str) -> str | None:
    """Why ``side`` cannot run here, or None."""
    module = {"nodes-thread": "torchdata.nodes", "spdl-thread": "spdl.pipeline"}.get(side)
    if module is None:
        return None
    try:
        __import__(module)
    except ImportError as exc:
        return f"{module} is not installed ({exc})"
    return None


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _fmt(s: dict[str, float], spec: str = ",.0f", unit: str = "") -> str:
    return f"{s['median']:{spec}}{unit} ({s['min']:{spec}}-{s['max']:{spec}}{unit})"


def markdown(doc: dict[str, Any], env_line: str) -> str:
    lines = [
        "# Per-sample loading side by side with the peers",
        "",
        env_line,
        "",
        f"`{doc['command']}`: {doc['count']:,} uint8 3x{SIDE}x{SIDE} images in a memory map, "
        f"each sample a random {CROP}x{CROP} crop with a random horizontal flip copied out by "
        f"a per-sample `__getitem__`, batch {BATCH}, {WORKERS} workers, {doc['samples']:,} "
        f"samples timed after {WARMUP} warm-up batches; every run in a new interpreter, the "
        f"sides alternating in each of {doc['rounds']} rounds; medians (min-max) over the "
        "rounds, ratios to the stock loader taken round by round.",
        "",
        *paragraph(shared_machine_note(doc["environment"])),
        "CPU us per sample: the CPU time of the process's threads and its worker processes "
        "over the timed window, per sample (less sensitive to a shared machine than the rate).",
        "",
        "| side | samples/s | vs stock | CPU us per sample |",
        "| --- | ---: | ---: | ---: |",
    ]
    for side in doc["sides"]:
        r = doc["results"][side]
        vs_stock = _fmt(r["vs_stock"], ".2f", "x") if "vs_stock" in r else "-"
        lines.append(f"| {LABELS[side]} | {_fmt(r['rate'])} | {vs_stock} | {_fmt(r['cpu_us'])} |")
    if "thread_vs_nodes" in doc:
        lines += ["", "gpufeed's thread workers over torchdata.nodes' thread ParallelMapper, "
                  f"round by round: {_fmt(doc['thread_vs_nodes'], '.2f', 'x')} the samples/s, "
                  f"{_fmt(doc['thread_cpu_vs_nodes'], '.2f', 'x')} the CPU per sample."]
    for side, why in doc["left_out"].items():
        lines += ["", f"Left out: {LABELS[side]}: {why}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--count", type=int, default=2048, help="images in the file")
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "gpufeed-bench"))
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--run-side", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    path = Path(args.cache) / f"peers-{args.count}-{SIDE}.u8"
    if args.run_side:
        print(json.dumps(run_side(args.run_side, str(path), args.count, args.samples)))
        return

    from gpufeed._tools.environment import environment

    from .summary import environment_line, write_documents

    env = environment()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_images(path, args.count)
    sides, left_out = [], {}
    for side in args.sides.split(","):
        why = available(side)
        if why is None:
            sides.append(side)
        else:
            left_out[side] = why
    rates: dict[str, list[float]] = {side: [] for side in sides}
    cpus: dict[str, list[float]] = {side: [] for side in sides}
    for r in range(args.rounds):
        order = sides if r % 2 == 0 else sides[::-1]
        for side in order:
            out = subprocess.run(
                [sys.executable, "-m", "bench.peers", "--run-side", side, "--count",
                 str(args.count), "--samples", str(args.samples), "--cache", args.cache],
                check=True, capture_output=True, text=True)
            run = json.loads(out.stdout.strip().splitlines()[-1])
            rates[side].append(run["rate"])
            cpus[side].append(run["cpu_us"])
            print(f"round {r + 1}: {side:16s} {run['rate']:8,.0f} samples/s, "
                  f"{run['cpu_us']:6.0f} us CPU per sample", flush=True)
    results: dict[str, Any] = {}
    for side in sides:
        entry: dict[str, Any] = {"rates": rates[side], "rate": _summary(rates[side]),
                                 "cpus_us": cpus[side], "cpu_us": _summary(cpus[side])}
        if "stock-process" in rates:
            stock = rates["stock-process"]
            entry["vs_stock"] = _summary([a / b for a, b in zip(rates[side], stock, strict=True)])
        results[side] = entry
    argv_text = " ".join(argv if argv is not None else sys.argv[1:])
    doc: dict[str, Any] = {
        "benchmark": "peers", "environment": env,
        "command": f"python -m bench.peers {argv_text}".strip(),
        "rounds": args.rounds, "samples": args.samples, "count": args.count,
        "sides": sides, "left_out": left_out, "results": results,
    }
    if "gpufeed-thread" in rates and "nodes-thread" in rates:
        doc["thread_vs_nodes"] = _summary(
            [a / b for a, b in zip(rates["gpufeed-thread"], rates["nodes-thread"], strict=True)])
        doc["thread_cpu_vs_nodes"] = _summary(
            [a / b for a, b in zip(cpus["gpufeed-thread"], cpus["nodes-thread"], strict=True)])
    write_documents(doc, Path(args.out), "peers", markdown(doc, environment_line(env)))


if __name__ == "__main__":
    main()

__all__ = ["RandomCrops", "main", "run_side", "write_images"]
