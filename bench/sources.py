"""``python -m bench sources``: real data sources, gpufeed vs what users write today.

Workloads (issue 13's targets; ``--quick`` shrinks every size for tests):

- ``jpeg-crop``: 2,000 photo-like JPEGs 256x256 (~30 KB, ``photos.py``), random 224 crop +
  flip, batch 64. Stock: a per-sample Pillow ``Dataset``. gpufeed: ``ImageFolder(scale=None)``
  (process and thread workers; process workers also with ``memory_format=torch.channels_last``,
  the batch in the decoder's HWC layout), and gpufeed's loader alone on the Pillow ``Dataset``.
  Target 2x (the loader alone: 1.5x).
- ``jpeg-rrc``: 2,000 photo-like JPEGs 500x375 (~110 KB, as ImageNet's), random-resized crop
  224, batch 64. Target 2.2x. Both JPEG workloads: peak PSS at most 1.05x the stock loader's.
  The JPEG codec ``ImageFolder`` used (NOTE [ Decoding ]) is written in the environment; when
  it is libjpeg-turbo 3's region decode, the process loader also runs with simplejpeg's whole
  decode in the same rounds. The ``transform=`` rows add ``photos.flip_to_float`` to it (per
  sample: NOTE [ Image transforms ]).
- ``hf-datasets``: Hugging Face ``datasets``, 200k rows x 64 float32 + label, format torch,
  batch 256; the same dataset under both loaders. Target 3x.
- ``hdf5``: 20k x 3x64x64 uint8 + label, shuffled, batch 128. Stock: a per-sample h5py
  ``Dataset``. gpufeed: ``HDF5Dataset``. Target 3x.
- ``python-list``: 1M rows of 64 floats as Python lists + labels, and 2M strings; one epoch
  with process workers. Stock: the lists; gpufeed: the same dataset holding ``PackedList``\\ s.
  Target: PSS growth over the epoch at most 5% of the PSS at start.

Each (workload, side) runs ``--repeats`` times, gpufeed and stock alternating; the median rate
and its spread (min-max) are reported, shuffled with one seed. The JPEG workloads also run two
no-loader ceilings in the same rounds (NOTE [ No-loader ceiling ] in ``ceiling.py``): the
``ImageFolder`` batches (in both layouts), and the Pillow ``Dataset``'s samples collated, each
fetched by ``--num-workers`` bare forked processes with no loader. No loader doing that work on
these cores can go faster, so a ceiling's "vs stock" is the most any loader could reach there.
Results: ``sources.json`` and ``sources.md`` in ``--out``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader as StockLoader
from torch.utils.data import Dataset, default_collate

import gpufeed
from gpufeed._tools.environment import environment as shared_environment
from gpufeed._tools.measure import measure_loader, one_intra_op_thread

from .ceiling import measure_no_loader
from .cpu import directory, pss_growth_bytes
from .photos import flip_to_float, mean_file_bytes, photo_set, pillow_sample
from .summary import commit_label, paired_ratio, write_documents

WORKLOADS = ("jpeg-crop", "jpeg-rrc", "hf-datasets", "hdf5", "python-list")


@dataclass(frozen=True)
class Ceiling:
    """A side that is no loader: ``fetch`` over ``batches`` in ``processes`` bare forked
    processes (NOTE [ No-loader ceiling ] in ``ceiling.py``)."""

    fetch: Callable[[list[int]], Any]
    batches: list[list[int]]
    processes: int


Factory = Callable[[], Any] | Ceiling


# -- what users write today ------------------------------------------------------------------
class PillowFolder(Dataset[tuple[torch.Tensor, int]]):
    """A per-sample Pillow dataset: open, decode, crop (plain or random-resized), flip."""

    def __init__(self, files: Sequence[str], size: int, resized: bool) -> None:
        self.files, self.size, self.resized = gpufeed.sources.PackedList(list(files)), size, resized

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return pillow_sample(self.files[i], self.size, self.resized), 0


class H5PerSample(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A per-sample h5py dataset, opened lazily in each worker."""

    def __init__(self, path: str) -> None:
        self.path, self.f = path, None  # type: tuple[str, Any]
        import h5py

        with h5py.File(path, "r") as f:
            self.n = len(f["labels"])

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        import h5py

        if self.f is None:
            self.f = h5py.File(self.path, "r")
        return torch.from_numpy(self.f["images"][i]), torch.as_tensor(self.f["labels"][i])


class Rows(Dataset[Any]):
    """Rows of floats, captions and labels, kept in whatever containers it is given; sample
    ``i`` is (row ``i % len(rows)``, the caption's length, label ``i % len(rows)``)."""

    def __init__(self, rows: Any, captions: Any, labels: Any) -> None:
        self.rows, self.captions, self.labels = rows, captions, labels

    def __len__(self) -> int:
        return len(self.captions)

    def __getitem__(self, i: int) -> Any:
        j = i % len(self.rows)
        return torch.as_tensor(self.rows[j]), len(self.captions[i]), self.labels[j]


# -- data, built once in the cache -----------------------------------------------------------
def _h5(cache: Path, n: int, side: int) -> Path:
    import h5py

    path = cache / f"h5-{n}-{side}.h5"
    if not path.exists():
        rng = np.random.default_rng(0)
        tmp = path.with_suffix(".tmp")
        with h5py.File(tmp, "w") as f:
            f["images"] = rng.integers(0, 255, (n, 3, side, side), dtype=np.uint8)
            f["labels"] = rng.integers(0, 1000, n)
        tmp.rename(path)
    return path


# -- workloads: name -> (sides {side: factory}, target) --------------------------------------
def _build(name: str, quick: bool, cache: Path, nw: int) -> tuple[dict[str, Factory], Any]:
    kw: dict[str, Any] = dict(num_workers=nw, shuffle=True)
    bs = (lambda full: full) if not quick else (lambda full: 8)
    if name in ("jpeg-crop", "jpeg-rrc"):
        resized = name == "jpeg-rrc"
        hw = ((375, 500) if resized else (256, 256)) if not quick else (48, 64)
        count, size = (2000, 224) if not quick else (64, 32)
        root = photo_set(cache, name, count, hw)
        crops: dict[str, Any] = dict(size=size, crop="random",
                                     scale=(0.08, 1.0) if resized else None)
        folder = gpufeed.sources.ImageFolder(root, **crops)
        files = [folder.path(i) for i in range(len(folder))]
        pil = PillowFolder(files, size, resized)
        sides: dict[str, Factory] = {
            "stock": lambda: StockLoader(pil, batch_size=bs(64), **kw),
            "gpufeed ImageFolder (process)": lambda: gpufeed.DataLoader(
                folder, batch_size=bs(64), seed=0, **kw),
            "gpufeed ImageFolder (thread)": lambda: gpufeed.DataLoader(
                folder, batch_size=bs(64), seed=0, worker_type="thread", **kw),
        }
        last = gpufeed.sources.ImageFolder(root, **crops, memory_format=torch.channels_last)
        sides["gpufeed ImageFolder (process, channels_last)"] = lambda: gpufeed.DataLoader(
            last, batch_size=bs(64), seed=0, **kw)
        if folder.decoder != "simplejpeg":  # the fallback codec, in the same rounds
            whole = gpufeed.sources.ImageFolder(root, **crops, decoder="simplejpeg")
            sides["gpufeed ImageFolder (process, simplejpeg)"] = lambda: gpufeed.DataLoader(
                whole, batch_size=bs(64), seed=0, **kw)
        transformed = gpufeed.sources.ImageFolder(root, **crops, transform=flip_to_float)
        for kind in ("process", "thread"):
            sides[f"gpufeed ImageFolder ({kind}, transform=)"] = partial(
                gpufeed.DataLoader, transformed, batch_size=bs(64), seed=0, worker_type=kind, **kw)
        if not resized:
            sides["gpufeed loader, Pillow Dataset"] = lambda: gpufeed.DataLoader(
                pil, batch_size=bs(64), **kw)
        goals = {"ratio": 2.2 if resized else 2.0, "gpufeed loader, Pillow Dataset": 1.5,
                 "pss": 1.05, "file_bytes": mean_file_bytes(root)}
        if nw < 1:  # a ceiling is for workers: with none, the loaders run in this process
            return sides, goals
        order = np.random.default_rng(0).permutation(len(folder)).tolist()
        batches = [order[k:k + bs(64)] for k in range(0, len(order), bs(64))]
        sides["no-loader ceiling: ImageFolder's work"] = Ceiling(
            partial(folder.gpufeed_batch, seed=0, epoch=0, alloc=None), batches, nw)
        sides["no-loader ceiling: ImageFolder's work, channels_last"] = Ceiling(
            partial(last.gpufeed_batch, seed=0, epoch=0, alloc=None), batches, nw)
        sides["no-loader ceiling: Pillow Dataset's work"] = Ceiling(
            partial(_collated, pil), batches, nw)
        return sides, goals
    if name == "hf-datasets":
        import datasets

        n = 200_000 if not quick else 2_000
        rng = np.random.default_rng(0)
        table = {"x": list(rng.random((n, 64), dtype=np.float32)),
                 "label": rng.integers(0, 10, n).tolist()}
        ds = datasets.Dataset.from_dict(table).with_format("torch")
        return {"stock": lambda: StockLoader(ds, batch_size=bs(256), **kw),
                "gpufeed": lambda: gpufeed.DataLoader(ds, batch_size=bs(256), **kw)}, {"ratio": 3.0}
    if name == "hdf5":
        path = _h5(cache, 20_000 if not quick else 600, 64 if not quick else 16)
        h5 = gpufeed.sources.HDF5Dataset(path, ("images", "labels"))
        plain = H5PerSample(str(path))
        return {"stock": lambda: StockLoader(plain, batch_size=bs(128), **kw),
                "gpufeed": lambda: gpufeed.DataLoader(h5, batch_size=bs(128), **kw)}, {"ratio": 3.0}
    if name == "python-list":
        n_rows, n_str = (1_000_000, 2_000_000) if not quick else (20_000, 40_000)

        def lists() -> Any:
            rows = np.random.default_rng(0).random((n_rows, 64)).tolist()
            return Rows(rows, [f"caption {i} of the set" for i in range(n_str)],
                        list(range(n_rows)))

        def packed() -> Any:
            rows = np.random.default_rng(0).random((n_rows, 64))
            return Rows(gpufeed.sources.PackedList(rows),
                        gpufeed.sources.PackedList([f"caption {i} of the set"
                                                    for i in range(n_str)]),
                        gpufeed.sources.PackedList(np.arange(n_rows)))

        return {"stock": lambda: StockLoader(lists(), batch_size=bs(256), **kw),
                "gpufeed PackedList": lambda: gpufeed.DataLoader(
                    packed(), batch_size=bs(256), **kw)}, {"pss_growth": 0.05}
    raise ValueError(f"unknown workload {name!r}; choose from {WORKLOADS}")


def _collated(ds: Dataset[Any], indices: list[int]) -> Any:
    return default_collate([ds[i] for i in indices])


def _measure(factory: Factory, quick: bool, whole_epoch: bool) -> dict[str, Any]:
    if isinstance(factory, Ceiling):
        c = measure_no_loader(factory.fetch, factory.batches, processes=factory.processes,
                              init=one_intra_op_thread, sample_memory=True)  # as the loaders
        return {"samples_per_s": c.samples_per_s, "first_batch_s": 0.0, "peak_pss_bytes": 0,
                "start_pss_bytes": 0, "pss_growth_bytes": 0}
    m = measure_loader(factory, warmup_batches=1 if quick else 3,
                       max_seconds=None if whole_epoch or quick else 20.0)
    return {"samples_per_s": m.samples_per_s, "first_batch_s": m.first_batch_s,
            "peak_pss_bytes": m.peak_pss_bytes, "start_pss_bytes": m.start_pss_bytes,
            "pss_growth_bytes": pss_growth_bytes(m), "peak_pss_anon_bytes": m.peak_pss_anon_bytes,
            "peak_pss_file_bytes": m.peak_pss_file_bytes,
            "peak_pss_shmem_bytes": m.peak_pss_shmem_bytes, "peak_held_bytes": m.peak_held_bytes}


def run_workload(name: str, *, repeats: int, quick: bool, cache: Path, nw: int,
                 say: Callable[[str], None] = print) -> dict[str, Any]:
    try:
        sides, target = _build(name, quick, cache, nw)
    except ImportError as exc:
        return {"name": name, "skipped": str(exc)}
    return run_sides(name, sides, target, repeats=repeats, quick=quick,
                     whole_epoch=name == "python-list", say=say)


def run_sides(name: str, sides: dict[str, Factory], target: dict[str, Any], *, repeats: int,
              quick: bool, whole_epoch: bool,
              say: Callable[[str], None] = print) -> dict[str, Any]:
    """Every side ``repeats`` times, alternating; medians, spreads and verdicts per side."""
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    for rep in range(repeats):  # alternating: every side once per repeat, order rotating
        order = list(sides)
        order = order[rep % len(order):] + order[:rep % len(order)]
        for side in order:
            runs[side].append(_measure(sides[side], quick, whole_epoch))
            say(f"{name} [{rep + 1}/{repeats}] {side}: "
                f"{runs[side][-1]['samples_per_s']:,.0f} samples/s")
    rows: list[dict[str, Any]] = []
    for side, ms in runs.items():
        rates = [m["samples_per_s"] for m in ms]
        growth = [m["pss_growth_bytes"] / max(m["start_pss_bytes"], 1) for m in ms]
        rows.append({"side": side, "runs": ms, "median_samples_per_s": statistics.median(rates),
                     "min_samples_per_s": min(rates), "max_samples_per_s": max(rates),
                     "median_pss_growth": statistics.median(growth),
                     "median_peak_pss_bytes": statistics.median(m["peak_pss_bytes"] for m in ms)})
    stock = next(r for r in rows if r["side"] == "stock")
    for r in rows:
        r["ratio"] = r["median_samples_per_s"] / max(stock["median_samples_per_s"], 1e-9)
        r["ceiling"] = isinstance(sides[r["side"]], Ceiling)
        for key, field in (("peak_pss_bytes", "pss_ratio"), ("peak_held_bytes", "held_ratio")):
            r[field] = None if r["ceiling"] else paired_ratio(r["runs"], stock["runs"], key)
        if "pss" in target and not r["ceiling"] and r is not stock:
            r["pss_pass"] = r["pss_ratio"] <= target["pss"]
        if r["ceiling"]:
            r["target"], r["pass"] = "", None
        elif "pss_growth" in target:
            r["target"] = f"PSS growth <= {target['pss_growth']:.0%}"
            r["pass"] = None if r is stock else r["median_pss_growth"] <= target["pss_growth"]
        else:
            goal = target.get(r["side"], target["ratio"])
            r["target"] = f">= {goal:g}x"
            r["pass"] = None if r is stock else r["ratio"] >= goal
    extra = {"mean_file_bytes": target["file_bytes"]} if "file_bytes" in target else {}
    return {"name": name, "rows": rows, **extra}


def environment() -> dict[str, Any]:
    """The shared record (date, machine, versions, commit) and the JPEG codec ImageFolder uses."""
    return {**shared_environment(), "jpeg_codec": _jpeg_codec()}


def _jpeg_codec() -> str:
    """The codec ``ImageFolder(decoder="auto")`` takes here, and its library."""
    try:
        from gpufeed._sources.jpeg import find_turbojpeg, resolve_codec

        name = resolve_codec("auto")
    except ImportError as exc:
        return f"none ({exc})"
    path, why = find_turbojpeg()
    return f"turbojpeg ({path})" if name == "turbojpeg" else f"simplejpeg ({why})"


def render_markdown(doc: dict[str, Any]) -> str:
    env, s = doc["environment"], doc["settings"]
    lines = ["# gpufeed data-source benchmark", "",
             f"{env['date']} on `{env['hostname']}` ({env['cpu_affinity']} usable cores, "
             f"{env['memory_bytes'] / 2**30:.0f} GiB); Python {env['python']}, torch "
             f"{env['torch']}, numpy {env['numpy']}, gpufeed {env['gpufeed']}"
             f"{commit_label(env)}; load average "
             f"{env['loadavg_start'][0]:.2f} at start. num_workers={s['num_workers']}, "
             f"shuffled, median of {s['repeats']} runs (min-max), sides alternating in one run."
             + (" **Quick mode: tiny data, figures mean nothing.**" if s["quick"] else ""), "",
             f"JPEG codec of ImageFolder: {env.get('jpeg_codec', '?')}.", "",
             "| workload | side | samples/s (median) | min-max | vs stock | target | | "
             "PSS growth | peak PSS vs stock | | peak held vs stock |",
             "| --- | --- | ---: | ---: | ---: | --- | --- | ---: | ---: | --- | ---: |"]
    for w in doc["workloads"]:
        if "skipped" in w:
            lines.append(f"| {w['name']} | skipped: {w['skipped']} | | | | | | | | | |")
            continue
        for r in w["rows"]:
            verdict = "" if r["pass"] is None else ("pass" if r["pass"] else "**miss**")
            growth = "-" if r.get("ceiling") else f"{100 * r['median_pss_growth']:.1f}%"
            pss, held = ("-" if r.get(k) is None else f"{r[k]:.2f}x"
                         for k in ("pss_ratio", "held_ratio"))
            pss_verdict = {None: "", True: "<= 1.05x: pass", False: "<= 1.05x: **miss**"}[
                r.get("pss_pass")]
            lines.append(
                f"| {w['name']} | {r['side']} | {r['median_samples_per_s']:,.0f} | "
                f"{r['min_samples_per_s']:,.0f}-{r['max_samples_per_s']:,.0f} | "
                f"{r['ratio']:.2f}x | {r['target'] if r['pass'] is not None else ''} | "
                f"{verdict} | {growth} | {pss} | {pss_verdict} | {held} |")
    sizes = [f"{w['name']} {w['mean_file_bytes'] / 1e3:.0f} KB" for w in doc["workloads"]
             if w.get("mean_file_bytes")]
    if sizes:
        lines += ["", f"Mean JPEG file size: {', '.join(sizes)} (photo-like, quality 90)."]
    lines += ["", "Peak PSS and peak held vs stock: the median of each round's ratio. Peak held: "
              "PSS plus shared memory the process tree holds open but maps nowhere (the stock "
              "loader's queued batches: in no PSS; `_tools/measure.py`)."]
    return "\n".join(lines) + "\n"


def parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The options of the data-source benchmarks (this one and ``shards.py``)."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--repeats", type=int, default=None, help="default 5 (quick: 1)")
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--out", type=directory, default=Path("bench/results"))
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="where the data files are built once "
                        "(default $GPUFEED_BENCH_CACHE or <tmp>/gpufeed-bench)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, for tests")
    return p


def prepare(args: argparse.Namespace) -> tuple[Path, int]:
    """The cache folder (made) and the repeats; one torch thread, as the loaders' workers."""
    cache = args.cache_dir or Path(os.environ.get("GPUFEED_BENCH_CACHE")
                                   or Path(tempfile.gettempdir()) / "gpufeed-bench")
    cache.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    return cache, args.repeats or (1 if args.quick else 5)


def main(argv: Sequence[str] | None = None) -> int:
    p = parser("python -m bench sources", "data sources: gpufeed vs the stock loader")
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    args = p.parse_args(argv)
    cache, repeats = prepare(args)
    doc: dict[str, Any] = {"environment": environment(),
           "settings": {"num_workers": args.num_workers, "repeats": repeats,
                        "quick": args.quick},
           "workloads": [run_workload(w, repeats=repeats, quick=args.quick, cache=cache,
                                      nw=args.num_workers) for w in args.workloads]}
    return finish(doc, args.out, "sources", render_markdown)


def finish(doc: dict[str, Any], out: Path, stem: str,
           render: Callable[[dict[str, Any]], str]) -> int:
    """The load average at the end; ``<stem>.json`` and ``.md`` written and shown."""
    doc["environment"]["loadavg_end"] = list(os.getloadavg())
    text = render(doc)
    paths = write_documents(doc, out, stem, text)
    print(text)
    print(f"wrote {paths[0]} and {paths[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
