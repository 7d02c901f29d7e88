"""Support for the real-GPU tests (not a test module): page-locked and device memory at rest.

A loader keeps its pinned ring registered from one epoch to the next, and a ring closed while
a copy from it may still run is unregistered later, once its release fences have passed
(NOTE [ Slot lifetime ] (e) in ``_memory/ring.py``). So a test that measures what a loader
gives back first lets the GPU finish and earlier tests' closed rings go."""

from __future__ import annotations

import gc

import torch

from gpufeed._memory import keeper as _keeper
from gpufeed._memory import pinning as _pinning


def at_rest() -> tuple[int, int]:
    """(registered host bytes, allocated device bytes) once everything dropped is released."""
    gc.collect()
    torch.cuda.synchronize()
    _keeper.finish_closed_rings()
    return _pinning.registered_bytes(), torch.cuda.memory_allocated()
