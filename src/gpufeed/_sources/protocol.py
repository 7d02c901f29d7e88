"""Batch sources: datasets that read a whole batch per call, and optional dependencies.

The sources' ``repr`` is in torchvision's dataset layout (``dataset_repr``): what a log or a
notebook shows.

NOTE [ Batch sources ]: a map-style dataset may read a batch faster than sample by sample
(one decode loop writing into the slot, one ``take`` of Arrow rows, one sorted HDF5 read).
``batch_source`` in ``_host/fetch.py`` finds the object that does it for a dataset: the dataset
itself when it has the two methods below (``ImageFolder``, ``HDF5Dataset``), a wrapper for a
Hugging Face ``datasets.Dataset`` or a ``pyarrow.Table`` (``_sources/arrow.py``), else None (the
fetcher's usual paths). The fetcher then calls, once per batch:

- ``gpufeed_batch(indices, *, seed, epoch, alloc)`` with the default collate function: the
  batch as ``default_collate`` would make it from the samples, its tensors taken from
  ``alloc(shape, dtype)`` (memory in the slot ring);
- ``gpufeed_samples(indices, *, seed, epoch)`` with a user's ``collate_fn``: the samples, as
  ``[dataset[i] for i in indices]`` would give them.

``seed`` is the loader's per-sample seed, or None (``deterministic=False``). Random choices
come from ``sample_seed(seed, epoch, index)`` per sample (:func:`sample_seeds`), so they do not
depend on the batch, the worker, or its kind. Without a seed they come from the base seed of
the fetch in progress (drawn as torch draws its workers' base seed, so ``torch.manual_seed``
governs it), never from a global generator, which thread workers share with the training loop
(NOTE [ Seeding and threads ]); only outside a gpufeed loader (the stock DataLoader,
``dataset[i]`` by hand) from torch's global generator, as a stock worker would draw. Sources
take no lock, so thread workers overlap.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from .._order.sample_rng import current_scope
from .._order.seeding import sample_seed

EXTRAS = {
    "simplejpeg": "image", "PIL": "image", "pyarrow": "arrow", "datasets": "arrow",
    "h5py": "hdf5",
}


class SourceChanged(RuntimeError):
    """The data under a source changed since the source was built (a shard rewritten): an
    error in every mode, never a skipped sample (``on_error="skip"`` is for bad samples)."""


def require(module: str, what: str) -> Any:
    """Import ``module`` or raise ImportError naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        extra = EXTRAS[module.split(".")[0]]
        raise ImportError(
            f"{what} needs the {module.split('.')[0]!r} package: pip install 'gpufeed[{extra}]'"
        ) from exc


def sample_seeds(indices: Sequence[int] | np.ndarray, seed: int | None, epoch: int) -> list[int]:
    """One 64-bit seed per sample: from ``(seed, epoch, index)``; without a seed, from the base
    seed and epoch of the gpufeed fetch in progress (the ``epoch`` given is then ignored: a
    dataset that reads a source by hand passes 0); outside any, from torch's global generator."""
    if seed is None:
        scope = current_scope()
        if scope is None:
            return torch.randint(0, 2**62, (len(indices),), dtype=torch.int64).tolist()
        seed, epoch = scope.base, scope.epoch
    return [sample_seed(seed, epoch, int(i)) for i in indices]


def index_array(indices: Any) -> np.ndarray:
    """A batch's indices as a flat int64 array."""
    if type(indices) is np.ndarray and indices.dtype == np.int64 and indices.ndim == 1:
        return indices  # an IndexPlan's batch_array
    if isinstance(indices, torch.Tensor):
        indices = indices.numpy()
    idx = np.asarray(indices, dtype=np.int64)
    if idx.ndim != 1:
        raise TypeError(f"batch indices must be a flat sequence of ints, got shape {idx.shape}")
    return idx


def wrap_indices(idx: np.ndarray, n: int) -> np.ndarray:
    """``idx`` with negative indices counted from the end of ``n`` samples, as ``a[i]``,
    ``np.take`` and the stock loader count them (``index_select`` and Arrow's ``take`` do
    not); ``idx`` itself when none is negative; IndexError naming one out of range."""
    if not len(idx) or idx.min() >= 0:
        return idx
    low, high = int(idx.min()), int(idx.max())
    if low < -n or high >= n:
        raise IndexError(f"index {low if low < -n else high} is out of range for {n} samples")
    return np.where(idx < 0, idx + n, idx)


def dataset_repr(obj: object, length: int, location: str | None,
                 settings: Iterable[str]) -> str:
    """torchvision's ``VisionDataset.__repr__`` layout, ``settings`` one line each::

        Dataset ImageFolder
            Number of datapoints: 1281167
            Root location: /data/imagenet/train
            <one line per key setting>
    """
    body = [f"Number of datapoints: {length}"]
    if location is not None:
        body.append(f"Root location: {location}")
    body.extend(settings)
    return "\n".join([f"Dataset {type(obj).__name__}", *("    " + line for line in body)])
