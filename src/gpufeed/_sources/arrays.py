"""Datasets whose batches gpufeed can gather in one vectorised operation."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from .._base.stats import human_bytes
from .protocol import dataset_repr, index_array, wrap_indices

Alloc = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


def allocate(alloc: Alloc | None, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor for a batch from ``alloc`` (the loader's slot memory, NOTE [ Batch sources ]),
    or a fresh one without it (``dataset[i]``, ``__getitems__``, other loaders)."""
    return torch.empty(shape, dtype=dtype) if alloc is None else alloc(tuple(shape), dtype)


class ArrayDataset(Dataset[tuple[torch.Tensor, ...]]):
    """Samples are rows of numpy arrays, memory maps or tensors sharing their first dimension.

    ``dataset[i]`` is a tuple of tensors, one per array (as with ``TensorDataset``). With
    gpufeed's loader and the default collate function, a batch is gathered with one
    ``take``/``index_select`` per array straight into the loader's slot ring, instead of one
    ``__getitem__`` and a stack per sample. ``__getitems__`` lets other loaders batch too.

    Args:
        *arrays: one or more arrays; numpy memory maps are read lazily, page by page.
    """

    def __init__(self, *arrays: np.ndarray | torch.Tensor) -> None:
        if not arrays:
            raise ValueError("ArrayDataset needs at least one array, e.g. ArrayDataset(x, y)")
        for k, a in enumerate(arrays):
            if not isinstance(a, (np.ndarray, torch.Tensor)):
                raise TypeError(
                    f"ArrayDataset argument {k} is a {type(a).__name__}; pass numpy arrays, "
                    "numpy memory maps or torch tensors (np.asarray(x) converts a list)"
                )
            if a.ndim == 0:
                raise ValueError(f"ArrayDataset argument {k} is 0-d; samples index dimension 0")
            if isinstance(a, np.ndarray) and (a.dtype.kind not in "biufc" or a.dtype.fields):
                raise TypeError(f"ArrayDataset argument {k} has dtype {a.dtype}, which no torch "
                                "tensor holds; pass numbers or bools (e.g. a.astype(np.int64))")
        n = len(arrays[0])
        lengths = [len(a) for a in arrays]
        if any(m != n for m in lengths):
            raise ValueError(f"ArrayDataset arrays differ in length {lengths}; they must all match")
        self.arrays = arrays
        self.gather_arrays = [_gatherable(a) for a in arrays]  # views, made once

    def __len__(self) -> int:
        return len(self.arrays[0])

    def __repr__(self) -> str:
        arrays = []
        for a in self.arrays:
            kind = "memmap" if isinstance(a, np.memmap) else type(a).__name__
            dtype = str(a.dtype).replace("torch.", "")
            nbytes = a.nbytes if isinstance(a, np.ndarray) else a.element_size() * a.nelement()
            arrays.append(f"{kind} {dtype} {tuple(a.shape)} ({human_bytes(nbytes)})")
        return dataset_repr(self, len(self), None, [f"Arrays: {', '.join(arrays)}"])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        return tuple(_row(a, index) for a in self.arrays)

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[torch.Tensor, ...]]:
        cols = gather(self.gather_arrays, indices, None)
        return list(zip(*cols, strict=True))


def _row(a: np.ndarray | torch.Tensor, index: int) -> torch.Tensor:
    if isinstance(a, torch.Tensor):
        return a[index]
    row = a[index]
    if not a.dtype.isnative:  # big-endian data on a little-endian machine (or the reverse)
        return torch.from_numpy(np.array(row, dtype=a.dtype.newbyteorder("=")))
    if isinstance(row, np.ndarray) and row.flags.writeable and type(row) is np.ndarray:
        return torch.from_numpy(row)
    return torch.from_numpy(np.array(row))  # memmap rows and scalars: an owned copy


def _gatherable(a: Any) -> Any:
    """A strided numpy array (e.g. a field of a structured array) viewed as a tensor, without
    a copy: ``np.take`` into ``out=`` is two orders of magnitude slower on it than
    ``index_select``."""
    if not isinstance(a, np.ndarray) or a.flags.c_contiguous:
        return a
    with warnings.catch_warnings():  # read-only memmaps: we only ever read from the view
        warnings.simplefilter("ignore", UserWarning)
        try:
            return torch.from_numpy(a)
        except (TypeError, ValueError):  # negative strides, unsupported dtypes
            return a


@functools.cache
def torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype of numpy's ``dtype`` in this machine's byte order (rows are converted as
    they are copied); found once per dtype: 2 us a leaf per batch."""
    return torch.from_numpy(np.empty(0, dtype=dtype.newbyteorder("="))).dtype


def gather(arrays: Sequence[Any], indices: Sequence[int],
           alloc: Alloc | None) -> list[torch.Tensor]:
    """Rows ``indices`` of each array, stacked into memory from ``alloc`` (one op per array)."""
    idx_np = index_array(indices)
    n = len(idx_np)
    out: list[torch.Tensor] = []
    idx_t: torch.Tensor | None = None
    for a in arrays:
        if isinstance(a, torch.Tensor):
            if idx_t is None:
                idx_t = torch.from_numpy(idx_np)
            # one that requires grad: a batch that does, as stacking its rows gives (out= refuses)
            dst = None if a.requires_grad else allocate(alloc, (n, *a.shape[1:]), a.dtype)
            try:
                dst = torch.index_select(a, 0, idx_t, out=dst)
            except IndexError:  # a negative index (counted from the end, as a[i] does)
                idx_t = torch.from_numpy(wrap_indices(idx_np, len(a)))
                dst = torch.index_select(a, 0, idx_t, out=dst)
        else:
            dst = allocate(alloc, (n, *a.shape[1:]), torch_dtype(a.dtype))
            np.take(a, idx_np, axis=0, out=dst.numpy())
        out.append(dst)
    return out


def gather_arrays(dataset: Any) -> Sequence[Any] | None:
    """The arrays behind ``dataset`` if its batches can be gathered in one go, else None."""
    if type(dataset) is ArrayDataset:
        return dataset.gather_arrays
    if type(dataset) is TensorDataset:
        tensors = dataset.tensors
        if all(t.device.type == "cpu" and t.layout == torch.strided and not t.requires_grad
               for t in tensors):
            return tensors
    return None
