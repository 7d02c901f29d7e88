"""The built-in workload of ``gpufeed bench``: in-memory random features and labels (no files),
fetched the three ways of ``_tools/bench.py`` (its ``getitems`` paired with a pass-through
``collate_fn``: the fastest legitimate set-up of the stock loader).

The benchmark lab (``bench/workloads.py`` in the repository) builds its file-backed workloads
(tabular, image-array, jpeg, python-list) on these same types.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from .._sources.arrays import ArrayDataset

FEATURES = 64
#: Rows of the built-in workload: full size, and ``--quick`` (tests: the same code paths).
SYNTHETIC_ROWS = {"full": 200_000, "quick": 8_192}


def passthrough(batch: Any) -> Any:
    """``collate_fn`` for datasets whose ``__getitems__`` already returns a stacked batch."""
    return batch


@dataclass(frozen=True)
class Variant:
    """One way of fetching the workload's batches: a dataset and the ``collate_fn`` it needs
    (``None``: the loader's default)."""

    name: str
    dataset: Any
    collate_fn: Callable[[Any], Any] | None = None


@dataclass(frozen=True)
class Workload:
    """A benchmark workload: ``name`` (``synthetic``, or one of the lab's), a one-line
    ``description`` for the results table, ``samples`` in one epoch, the ``variants`` to measure
    per fetch path; ``full_epoch`` measures a whole epoch (memory growth) instead of a
    time-capped slice; ``meta``: sizes, files and page-cache warm-up figures for the results."""

    name: str
    description: str
    batch_size: int
    samples: int
    variants: tuple[Variant, ...]
    full_epoch: bool = False
    meta: dict[str, Any] = field(default_factory=dict)


TABULAR_DTYPE = np.dtype([("x", "<f4", (FEATURES,)), ("y", "<i8")])


def tabular_data(rows: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    data = np.empty(rows, dtype=TABULAR_DTYPE)
    data["x"] = rng.standard_normal((rows, FEATURES), dtype=np.float32)
    data["y"] = rng.integers(0, 1000, rows)
    return data


class TabularRows(Dataset[tuple[torch.Tensor, int]]):
    """Rows of one structured array (64 float32 features + an int64 label per record)."""

    def __init__(self, data: np.ndarray) -> None:
        self.x, self.y = data["x"], data["y"]

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.from_numpy(self.x[i]), int(self.y[i])


class TabularBatches(TabularRows):
    """``TabularRows`` with a vectorised ``__getitems__`` returning ``(features, labels)``."""

    def __getitems__(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = np.asarray(indices, dtype=np.int64)
        return torch.from_numpy(self.x[idx]), torch.from_numpy(self.y[idx])


def tabular_variants(data: np.ndarray) -> tuple[Variant, ...]:
    """per-sample, getitems and gpufeed's ArrayDataset variants."""
    return (Variant("per-sample", TabularRows(data)),
            Variant("getitems", TabularBatches(data), passthrough),
            Variant("array", ArrayDataset(data["x"], data["y"])))


def synthetic(cache: Path | None, *, rows: int, seed: int = 0) -> Workload:
    """In-memory random features and labels, no files: the default of ``gpufeed bench``."""
    return Workload("synthetic", f"{rows:,} x {FEATURES} float32 in memory (no files)",
                    256, rows, tabular_variants(tabular_data(rows, seed)),
                    meta={"in_memory": True})


def builtin(quick: bool = False) -> Workload:
    """The workload ``gpufeed bench`` measures when given no dataset of the user's."""
    return synthetic(None, rows=SYNTHETIC_ROWS["quick" if quick else "full"])
