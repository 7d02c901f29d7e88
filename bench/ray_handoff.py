"""gpufeed over Ray Data, side by side: ``python -m bench.ray_handoff``.

Two measurements, sides alternating within one run on one simulated two-node Ray cluster
(``ray.cluster_utils.Cluster``): a head node, the trainer's, that gives Ray no CPU, and a
"far" node of one CPU whose raylet (and so every Ray worker it starts) is confined to the
machine's second core.

(a) The hand-off alone: a materialized dataset (blocks already in the object store, no Ray
    task runs), read by ``gpufeed.DataLoader(ds, batch_size=...)`` and by Ray's own
    ``ds.iter_torch_batches(batch_size=...)``: samples/s, and the trainer process's CPU time
    per batch (every thread of it: the loop, which copies gpufeed's batches, and Ray's
    prefetch threads count).
(b) Offload: JPEG decode + random-resized crop, the training process confined to one core
    (``os.sched_setaffinity``), as a GPU node's share of cores would be. ``local``: gpufeed's
    own process workers decode on that core (they inherit the affinity). ``ray``: gpufeed over
    Ray Data, ``map_batches`` decoding on the far node's core. Each batch then costs the loop
    ``--step-ms`` of CPU (a stand-in for the training step's own CPU work), on its core.
    The decode rate of one core (no loader) is measured too, for the scaling model.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

import gpufeed
from gpufeed._tools.environment import environment

from .summary import (
    environment_line,
    machine_shared,
    paragraph,
    shared_machine_note,
    write_documents,
)

OUT = 112  # side of a crop, pixels


def jpegs(count: int, side: int, seed: int = 0) -> list[bytes]:
    """``count`` JPEGs of ``side`` x ``side`` pixels (smooth noise, quality 90)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        small = rng.integers(0, 256, (side // 8, side // 8, 3), dtype=np.uint8)
        img = Image.fromarray(small).resize((side, side), Image.Resampling.BILINEAR)
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def decode_crop(data: bytes, seed: int) -> np.ndarray:
    """Decode a JPEG and take a random-resized crop of ``OUT`` x ``OUT`` (scale 0.25-1)."""
    import simplejpeg
    from PIL import Image

    img = simplejpeg.decode_jpeg(data, colorspace="RGB")
    rng = np.random.default_rng(seed)
    h, w = img.shape[:2]
    s = rng.uniform(0.25, 1.0)
    ch, cw = max(1, int(h * s ** 0.5)), max(1, int(w * s ** 0.5))
    y, x = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
    crop = Image.fromarray(img[y:y + ch, x:x + cw]).resize((OUT, OUT), Image.Resampling.BILINEAR)
    return np.asarray(crop)


class JpegSet(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """The local side's dataset: JPEG bytes in memory, decoded and cropped per sample."""

    def __init__(self, data: list[bytes]) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.from_numpy(decode_crop(self.data[i], i)), i


def decode_batch(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The Ray side's ``map_batches`` function: the same decode and crop per row."""
    imgs = np.stack([decode_crop(d, int(i)) for d, i in zip(batch["jpeg"], batch["i"],
                                                           strict=True)])
    return {"img": imgs, "i": batch["i"]}


def spin(ms: float) -> None:
    """Busy the calling thread for ``ms`` of CPU (the training step's own CPU work)."""
    if ms <= 0:
        return
    end = time.thread_time() + ms / 1000
    while time.thread_time() < end:
        pass


def timed(batches: Iterable[Any], rows: Callable[[Any], int], step_ms: float = 0.0
          ) -> dict[str, float]:
    """One pass: wall seconds, samples/s, and this process's CPU seconds per batch."""
    cpu0, t0 = time.process_time(), time.perf_counter()
    n = b = 0
    for batch in batches:
        n += rows(batch)
        b += 1
        spin(step_ms)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {"wall_s": wall, "samples_per_s": n / wall, "cpu_ms_per_batch": 1000 * cpu / b,
            "samples": n, "batches": b}


def alternate(sides: dict[str, Callable[[], dict[str, float]]], repeats: int
              ) -> dict[str, list[dict[str, float]]]:
    """Run each side once to warm up, then ``repeats`` rounds, the order flipped each round."""
    names = list(sides)
    for name in names:
        sides[name]()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            runs[name].append(sides[name]())
            print(f"  {name}: {runs[name][-1]}", flush=True)
    return runs


def summary(runs: list[dict[str, float]], key: str) -> dict[str, float]:
    values = [r[key] for r in runs]
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def start_cluster() -> tuple[Any, Any]:
    """Head node (the trainer's: no CPU for Ray) on core 0, far node (1 CPU) on core 1."""
    import ray
    from ray.cluster_utils import Cluster

    os.sched_setaffinity(0, {0})  # the head's processes share the trainer's core
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 0, "include_dashboard": False})
    os.sched_setaffinity(0, {1})  # the far node's raylet, and the workers it forks
    far = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    os.sched_setaffinity(0, {0, 1})
    ray.init(address=cluster.address, log_to_driver=False)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    return cluster, far


def handoff(args: argparse.Namespace) -> dict[str, Any]:
    """(a): a materialized dataset, gpufeed's loader against ``iter_torch_batches``."""
    import ray

    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.rows, 3, 32, 32), dtype=np.float32)
    y = np.arange(args.rows, dtype=np.int64)
    import pyarrow as pa
    from ray.data.extensions import ArrowTensorArray

    table = pa.table({"x": ArrowTensorArray.from_numpy(x), "y": y})
    ds = ray.data.from_arrow([table.slice(i, 1024) for i in range(0, args.rows, 1024)])
    ds = ds.materialize()
    loader = gpufeed.DataLoader(ds, batch_size=args.batch_size)  # kept across passes
    bs = args.batch_size

    def rows(batch: Any) -> int:
        return len(next(iter(batch.values())))

    sides = {
        "gpufeed": lambda: timed(loader, rows),
        "ray iter_torch_batches": lambda: timed(ds.iter_torch_batches(batch_size=bs), rows),
    }
    print(f"(a) hand-off: {args.rows} rows of 12 KB, batch {bs}", flush=True)
    runs = alternate(sides, args.repeats)
    return {"rows": args.rows, "row_bytes": 3 * 32 * 32 * 4 + 8, "batch_size": bs,
            "runs": runs,
            "samples_per_s": {k: summary(v, "samples_per_s") for k, v in runs.items()},
            "cpu_ms_per_batch": {k: summary(v, "cpu_ms_per_batch") for k, v in runs.items()}}


def offload(args: argparse.Namespace) -> dict[str, Any]:
    """(b): decode + crop on the trainer's core (gpufeed's workers) or the far node (Ray)."""
    import ray

    data = jpegs(args.images, args.side)
    ids = np.arange(len(data), dtype=np.int64)
    items = ray.data.from_numpy(ids).map_batches(
        lambda b: {"jpeg": np.array([data[i] for i in b["data"]], dtype=object),
                   "i": b["data"]}).materialize()  # bytes in the object store, as if read
    bs = args.image_batch
    os.sched_setaffinity(0, {0})  # the trainer's share: one core (workers inherit it)
    try:
        t0 = time.process_time()
        for i, d in enumerate(data[:100]):
            decode_crop(d, i)
        per_core = 100 / (time.process_time() - t0)

        def local(step_ms: float) -> dict[str, float]:
            loader = gpufeed.DataLoader(JpegSet(data), batch_size=bs,
                                        num_workers=args.workers)
            return timed(loader, lambda b: len(b[1]), step_ms)

        def remote(step_ms: float) -> dict[str, float]:
            ds = items.map_batches(decode_batch, batch_size=bs)
            return timed(gpufeed.DataLoader(ds, batch_size=bs), lambda b: len(b["i"]), step_ms)

        out: dict[str, Any] = {"images": len(data), "side": args.side, "crop": OUT,
                               "batch_size": bs, "local_workers": args.workers,
                               "decode_per_core_per_s": per_core, "by_step": {}}
        for step in args.step_ms:
            print(f"(b) offload: {len(data)} JPEGs {args.side}px, step {step} ms/batch",
                  flush=True)
            runs = alternate({
                "gpufeed workers on the trainer's core": partial(local, step),
                "gpufeed over Ray Data (far node's core)": partial(remote, step),
            }, args.repeats)
            rates = {k: summary(v, "samples_per_s") for k, v in runs.items()}
            a, b = (v["median"] for v in rates.values())
            out["by_step"][str(step)] = {"runs": runs, "samples_per_s": rates,
                                         "ratio_ray_over_local": b / a}
        return out
    finally:
        os.sched_setaffinity(0, {0, 1})


def markdown(doc: dict[str, Any]) -> str:
    env, a, b = doc["environment"], doc["handoff"], doc["offload"]
    lines = [
        "# gpufeed over Ray Data", "", environment_line(env) + f" Ray {doc['ray']}.", "",
        *paragraph(shared_machine_note(env)),
        "Command: `python -m bench.ray_handoff` " + " ".join(doc["argv"]), "",
        "Ray runs as a simulated two-node cluster: the trainer's node gives Ray no CPU, the "
        "other node has one CPU, its raylet and workers confined to core 1.", "",
        f"## (a) The hand-off alone ({a['rows']} rows of {a['row_bytes']} B, materialized, "
        f"batch {a['batch_size']})", "",
        "| side | samples/s median (min-max) | trainer CPU ms/batch median (min-max) |",
        "|---|---|---|",
    ]
    for k in a["samples_per_s"]:
        s, c = a["samples_per_s"][k], a["cpu_ms_per_batch"][k]
        lines.append(f"| {k} | {s['median']:,.0f} ({s['min']:,.0f}-{s['max']:,.0f}) | "
                     f"{c['median']:.2f} ({c['min']:.2f}-{c['max']:.2f}) |")
    g, r = (a["samples_per_s"][k]["median"] for k in a["samples_per_s"])
    gc_, rc = (a["cpu_ms_per_batch"][k]["median"] for k in a["cpu_ms_per_batch"])
    lines += ["", f"gpufeed / Ray: {g / r:.2f}x the samples/s, {gc_ / rc:.2f}x the trainer's CPU "
              "per batch (medians).", "",
              f"## (b) Offload: JPEG decode + random-resized crop ({b['images']} images "
              f"{b['side']}px to {b['crop']}px, batch {b['batch_size']})", "",
              "The training process is confined to core 0. `local`: gpufeed with "
              f"{b['local_workers']} process workers on that core. `ray`: gpufeed over Ray "
              "Data, `map_batches` on the far node's core. `step`: CPU the loop spends per "
              "batch on core 0 (the training step's own CPU work).", "",
              "| step ms/batch | side | samples/s median (min-max) | trainer CPU ms/batch "
              "median | ray / local |",
              "|---|---|---|---|---|"]
    for step, res in b["by_step"].items():
        for k, s in res["samples_per_s"].items():
            cpu = statistics.median(r["cpu_ms_per_batch"] for r in res["runs"][k])
            lines.append(f"| {step} | {k} | {s['median']:,.0f} ({s['min']:,.0f}-"
                         f"{s['max']:,.0f}) | {cpu:.1f} | {res['ratio_ray_over_local']:.2f}x |")
    per_core = b["decode_per_core_per_s"]
    lines += [
        "", f"One core decodes and crops {per_core:,.0f} images/s here (no loader).", "",
        "The trainer's CPU per batch counts the training process only (its threads: the "
        "loop, which copies gpufeed's batches, Ray's prefetch threads and, here, Ray Data's "
        "streaming executor, which runs in the driver: the trainer when it is the driver; "
        "under Ray Train it runs in the split coordinator instead). `local` workers' CPU is "
        "their own processes', on the same core.", "",
        "## The scaling model", "",
        "Each side decodes on one core, so with no step they run at about the same rate: the "
        "offload pays when the trainer's core has work of its own (the step, the H2D copies, "
        "the collective calls), which local decoding then competes with. Per batch, "
        "`local ~ decode + step` and `ray ~ max(decode / nodes, step + hand-off)`. A GPU that "
        "trains at `D` images/s needs `D / r` cores decoding at `r` images/s per core "
        f"(`r` = {per_core:,.0f} here for {b['side']}px JPEGs to {b['crop']}px; about 390 for "
        "ImageNet-sized images with libjpeg-turbo, pytorch/vision#8496). With `c` cores per "
        "GPU left after the loop's own, Ray Data on CPU nodes of `k` cores takes the rest: "
        "`CPU nodes per GPU = max(0, D / r - c) / k`; a GPU at 3,000 images/s needs about 8 "
        "cores of decoding.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--images", type=int, default=600)
    p.add_argument("--side", type=int, default=448)
    p.add_argument("--image-batch", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--step-ms", type=float, nargs="+", default=[0.0, 30.0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    p.add_argument("--render", type=Path, help="rewrite the Markdown from this JSON and stop")
    args = p.parse_args(argv)
    if args.render is not None:
        doc = json.loads(args.render.read_text())
        args.render.with_suffix(".md").write_text(markdown(doc))
        return
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs two usable cores (one for the trainer, one for Ray's node)")
    import ray

    torch.set_num_threads(1)
    env = environment()
    cluster, _ = start_cluster()
    try:
        doc = {"environment": env, "ray": ray.__version__,
               "argv": argv if argv is not None else sys.argv[1:],
               "handoff": handoff(args), "offload": offload(args),
               "machine_shared": machine_shared(env)}
    finally:
        ray.shutdown()
        cluster.shutdown()
    json_path, md_path = write_documents(doc, args.out, "ray", markdown(doc))
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
