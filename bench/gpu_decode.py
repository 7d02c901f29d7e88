"""GPU JPEG decode benchmark: ``python -m bench.gpu_decode [--out DIR]`` from a checkout.

Images per second of random-resized-crop 224 batches (uint8, on the GPU at the end of each
step), three sides in the same run, alternating, on the data-source benchmark's photo-like
500x375 JPEGs (~110 KB, quality 90, as ImageNet's; ``bench.photos``):

    gpu           gpufeed.DataLoader(ImageFolder(decode="gpu"), device="cuda"): workers ship
                  the files' bytes and crop boxes, the device stage decodes with nvImageCodec
    cpu           gpufeed.DataLoader(ImageFolder(), device="cuda"): the workers decode
    stock-pillow  torch's DataLoader over a per-sample Pillow dataset (open, convert, RRC with
                  a bilinear resize, flip), pin_memory=True, then .to("cuda", non_blocking=True)

each with the same ``--workers`` (default: every usable core), and, for each, the CPU cores it
leaves idle: usable cores minus the CPU seconds the whole process tree used per second of the
epoch (psutil). Every side is warmed up first (the files read once: page cache), then
``--rounds`` epochs per side, the side order rotating each round; the medians and the spread
(min..max) are reported. It also measures the pixels: the GPU path's batches against the CPU
path's for the same crop boxes (``dct_scale=False``), the distribution of the absolute
differences (mean, p50, p99, max). Results: ``<out>/gpu_decode.json`` and ``.md``. Without
CUDA or without nvImageCodec it says so and exits with status 0, writing nothing
(``--cpu-check`` runs its logic on the CPU with tiny sizes, for the tests).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import psutil
import torch

import gpufeed
from bench.photos import mean_file_bytes, photo_set
from bench.sources import PillowFolder
from gpufeed._tools.environment import environment

from .summary import environment_line, write_documents

SCHEMA = "gpufeed-bench-gpu-decode/1"
SIZE = 224


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _tree_cpu_s() -> float:
    """CPU seconds (user + system) used so far by this process and its live children."""
    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _epoch(make: Callable[[], Iterable[Any]], device: str | None) -> tuple[int, float, float]:
    """(images, wall seconds, CPU seconds of the process tree) of one epoch of ``make()``'s
    batches, each summed on the device as a step would read it. The workers' start-up is
    outside the timed window (it starts at the first batch), and the CPU time is read after the
    last batch, before the workers exit (their time would leave the tree with them)."""
    loader: Any = make()
    n = len(loader)
    it = iter(loader)
    batch = next(it)
    cpu0, t0 = _tree_cpu_s(), time.perf_counter()
    images, acc = 0, None
    for _ in range(n - 1):
        batch = next(it)
        x = batch[0]
        if device is not None and x.device.type == "cpu":
            x = x.to(device, non_blocking=True)
        s = x.sum(dtype=torch.int64)
        acc = s if acc is None else acc + s
        images += x.shape[0]
    if device is not None and torch.cuda.is_available():
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - t0, _tree_cpu_s() - cpu0
    for _ in it:  # the end of the epoch: the workers exit
        pass
    return images, wall, cpu


Factory = Callable[[], Iterable[Any]]


def sides(root: Path, workers: int, batch: int, device: str | None) -> dict[str, Factory]:
    gpu = gpufeed.sources.ImageFolder(root, size=SIZE, decode="gpu")
    cpu = gpufeed.sources.ImageFolder(root, size=SIZE)
    files = [cpu.path(i) for i in range(len(cpu))]
    pil = PillowFolder(files, SIZE, resized=True)
    kw: dict[str, Any] = dict(batch_size=batch, shuffle=True, num_workers=workers)
    return {
        "gpu": lambda: gpufeed.DataLoader(gpu, seed=0, device=device, **kw),
        "cpu": lambda: gpufeed.DataLoader(cpu, seed=0, device=device, **kw),
        "stock-pillow": lambda: torch.utils.data.DataLoader(
            pil, pin_memory=device is not None, persistent_workers=False, **kw),
    }


def pixel_differences(root: Path, count: int, device: str | None) -> dict[str, float]:
    """The GPU path's images against the CPU path's, same boxes (full-scale decode)."""
    kw: dict[str, Any] = dict(size=SIZE, dct_scale=False)
    gpu_ds = gpufeed.sources.ImageFolder(root, decode="gpu", **kw)
    cpu_ds = gpufeed.sources.ImageFolder(root, **kw)
    n = -(-count // 64)
    got = [x.cpu() for x, _ in itertools.islice(
        gpufeed.DataLoader(gpu_ds, batch_size=64, seed=1, device=device), n)]
    want = [x for x, _ in itertools.islice(gpufeed.DataLoader(cpu_ds, batch_size=64, seed=1), n)]
    d = torch.cat([(g.int() - w.int()).abs().flatten() for g, w in zip(got, want, strict=True)])
    d = d.float()
    q = torch.quantile(d[:: max(1, d.numel() // 4_000_000)], torch.tensor([0.5, 0.99]))
    return {"images": sum(g.shape[0] for g in got), "mean": float(d.mean()),
            "p50": float(q[0]), "p99": float(q[1]), "max": float(d.max())}


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    device: str | None = "cuda"
    if args.cpu_check:
        device = None
    elif not torch.cuda.is_available():
        print("no CUDA device: GPU decode benchmark skipped")
        return None
    else:
        from gpufeed._device.decode import make_decoder

        try:
            decoder = make_decoder(torch.device("cuda", torch.cuda.current_device()))
        except (ImportError, RuntimeError) as exc:
            print(f"no GPU decoder ({exc}): GPU decode benchmark skipped")
            return None
        print(f"decoder: nvImageCodec {getattr(decoder, 'version', '?')}, regions: "
              f"{getattr(decoder, 'regions', '?') or 'none'}")
    env = environment()
    cache = Path(args.cache)
    hw = (375, 500) if not args.cpu_check else (60, 80)
    root = photo_set(cache, "gpu-decode", args.images, hw)
    made = sides(root, args.workers, args.batch_size, device)
    cores = _usable_cores()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in made}
    for make in made.values():  # warm-up: page cache, imports, the decoder's start
        _epoch(make, device)
    names = list(made)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            images, wall, cpu = _epoch(made[name], device)
            runs[name].append({"images_per_s": images / wall, "cores_busy": cpu / wall,
                               "cores_idle": cores - cpu / wall})
            print(f"round {r}: {name:13s} {images / wall:9.0f} images/s, "
                  f"{cpu / wall:5.1f} cores busy")
    summary = {}
    for name, rs in runs.items():
        ips = [x["images_per_s"] for x in rs]
        idle = [x["cores_idle"] for x in rs]
        summary[name] = {"images_per_s": statistics.median(ips), "spread": [min(ips), max(ips)],
                         "cores_idle": statistics.median(idle),
                         "cores_idle_spread": [min(idle), max(idle)], "runs": rs}
    pixels = pixel_differences(root, args.pixel_images, device)
    gpu_name = torch.cuda.get_device_name() if device is not None else None
    return {"schema": SCHEMA, "environment": env, "gpu": gpu_name,
            "cuda": torch.version.cuda, "config": {
                "images": args.images, "image_hw": list(hw), "batch_size": args.batch_size,
                "workers": args.workers, "rounds": args.rounds, "usable_cores": cores,
                "mean_file_bytes": mean_file_bytes(root)},
            "sides": summary, "pixels_gpu_vs_cpu": pixels}


def markdown(doc: dict[str, Any]) -> str:
    cfg, env = doc["config"], doc["environment"]
    lines = [
        "# GPU JPEG decode", "", environment_line(env), f"GPU: {doc['gpu']} (CUDA {doc['cuda']}).",
        "", f"{cfg['images']} photo-like JPEGs {cfg['image_hw'][1]}x{cfg['image_hw'][0]} "
        f"(mean {cfg['mean_file_bytes'] / 1000:.0f} KB), random-resized crop to {SIZE}, batches "
        f"of {cfg['batch_size']}, {cfg['workers']} workers each, {cfg['usable_cores']} usable "
        f"cores; median of {cfg['rounds']} epochs per side (sides alternating), min..max.", "",
        "| side | images/s | spread | cores idle | spread |", "| --- | ---: | --- | ---: | --- |"]
    for name, s in doc["sides"].items():
        lines.append(f"| {name} | {s['images_per_s']:.0f} | {s['spread'][0]:.0f}.."
                     f"{s['spread'][1]:.0f} | {s['cores_idle']:.1f} | "
                     f"{s['cores_idle_spread'][0]:.1f}..{s['cores_idle_spread'][1]:.1f} |")
    p = doc["pixels_gpu_vs_cpu"]
    lines += ["", f"Pixels, GPU path against the CPU path for the same crop boxes "
              f"({p['images']} images, dct_scale=False): mean {p['mean']:.2f}, median "
              f"{p['p50']:.0f}, p99 {p['p99']:.0f}, max {p['max']:.0f} levels.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_decode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--workers", type=int, default=_usable_cores())
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pixel-images", type=int, default=256)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "gpufeed-bench"))
    ap.add_argument("--cpu-check", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    doc = run(args)
    if doc is None:
        return 0
    out = Path(args.out)
    paths = write_documents(doc, out, "gpu_decode", markdown(doc))
    print(markdown(doc))
    print("wrote", ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
