"""``HDF5Dataset``: rows of HDF5 datasets, a batch per sorted read.

NOTE [ HDF5 handles ]: an open ``h5py.File`` must not cross a fork (the child would share the
library's state and file offset with its parent), so the file is opened lazily, by whichever
process reads first, and reopened when the process id changes; pickling (spawn) drops the
handle. Thread workers share their process's handle: h5py serialises calls on it with its own
lock, and HDF5 reading holds that lock, so threads overlap everything but the read itself.
A batch is read with one selection per key: the batch's distinct indices in increasing order
(HDF5 needs them so), as a hyperslab when they are dense in their range (one contiguous read,
then a ``take``), else as a point list; then reordered into the batch's order in memory,
straight into the slot. Each process gets a chunk cache of ``chunk_cache_bytes``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from .._base.stats import human_bytes
from .arrays import allocate, torch_dtype
from .protocol import dataset_repr, index_array, require

_open_lock = threading.Lock()  # the forked child gets a fresh one (at_fork below)
DENSE = 4  # read the whole range when it is at most this many times the rows wanted


def _new_lock() -> None:
    global _open_lock
    _open_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_lock)


class HDF5Dataset(Dataset[tuple[torch.Tensor, ...]]):
    """Samples are rows of the HDF5 datasets ``keys`` of one file (sharing their first axis).

    ``dataset[i]`` is a tuple of tensors, one per key (as ``ArrayDataset``); with gpufeed's
    loader and the default collate a batch is read with one sorted read per key
    (NOTE [ HDF5 handles ]). Works under process and thread workers and the stock loader.
    Needs ``pip install 'gpufeed[hdf5]'``.

    Args:
        path: the HDF5 file.
        keys: names of datasets in it, e.g. ``("images", "labels")``.
        chunk_cache_bytes: HDF5's chunk cache per open file (h5py's default is 1 MiB, which
            re-reads and re-decompresses chunks a shuffled batch revisits).
    """

    def __init__(self, path: str | os.PathLike[str], keys: Sequence[str], *,
                 chunk_cache_bytes: int = 64 << 20) -> None:
        require("h5py", "gpufeed.sources.HDF5Dataset")
        if isinstance(keys, str):
            keys = (keys,)
        if not keys:
            raise ValueError("HDF5Dataset needs at least one key, e.g. ('images', 'labels')")
        self.path = os.fspath(path)
        self.keys = tuple(keys)
        self.chunk_cache_bytes = int(chunk_cache_bytes)
        self._file: Any = None
        self._pid = -1
        f = self._open()
        try:
            lengths = []
            for k in self.keys:
                if k not in f:
                    raise KeyError(f"{self.path!r} has no dataset {k!r}; it has {sorted(f)}")
                d = f[k]
                if not hasattr(d, "shape") or len(d.shape) == 0:
                    raise ValueError(f"{self.path!r}[{k!r}] is not an array dataset with rows")
                lengths.append(d.shape[0])
            if len(set(lengths)) != 1:
                raise ValueError(f"HDF5Dataset keys {self.keys} differ in length {lengths}; "
                                 "they must all match")
            self._len = lengths[0]
            self._meta = [(f[k].shape[1:], torch_dtype(_native(f[k].dtype, self.path, k)))
                          for k in self.keys]
        finally:
            self.close()

    def _open(self) -> Any:
        pid = os.getpid()
        if self._file is not None and self._pid == pid:
            return self._file
        with _open_lock:  # thread workers: one handle per process
            if self._file is None or self._pid != pid:
                h5py = require("h5py", "gpufeed.sources.HDF5Dataset")
                if not os.path.exists(self.path):
                    raise FileNotFoundError(f"HDF5 file {self.path!r} does not exist")
                try:
                    self._file = h5py.File(self.path, "r", rdcc_nbytes=self.chunk_cache_bytes,
                                           rdcc_nslots=10007)
                except OSError as exc:
                    raise OSError(f"cannot open {self.path!r} as HDF5: {exc}") from exc
                self._pid = pid
            return self._file

    def close(self) -> None:
        """Close this process's handle (it reopens on the next read)."""
        if self._file is not None and self._pid == os.getpid():
            self._file.close()
        self._file = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_file"], state["_pid"] = None, -1
        return state

    def __len__(self) -> int:
        return self._len

    def __repr__(self) -> str:
        keys = ", ".join(f"{k} {str(d).replace('torch.', '')} {tuple(s)}"
                         for k, (s, d) in zip(self.keys, self._meta, strict=True))
        return dataset_repr(self, len(self), self.path, [
            f"Keys: {keys}", f"Chunk cache: {human_bytes(self.chunk_cache_bytes)} per file"])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        f = self._open()
        return tuple(torch.as_tensor(np.asarray(f[k][index], dtype=_native(f[k].dtype)))
                     for k in self.keys)

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[torch.Tensor, ...]]:
        cols = self.gpufeed_batch(indices, seed=None, epoch=0, alloc=None)
        return list(zip(*cols, strict=True))

    def gpufeed_samples(self, indices: Sequence[int], *, seed: int | None,
                        epoch: int) -> list[tuple[torch.Tensor, ...]]:
        return self.__getitems__(indices)

    def gpufeed_batch(self, indices: Sequence[int], *, seed: int | None, epoch: int,
                      alloc: Any) -> list[torch.Tensor]:
        """One tensor per key, rows in the batch's order, from one sorted read per key."""
        idx = index_array(indices)
        n = len(idx)
        if n and (idx.min() < -self._len or idx.max() >= self._len):
            raise IndexError(f"HDF5Dataset index out of range for length {self._len}: "
                             f"{idx[(idx < -self._len) | (idx >= self._len)][:4].tolist()}")
        idx = np.where(idx < 0, idx + self._len, idx)
        uniq, inverse = np.unique(idx, return_inverse=True)
        f = self._open()
        out = []
        for k, (shape, tdtype) in zip(self.keys, self._meta, strict=True):
            dst = allocate(alloc, (n, *shape), tdtype)
            if n:
                lo, hi = int(uniq[0]), int(uniq[-1]) + 1
                if hi - lo <= DENSE * len(uniq):
                    block = f[k][lo:hi]
                    np.take(block, (uniq - lo)[inverse], axis=0, out=dst.numpy())
                else:
                    np.take(f[k][uniq], inverse, axis=0, out=dst.numpy())
            out.append(dst)
        return out


def _native(dtype: np.dtype, path: str = "", key: str = "") -> np.dtype:
    """``dtype`` in this machine's byte order (rows are converted as they are read); a
    TypeError naming the dataset for one torch has no dtype for."""
    if dtype.kind not in "biufc" or dtype.fields is not None:
        raise TypeError(
            f"{path!r}[{key!r}] has dtype {dtype}, which no torch tensor holds; HDF5Dataset "
            "reads numeric and bool datasets (read strings and compound types with h5py in a "
            "Dataset of your own)")
    return dtype.newbyteorder("=")
