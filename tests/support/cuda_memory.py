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


def finish_closed_rings() -> int:
    """Wait for the fences of closed rings and unregister their released slots (what the
    keeper's ``reap_closed`` does without waiting); how many closed rings still hold slots the
    user holds."""
    with _keeper._reaping:
        _pinning.retry_stranded()
        for ring in list(_keeper._closing):
            if ring.reap(wait=True):
                _keeper._forget(ring)
    return len(_keeper._closing)


def at_rest() -> tuple[int, int]:
    """(registered host bytes, allocated device bytes) once everything dropped is released."""
    gc.collect()
    torch.cuda.synchronize()
    finish_closed_rings()
    return _pinning.registered_bytes(), torch.cuda.memory_allocated()
