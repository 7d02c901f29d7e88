"""A process worker's C heap, set as if it freed its batches (glibc's malloc).

NOTE [ Worker heap ]
--------------------
glibc's malloc serves a request of at least ``M_MMAP_THRESHOLD`` bytes (128 KiB at start)
with a fresh ``mmap`` that ``free`` unmaps, and hands the top of the heap back to the kernel
once more than ``M_TRIM_THRESHOLD`` (128 KiB) of it is free. Freeing an mmapped block of up
to 32 MiB (64-bit) raises the first threshold to its size and the second to twice that, so a
process that collates its batches into memory of its own soon takes its samples from a heap
that stays mapped.

A gpufeed process worker writes its batches into the ring, which malloc never sees, so its
thresholds stay where the main process's were when it forked (low). Samples that add up to
more than the trim bound are handed back to the kernel after every batch and fault in again,
page by page, for the next; samples over the mapping bound are fresh mappings each time. On
small image crops a worker's fetch took twice as long as in a bare process; the effect varies
with the dataset. Measurements: docs/how-it-works/measurements/memory.md#worker-heap.

So a worker applies glibc's own rule to each batch it writes, as if it had freed it:
:func:`follow_batch` raises ``M_MMAP_THRESHOLD`` to the batch's bytes (never past 32 MiB) and
``M_TRIM_THRESHOLD`` to twice that. The free heap a worker keeps is then what a plain process
keeps: at most twice its largest batch (64 MiB). Thread workers share the main process's heap
and leave it to the user.

Left as it is: a C library other than glibc, a malloc preloaded in its place (jemalloc,
tcmalloc), and glibc's malloc set through the environment (``MALLOC_*_`` variables or
``GLIBC_TUNABLES=glibc.malloc.*``): setting a threshold turns glibc's own adjustment off, and
the user's is the choice to keep.
"""

from __future__ import annotations

import ctypes
import os
import platform
from typing import Any

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_START = 128 << 10  # glibc's default, the first threshold this raises
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's bound on its own adjustment (64-bit)
_USER_SET = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
             "MALLOC_MMAP_MAX_")
_PRELOADED = ("jemalloc", "tcmalloc", "mimalloc")


def left_alone() -> str | None:
    """Why this process's workers leave glibc's heap as it is, or None when they follow their
    batches (``gpufeed doctor`` prints it)."""
    if platform.system() != "Linux":
        return f"{platform.system()}: not glibc's malloc"
    if platform.libc_ver()[0] != "glibc":
        return "not glibc's malloc (musl?)"
    env = os.environ
    user = [k for k in _USER_SET if k in env]
    if user:
        return f"{user[0]} is set (your malloc settings are kept)"
    if "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES sets glibc.malloc (your malloc settings are kept)"
    preloaded = next((n for n in _PRELOADED if n in env.get("LD_PRELOAD", "")), None)
    if preloaded is not None:
        return f"LD_PRELOAD puts {preloaded} in glibc's place"
    return None


def _mallopt() -> Any:
    """glibc's ``mallopt``, or None where the heap is left alone (:func:`left_alone`)."""
    if left_alone() is not None:
        return None
    try:
        fn = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return fn


class HeapFollower:
    """Raises this process's malloc thresholds with the batches it writes (NOTE [ Worker
    heap ]); made in the worker process."""

    def __init__(self) -> None:
        self._mallopt = _mallopt()
        self.threshold = MMAP_THRESHOLD_START  # what M_MMAP_THRESHOLD is now, as far as known

    @property
    def active(self) -> bool:
        return self._mallopt is not None

    def follow_batch(self, nbytes: int) -> None:
        """A batch of ``nbytes`` was written: raise the thresholds to what freeing it would."""
        threshold = min(nbytes, MMAP_THRESHOLD_MAX)
        if threshold <= self.threshold or self._mallopt is None:
            return
        if not (self._mallopt(M_TRIM_THRESHOLD, 2 * threshold)
                and self._mallopt(M_MMAP_THRESHOLD, threshold)):
            self._mallopt = None  # refused (an unexpected glibc): leave the heap alone
            return
        self.threshold = threshold
