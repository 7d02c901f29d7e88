"""Checking ``gpufeed.DataLoader``'s own arguments when it is built.

Errors name the value and the fix (``ValueError``/``TypeError``, never ``assert``); where torch
takes an argument at construction and fails only at ``iter()``, gpufeed says so at once.
"""

from __future__ import annotations

import operator
import os
import select
import sys
import warnings
from typing import Any

from .config import WORKER_TYPES


def check_arguments(
    *, num_workers: Any, worker_type: Any, prefetch_factor: Any, multiprocessing_context: Any,
    ring_bytes: Any, device: Any, device_transform: Any, device_depth: Any, deterministic: Any,
) -> None:
    """Raise for an argument gpufeed cannot take (``num_workers``: "auto" already resolved)."""
    if not isinstance(worker_type, str):
        raise TypeError(f"worker_type must be 'process' or 'thread', got {worker_type!r}")
    if worker_type not in WORKER_TYPES:
        raise ValueError(
            f"worker_type={worker_type!r} is not supported; use 'process' or 'thread'"
        )
    workers = isinstance(num_workers, int) and num_workers > 0
    if worker_type == "process" and workers and not hasattr(select, "poll"):  # Windows
        raise ValueError(
            f"worker_type='process' needs select.poll, which {sys.platform} lacks (gpufeed's "
            "process workers run on Linux and macOS); use worker_type='thread', or "
            "torch.utils.data.DataLoader on this platform"
        )
    if worker_type == "thread" and multiprocessing_context is not None:
        raise ValueError(
            "multiprocessing_context only applies to process workers; drop it or use "
            "worker_type='process'"
        )
    if workers and prefetch_factor is not None:
        # Anything torch's range(prefetch_factor * num_workers) takes, >= 1.
        try:
            whole = operator.index(prefetch_factor)
        except TypeError:
            whole = None
        if whole is None or whole < 1:
            # Stock fails only at iter(): a TypeError from range(), an assert for 0.
            fix = ("prefetch_factor is the whole number of batches each worker loads ahead, an "
                   f"int >= 1 (None: the default, 2 in torch); got {prefetch_factor!r}")
            if whole is None:
                raise TypeError(f"'{type(prefetch_factor).__name__}' object cannot be "
                                f"interpreted as an integer: {fix}")
            if whole < 0:
                raise ValueError(f"prefetch_factor option should be non-negative: {fix}")
            # stock: AssertionError at iter(), which python -O strips; a ValueError here
            raise ValueError("prefetch_factor must be greater than 0 for "
                             f"MultiProcessingDataLoaderIter: {fix}")
    if ring_bytes is not None:
        if isinstance(ring_bytes, bool) or not isinstance(ring_bytes, int):
            raise TypeError(
                f"ring_bytes must be an int number of bytes or None, got {ring_bytes!r}"
            )
        if ring_bytes < 0:
            raise ValueError(f"ring_bytes={ring_bytes} is negative; use 0 to disable the ring")
    if isinstance(device_depth, bool) or not isinstance(device_depth, int):
        raise TypeError(f"device_depth={device_depth!r} must be an int >= 1 (2 is typical)")
    if device_depth < 1:
        raise ValueError(f"device_depth={device_depth!r} must be an int >= 1 (2 is typical)")
    if device_transform is not None and not callable(device_transform):
        raise TypeError(f"device_transform must be callable, got {device_transform!r}")
    if device_transform is not None and device is None:
        raise ValueError("device_transform needs device=, e.g. device='cuda'")
    if deterministic is not None and not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be True, False or None, got {deterministic!r}")


def check_num_workers(value: Any, *, auto: bool = False) -> None:
    """torch's errors for a worker count, in its class and words, at once (torch raises only at
    ``iter()``); ``auto``: "auto" is taken (the constructor's). A bool is an int, as in torch."""
    if isinstance(value, str):
        if auto and value == "auto":
            return
        raise TypeError(f"num_workers={value!r} is not supported; use an int >= 0, or 'auto' to "
                        "let gpufeed size the workers while it runs (0: load in the main "
                        "process)")
    if not isinstance(value, int):
        raise TypeError(f"'{type(value).__name__}' object cannot be interpreted as an integer: "
                        f"num_workers={value!r}; use an int >= 0 (0: load in the main "
                        "process), or 'auto'")
    if value < 0:
        raise ValueError("num_workers option should be non-negative; use num_workers=0 to "
                         "disable multiprocessing.")  # stock's words, exactly


def warn_thread_workers(num_workers: int) -> None:
    """torch's warning, in its words, for more thread workers than usable CPUs
    (``DataLoader.check_worker_number_rationality``)."""
    affinity = getattr(os, "sched_getaffinity", None)  # as torch counts them
    cpus = len(affinity(0)) if affinity else os.cpu_count()
    if cpus is not None and num_workers > cpus:
        cpuset = "" if affinity else " (`cpuset` is not taken into account)"
        warnings.warn(
            f"This DataLoader will create {num_workers} worker threads in total. Our "
            f"suggested max number of worker in current system is {cpus}{cpuset}, which is "
            "smaller than what this DataLoader is going to create. Please be aware that "
            "excessive worker creation might get DataLoader running slow or even freeze, "
            "lower the worker number to avoid potential slowness/freeze if necessary.",
            stacklevel=4)
