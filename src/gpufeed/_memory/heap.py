"""A process worker's C heap, set as if it freed its batches (glibc's malloc).

NOTE [ Worker heap ]
--------------------
glibc's malloc serves a request of at least ``M_MMAP_THRESHOLD`` bytes (128 KiB at start)
with a fresh ``mmap`` that ``free`` unmaps, and hands the top of the heap back to the kernel
once more than ``M_TRIM_THRESHOLD`` (128 KiB) of it is free. Both thresholds rise on their
own: freeing an mmapped block of up to 32 MiB (64-bit) raises the first to its size and the
second to twice that. A process that collates its batches into memory of its own frees one
per batch, so after its first batch its samples (a 3x192x192 crop is 108 KiB, a decoded
500x375 photo 549 KiB) come from a heap that stays mapped.

A gpufeed process worker writes its batches into the ring, which malloc never sees, so its
thresholds stay wherever the main process's were when it forked (a training script's: low) plus
whatever its own first batches freed. When a batch's samples add up to more than the trim
bound, they are handed back to the kernel after every batch and fault in again, page by page,
for the next (about 4 us a page on a 2-core VM); samples over the mapping bound are fresh
mappings each time. Measured in new interpreters, image-array ``per-sample`` (64 crops of 108
KiB, 2 process workers): a worker's median fetch 9.8-10.4 ms against 5.0-5.7 ms for the same
batch in a bare process (``python -m bench.workers --variant per-sample``), and
1,641 page faults per batch in the workers against 205 with what follows
(``python -m bench.heap``: 1.75x the samples/s). Whether glibc hands a given
batch back depends on what was allocated above it, so the effect varies with the dataset;
what following costs is the free heap a worker then keeps, bounded below.

So a worker applies glibc's own rule to each batch it writes, as if it had freed it:
:func:`follow_batch` raises ``M_MMAP_THRESHOLD`` to the batch's bytes (never past glibc's
32 MiB bound) and ``M_TRIM_THRESHOLD`` to twice that. The heap a worker keeps is then what a
plain process keeps: at most twice its largest batch (64 MiB) of free memory at the top.
Thread workers share the main process's heap and leave it to the user.

Left as it is: a C library other than glibc (musl, macOS), a malloc preloaded in its place
(jemalloc, tcmalloc), and a user who set glibc's malloc through the environment
(``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_``,
``MALLOC_MMAP_MAX_`` or ``GLIBC_TUNABLES=glibc.malloc.*``): setting either threshold turns
glibc's own adjustment off, and theirs is the choice to keep.
"""

from __future__ import annotations

import ctypes
import os
import platform
from typing import Any

__all__ = ["MMAP_THRESHOLD_MAX", "HeapFollower", "left_alone"]

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_START = 128 << 10  # glibc's default, the first threshold this raises
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's bound on its own adjustment (64-bit)
_USER_SET = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
             "MALLOC_MMAP_MAX_")
_PRELOADED = ("jemalloc", "tcmalloc", "mimalloc")


def left_alone() -> str | None:
    """Why this process's workers leave glibc's heap as it is (see the NOTE), or None when
    they follow their batches. ``gpufeed doctor`` prints it."""
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
    heap ]). Made in the worker process, after it started."""

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
