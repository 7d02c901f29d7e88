"""The benchmark workloads: deterministic data built once in a cache directory, then reused.

Each factory returns a ``Workload``: a batch size and one or more ``Variant`` datasets over the
same data, so every loader can be measured with each way of fetching a batch:

- ``per-sample``: ``__getitem__`` per sample, then the default collate function;
- ``getitems``: ``__getitems__`` returns the whole batch already stacked, paired with a
  pass-through ``collate_fn`` (the fastest legitimate set-up of the stock loader);
- ``array``: ``gpufeed.sources.ArrayDataset`` over the same arrays; ``getitems-slot`` (image-array):
  ``getitems`` building its batch in ``gpufeed.sources.batch_empty``.

Files live under ``cache_dir`` (default ``$TMPDIR/gpufeed-bench``, or ``$GPUFEED_BENCH_CACHE``),
are written atomically under names that encode their size and seed, and are read once by
``warm()`` before any timing: the first read of a page-cache page is several times slower than
later ones on the VMs we measure on, and a cold first loader would lose for no reason of its own.
Per-sample randomness (crop offsets, flips) is a hash of (seed, index), so every loader and every
worker count sees the same bytes. The types, the tabular datasets and the in-memory ``synthetic``
workload are ``gpufeed._tools.workloads``, inside the package because ``gpufeed bench`` runs it.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from gpufeed._tools.workloads import (
    FEATURES,
    SYNTHETIC_ROWS,
    Variant,
    Workload,
    passthrough,
    synthetic,
    tabular_data,
    tabular_variants,
)
from gpufeed.sources import batch_empty

__all__ = ["FULL_SIZES", "QUICK_SIZES", "WORKLOADS", "Variant", "Workload", "WorkloadUnavailable",
           "build", "default_cache_dir"]

#: Sizes of the full benchmark (the issue's figures; python-list uses 200,000 rows, not 1M: as
#: lists of Python floats 1M rows take about 2.2 GB in the parent and up to 3x that once two
#: forked workers have touched every refcount, too much next to other jobs on a 24 GiB machine).
FULL_SIZES: dict[str, dict[str, int]] = {
    "tabular": {"rows": 1_000_000},
    "image-array": {"count": 20_000, "side": 224},
    "jpeg": {"count": 2_000, "side": 256, "out": 224},
    "python-list": {"rows": 200_000, "source_rows": 1_000_000},
    "synthetic": {"rows": SYNTHETIC_ROWS["full"]},
}
#: Tiny sizes for ``--quick`` (tests): same code paths, a few MB of data.
QUICK_SIZES: dict[str, dict[str, int]] = {
    "tabular": {"rows": 20_000},
    "image-array": {"count": 512, "side": 64},
    "jpeg": {"count": 256, "side": 48, "out": 40},
    "python-list": {"rows": 4_096, "source_rows": 20_000},
    "synthetic": {"rows": SYNTHETIC_ROWS["quick"]},
}


class WorkloadUnavailable(RuntimeError):
    """A workload cannot run here (a missing optional dependency); the message says the fix."""


def default_cache_dir() -> Path:
    """``$GPUFEED_BENCH_CACHE`` if set, else ``gpufeed-bench`` under the system temp dir."""
    env = os.environ.get("GPUFEED_BENCH_CACHE")
    return Path(env) if env else Path(tempfile.gettempdir()) / "gpufeed-bench"


def _mix(seed: int, index: int) -> int:
    """A 64-bit hash of (seed, index) (splitmix64): cheap per-sample randomness."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def _labels(n: int) -> np.ndarray:
    return (np.arange(n, dtype=np.int64) * 7919) % 1000


def _atomic(path: Path, write: Callable[[Path], None]) -> Path:
    """Create ``path`` once via ``write(tmp)`` then rename, so a crash never leaves half a file."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        write(tmp)
        os.replace(tmp, path)
    return path


def warm(paths: Sequence[Path]) -> dict[str, float]:
    """Read every file once (1 MiB chunks) so timed runs find it in the page cache."""
    t0 = time.perf_counter()
    total = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while chunk := f.read(1 << 20):
                total += len(chunk)
    return {"warmed_bytes": total, "warm_s": round(time.perf_counter() - t0, 3)}


# ---------------------------------------------------------------- tabular and python-list
def _tabular_file(cache: Path, rows: int, seed: int) -> Path:
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.save(f, tabular_data(rows, seed))

    return _atomic(cache / f"tabular-{rows}-s{seed}.npy", write)


class PythonRows(Dataset[tuple[torch.Tensor, int]]):
    """Rows kept as a Python list of lists (64 floats then the label): the copy-on-write case,
    where forked workers touch every object's refcount and so copy the pages holding it."""

    def __init__(self, rows: list[list[float]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        row = self.rows[i]
        return torch.tensor(row[:FEATURES], dtype=torch.float32), int(row[FEATURES])


def tabular(cache: Path, *, rows: int, seed: int = 0) -> Workload:
    """1M x 64 float32 + int64 label in one in-memory structured array, batch 256."""
    path = _tabular_file(cache, rows, seed)
    data = np.load(path)  # read whole into memory: timed runs never touch the file
    meta = {"file": str(path), "file_bytes": path.stat().st_size, "in_memory": True}
    return Workload("tabular", f"{rows:,} x {FEATURES} float32 + int64 label, one array",
                    256, rows, tabular_variants(data), meta=meta)


def python_list(cache: Path, *, rows: int, source_rows: int, seed: int = 0) -> Workload:
    """The tabular rows as a Python list of lists; measured over a whole epoch for PSS growth."""
    if rows > source_rows:
        raise ValueError(f"python-list rows={rows} exceeds the tabular source_rows={source_rows}")
    data = np.load(_tabular_file(cache, source_rows, seed), mmap_mode="r")[:rows]
    feats = np.asarray(data["x"]).tolist()
    labels = np.asarray(data["y"]).tolist()
    for row, label in zip(feats, labels, strict=True):
        row.append(label)
    return Workload("python-list", f"{rows:,} rows as Python lists of 65 numbers", 256, rows,
                    (Variant("per-sample", PythonRows(feats)),), full_epoch=True,
                    meta={"rows": rows, "note": "row count lowered from 1M to fit memory"})


# ---------------------------------------------------------------- image-array and jpeg
def _crop(seed: int, i: int, side: int, crop: int) -> tuple[int, int, bool]:
    h, span = _mix(seed, i), side - crop + 1
    return h % span, (h >> 20) % span, bool((h >> 40) & 1)


class CroppedImages(Dataset[tuple[torch.Tensor, int]]):
    """uint8 CHW images in a memory map, each randomly cropped to ``crop`` and maybe flipped.

    The map is opened lazily in each process (pickling carries the path, never the bytes)."""

    def __init__(self, path: Path, count: int, side: int, crop: int, seed: int) -> None:
        self.path, self.count, self.side, self.crop, self.seed = path, count, side, crop, seed
        self.labels = _labels(count)
        self._map: np.ndarray | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_map": None}

    def _images(self) -> np.ndarray:
        if self._map is None:
            shape = (self.count, 3, self.side, self.side)
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r", shape=shape)
        return self._map

    def _view(self, i: int) -> np.ndarray:
        top, left, flip = _crop(self.seed, i, self.side, self.crop)
        view = self._images()[i, :, top:top + self.crop, left:left + self.crop]
        return view[:, :, ::-1] if flip else view

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.from_numpy(self._view(i).copy(order="C")), int(self.labels[i])


class CroppedImageBatches(CroppedImages):
    """``CroppedImages`` whose ``__getitems__`` writes each crop into one batch array from
    ``np.empty``, or ``empty``: ``gpufeed.sources.batch_empty`` (torch.empty outside its
    workers)."""

    empty: Callable[..., torch.Tensor] | None = None

    def __getitems__(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (len(indices), 3, self.crop, self.crop)
        out = (np.empty(shape, dtype=np.uint8) if self.empty is None
               else self.empty(shape, dtype=torch.uint8).numpy())
        for k, i in enumerate(indices):
            out[k] = self._view(i)
        return torch.from_numpy(out), torch.from_numpy(self.labels[np.asarray(indices)])


def image_array(cache: Path, *, count: int, side: int, seed: int = 0) -> Workload:
    """``count`` uint8 3 x side x side images in a memory map on disk; random crop to 6/7 of
    the side (224 -> 192) plus a random horizontal flip per sample, batch 64."""

    def write(tmp: Path) -> None:
        rng = np.random.default_rng(seed)
        out = np.memmap(tmp, dtype=np.uint8, mode="w+", shape=(count, 3, side, side))
        for start in range(0, count, 512):
            stop = min(count, start + 512)
            out[start:stop] = rng.integers(0, 256, (stop - start, 3, side, side), dtype=np.uint8)
        out.flush()
        del out

    path = _atomic(cache / f"images-{count}-{side}-s{seed}.u8", write)
    crop = side - side // 7
    variants = [Variant("per-sample", CroppedImages(path, count, side, crop, seed)),
                Variant("getitems", CroppedImageBatches(path, count, side, crop, seed),
                        passthrough)]
    slot = CroppedImageBatches(path, count, side, crop, seed)
    slot.empty = batch_empty
    variants.append(Variant("getitems-slot", slot, passthrough))
    meta = {"file": str(path), "file_bytes": path.stat().st_size, "crop": crop, **warm([path])}
    return Workload("image-array", f"{count:,} uint8 3x{side}x{side} memmap, crop {crop} + flip",
                    64, count, tuple(variants), meta=meta)


def _decode(path: Path, out: int) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as img:
        rgb = img.convert("RGB").resize((out, out), Image.Resampling.BILINEAR)
        return np.asarray(rgb).transpose(2, 0, 1)


class JpegFiles(Dataset[tuple[torch.Tensor, int]]):
    """JPEG files decoded with Pillow and resized to ``out`` x ``out`` (uint8 CHW)."""

    def __init__(self, paths: Sequence[Path], out: int) -> None:
        self.paths, self.out, self.labels = list(paths), out, _labels(len(paths))

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.from_numpy(np.ascontiguousarray(_decode(self.paths[i], self.out))), int(
            self.labels[i])


class JpegBatches(JpegFiles):
    """``JpegFiles`` whose ``__getitems__`` decodes each file into one batch array."""

    def __getitems__(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        out = np.empty((len(indices), 3, self.out, self.out), dtype=np.uint8)
        for k, i in enumerate(indices):
            out[k] = _decode(self.paths[i], self.out)
        return torch.from_numpy(out), torch.from_numpy(self.labels[np.asarray(indices)])


def jpeg(cache: Path, *, count: int, side: int, out: int, seed: int = 0) -> Workload:
    """``count`` JPEGs of about side x side (smooth colour fields plus noise, quality 90),
    decoded with Pillow and resized to ``out``, batch 64. Needs Pillow (``gpufeed[image]``)."""
    try:
        from PIL import Image
    except ImportError as exc:
        raise WorkloadUnavailable(
            "the jpeg workload needs Pillow: pip install 'gpufeed[image]' (or pip install Pillow)"
        ) from exc
    folder = cache / f"jpeg-{count}-{side}-s{seed}"

    def write(tmp: Path) -> None:
        tmp.mkdir()
        rng = np.random.default_rng(seed)
        for i in range(count):
            w, h = (side + int(d) for d in rng.integers(-side // 16, side // 16 + 1, 2))
            coarse = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))
            base = np.asarray(coarse.resize((w, h), Image.Resampling.BICUBIC), dtype=np.int16)
            noisy = base + rng.integers(-12, 13, base.shape, dtype=np.int16)
            Image.fromarray(noisy.clip(0, 255).astype(np.uint8)).save(tmp / f"{i:06d}.jpg",
                                                                    quality=90)

    paths = sorted(_atomic(folder, write).glob("*.jpg"))
    if len(paths) != count:
        raise RuntimeError(f"{folder} holds {len(paths)} JPEGs, not {count}; delete it to rebuild")
    variants = (Variant("per-sample", JpegFiles(paths, out)),
                Variant("getitems", JpegBatches(paths, out), passthrough))
    meta = {"folder": str(folder), "file_bytes": sum(p.stat().st_size for p in paths),
            "out": out, **warm(paths)}
    return Workload("jpeg", f"{count:,} JPEGs ~{side}x{side}, Pillow decode + resize {out}",
                    64, count, variants, meta=meta)

WORKLOADS: dict[str, Callable[..., Workload]] = {
    "tabular": tabular,
    "image-array": image_array,
    "jpeg": jpeg,
    "python-list": python_list,
    "synthetic": synthetic,
}


def build(name: str, *, cache_dir: Path | None = None, quick: bool = False,
          seed: int = 0) -> Workload:
    """Build workload ``name`` at full (default) or ``quick`` size, creating its files in
    ``cache_dir`` on first use and warming them into the page cache.

    Raises:
        ValueError: unknown name. WorkloadUnavailable: a missing optional dependency.
    """
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    sizes = (QUICK_SIZES if quick else FULL_SIZES)[name]
    return WORKLOADS[name](cache_dir or default_cache_dir(), seed=seed, **sizes)
