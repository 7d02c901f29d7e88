"""``python -m bench shards``: JPEGs in tar shards, gpufeed against webdataset.

The data-source benchmark's 2,000 photo-like 500x375 JPEGs (~110 KB, ``photos.py``) written
once as 8 webdataset shards (``<key>.jpg`` and ``<key>.cls``, 250 samples, ~28 MB each);
random-resized crop 224 and flip, batch 64, ``--num-workers`` (2), one epoch a run.

- ``stock``: what users stream today: ``webdataset.WebDataset`` (shards shuffled, split by
  worker), a 1,000-sample shuffle buffer, Pillow's decode, crop and resize (``photos.py``'s
  ``pillow_sample``, as the data-source benchmark's stock side) under torch's ``DataLoader``.
- ``gpufeed loader, webdataset``: the same pipeline under ``gpufeed.DataLoader``.
- ``gpufeed ImageShards``: the shards indexed (NOTE [ Tar shards ]), process and thread workers,
  ``shuffle=True, seed=0`` (a shuffle of every sample, which the stream's buffer is not).
- ``no-loader ceiling``: ``ImageShards``' batches fetched by bare forked processes.

Also the time to build the dataset (the index of every shard, against ``ImageFolder``'s scan of
the same images as files), median of the rounds. Results: ``shards.json`` and ``shards.md``.
"""

from __future__ import annotations

import io
import os
import statistics
import sys
import tarfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader as StockLoader

import gpufeed

from .photos import mean_file_bytes, photo_set, pillow_sample
from .sources import (
    Ceiling,
    environment,
    finish,
    parser,
    prepare,
    render_markdown,
    run_sides,
)

SHARDS = 8


def write_shards(root: Path, out: Path, shards: int) -> list[str]:
    """``root``'s images (ImageFolder's order) as ``shards`` webdataset shards, built once."""
    folder = gpufeed.sources.ImageFolder(root, size=8)
    done = out / ".done"
    paths = [str(out / f"train-{k:04d}.tar") for k in range(shards)]
    if done.exists():
        return paths
    out.mkdir(parents=True, exist_ok=True)
    for k, chunk in enumerate(np.array_split(np.arange(len(folder)), shards)):
        with tarfile.open(paths[k], "w", format=tarfile.USTAR_FORMAT) as tf:
            for i in chunk.tolist():
                for ext, data in (("jpg", Path(folder.path(i)).read_bytes()),
                                  ("cls", str(int(folder.targets[i])).encode())):
                    info = tarfile.TarInfo(f"{i:07d}.{ext}")
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
    done.touch()
    return paths


def _webdataset_sample(sample: dict[str, Any], size: int) -> tuple[torch.Tensor, int]:
    return pillow_sample(io.BytesIO(sample["jpg"]), size, True), int(sample["cls"])


def webdataset_pipeline(paths: list[str], size: int) -> Any:
    """Shards shuffled and split by worker, a 1,000-sample buffer, Pillow per sample."""
    import webdataset as wds

    return (wds.WebDataset(paths, shardshuffle=len(paths), seed=0, empty_check=False,
                           workersplitter=wds.split_by_worker)
            .shuffle(1000).map(partial(_webdataset_sample, size=size)))


def _build(quick: bool, cache: Path, nw: int) -> tuple[dict[str, Any], dict[str, Any]]:
    hw, count, size, bs = ((375, 500), 2000, 224, 64) if not quick else ((48, 64), 64, 32, 8)
    root = photo_set(cache, "jpeg-rrc", count, hw)
    paths = write_shards(root, cache / f"shards-{root.name}-{SHARDS}", SHARDS)
    ds = gpufeed.sources.ImageShards(paths, size=size)
    kw: dict[str, Any] = dict(batch_size=bs, num_workers=nw)
    sides: dict[str, Any] = {
        "stock": lambda: StockLoader(webdataset_pipeline(paths, size), **kw),
        "gpufeed loader, webdataset": lambda: gpufeed.DataLoader(
            webdataset_pipeline(paths, size), **kw),
        "gpufeed ImageShards (process)": lambda: gpufeed.DataLoader(
            ds, shuffle=True, seed=0, **kw),
        "gpufeed ImageShards (thread)": lambda: gpufeed.DataLoader(
            ds, shuffle=True, seed=0, worker_type="thread", **kw),
    }
    order = np.random.default_rng(0).permutation(len(ds)).tolist()
    sides["no-loader ceiling: ImageShards' work"] = Ceiling(
        partial(ds.gpufeed_batch, seed=0, epoch=0, alloc=None),
        [order[k:k + bs] for k in range(0, len(order), bs)], nw)
    goals = {"ratio": 1.0, "pss": 1.05,
             "file_bytes": mean_file_bytes(root), "root": root, "paths": paths, "size": size}
    return sides, goals


def build_times(root: Path, paths: list[str], size: int, repeats: int) -> dict[str, Any]:
    """Seconds to build ``ImageShards`` over ``paths`` and ``ImageFolder`` over ``root``."""
    times: dict[str, list[float]] = {"ImageShards": [], "ImageFolder": []}
    for _ in range(repeats):
        for name, make in (("ImageShards", lambda: gpufeed.sources.ImageShards(paths, size=size)),
                           ("ImageFolder", lambda: gpufeed.sources.ImageFolder(root, size=size))):
            t = time.perf_counter()
            n = len(make())
            times[name].append(time.perf_counter() - t)
    shard_bytes = sum(os.path.getsize(p) for p in paths)
    return {"samples": n, "shards": len(paths), "shard_bytes": shard_bytes,
            **{f"{k}_s": statistics.median(v) for k, v in times.items()}}


def render(doc: dict[str, Any]) -> str:
    text = render_markdown(doc).replace("# gpufeed data-source benchmark",
                                        "# gpufeed tar-shard benchmark", 1)
    b = doc["build"]
    return text + (
        f"\nBuilding the dataset (median of {doc['settings']['repeats']}): `ImageShards` over "
        f"{b['shards']} shards ({b['shard_bytes'] / 2**20:.0f} MiB, {b['samples']:,} samples) "
        f"{1e3 * b['ImageShards_s']:.1f} ms ({1e6 * b['ImageShards_s'] / b['samples']:.1f} us "
        f"a sample, headers read, page cache warm); `ImageFolder` over the same images as files "
        f"{1e3 * b['ImageFolder_s']:.1f} ms.\n\nThe stock side and `gpufeed loader, "
        "webdataset` read each shard as a stream through a 1,000-sample shuffle buffer; "
        "`ImageShards` shuffles every sample (the sampler's order, exact resume).\n")


def main(argv: list[str] | None = None) -> int:
    args = parser("python -m bench shards",
                  "JPEGs in tar shards: gpufeed vs webdataset").parse_args(argv)
    cache, repeats = prepare(args)
    env = environment()  # at the start, as the other benchmarks record it
    sides, goals = _build(args.quick, cache, args.num_workers)
    workload = run_sides("jpeg-rrc-shards", sides, goals, repeats=repeats, quick=args.quick,
                         whole_epoch=True)
    doc: dict[str, Any] = {
        "environment": env,
        "settings": {"num_workers": args.num_workers, "repeats": repeats, "quick": args.quick,
                     "shards": SHARDS},
        "workloads": [workload],
        "build": build_times(goals["root"], goals["paths"], goals["size"], repeats)}
    return finish(doc, args.out, "shards", render)


if __name__ == "__main__":
    sys.exit(main())
