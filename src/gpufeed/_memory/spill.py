"""Spill files: memory for the leaves of a batch that the ring cannot hold (process workers).

NOTE [ Spill ]
--------------
A process worker's batch that gets no slot (before the ring knows the batch size, or past its
budget), or whose leaves do not fit its slot, is written into a *spill*: a memory file of its
own (a ``Region``), the ring's mechanism without the recycling, so /dev/shm plays no part:

    worker: Spill() ──reserve a sparse file, bump-allocate the leaves, seal(): truncate the
            file to the bytes used──> the result message carries the file's descriptor
            (pickled as the ring's region is) ──> worker: release() its mapping
    main:   maps the file, views its leaves (a ``collate.Leaf`` marked spilled); the mapping,
            hence the memory, goes with the last tensor viewing it

Leaves torch's own pickling must carry (nested, sparse, quantized tensors, tensor subclasses)
are not spilled: they go the stock way, through torch's shared memory, and the batch is counted
in the loader's ``ring_unsupported`` counter.
"""

from __future__ import annotations

import functools
import math
import mmap
import os
from typing import Any

import numpy as np
import torch

from .._base.errors import WorkerError
from .region import ALIGN, PAGE, Region, align, contiguous_at, physical_memory


class SharedMemoryError(WorkerError):
    """A process worker could not get shared memory for a batch (NOTE [ Spill ]); the message
    says how much was asked for and the ways out."""


@functools.cache
def spill_reserve() -> int:
    """Address space a spill reserves (sparse): the physical memory, which no batch can
    usefully exceed."""
    return physical_memory()


def _out_of_memory(nbytes: int, why: str) -> SharedMemoryError:
    return SharedMemoryError(
        f"gpufeed process worker could not get {nbytes} bytes of shared memory (an anonymous "
        f"memory file, memfd, for a batch the slot ring did not hold): {why}. Ways out: a "
        "ring that holds the batch (raise ring_bytes=, or leave it unset), "
        "worker_type='thread' (no shared memory at all), fewer or smaller batches in flight "
        "(prefetch_factor=, batch_size=), or more memory (where memory files live in /dev/shm, "
        "on platforms without memfd, a larger /dev/shm, e.g. docker --shm-size)"
    )


class Spill:
    """One batch's memory file; see NOTE [ Spill ]."""

    def __init__(self) -> None:
        reserve = spill_reserve()
        try:
            self.region = Region(reserve, shared=True)
        except OSError as e:
            raise _out_of_memory(reserve, f"creating it failed ({e.strerror})") from e
        self.base = self.region.tensor.data_ptr()
        self.cur = 0
        self._typed: dict[torch.dtype, torch.Tensor] = {}

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        isz = dtype.itemsize
        nbytes = math.prod(shape) * isz
        if self.cur + nbytes > self.region.size:
            raise _out_of_memory(self.cur + nbytes, f"the batch exceeds {self.region.size} bytes")
        typed = self._typed.get(dtype)
        if typed is None:
            typed = self._typed[dtype] = self.region.tensor.view(dtype)
        t = contiguous_at(typed, shape, self.cur // isz)
        self.cur += align(nbytes, ALIGN)
        return t

    def owns_ptr(self, ptr: int) -> bool:
        return self.base <= ptr < self.base + self.cur

    def seal(self) -> SpillFile:
        """The file, cut down to the bytes used, ready to be pickled into the result."""
        size = align(max(self.cur, 1), PAGE)
        self._typed.clear()
        region = self.region
        try:
            os.ftruncate(region.fd, size)
        except OSError as e:
            raise _out_of_memory(size, f"resizing it failed ({e.strerror})") from e
        region.size = size
        return SpillFile(region.fd, size)

    def release(self) -> None:
        """The worker's side is done (after the result was sent): unmap, close."""
        self._typed.clear()
        self.region.release()


class SpillFile:
    """A sealed spill file in a result message: pickles as its descriptor, as ``Region``
    does, and arrives as a uint8 tensor mapping it."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing.reduction import DupFd

        return (_map, (DupFd(self.fd), self.size))


def _map(dupfd: Any, size: int) -> torch.Tensor:
    """Map a received spill file through /proc/self/fd where there is one: torch's mapping
    keeps no descriptor, so kept batches hold none each; elsewhere an ``mmap``, which keeps
    one until the last view is gone."""
    fd = dupfd.detach()
    try:
        path = f"/proc/self/fd/{fd}"
        if os.path.exists(path):
            storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=size)
            return torch.empty(0, dtype=torch.uint8).set_(storage)  # type: ignore[arg-type]
        mm = mmap.mmap(fd, size)
        return torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))
    finally:
        os.close(fd)
