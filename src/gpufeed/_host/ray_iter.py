"""The iterator of a loader over Ray Data: Ray's batches taken in the loop's own thread.

Ray's iterator already fetches ahead in threads of its own; why no gpufeed thread is added:
NOTE [ Ray Data batches ] in ``_sources/ray.py`` (rules 2 and 6).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from typing import Any, cast

import torch

from .._base import cuda as _cuda
from .._base import timeline as _timeline
from .._memory import pinning as _pinning
from .._sources.arrays import Alloc
from .._sources.ray import RayBatches
from .config import IterConfig
from .iterator import BaseIter


def pinned_memory(device: int | None, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Page-locked memory for a batch's column, under ``device``'s guard (NOTE [ Registered
    memory lifetime ] rule (5) in ``_memory/pinning.py``)."""
    with _cuda.device_guard(device):
        return _pinning.pinned_empty(shape, dtype)


class RayIter(BaseIter):
    """One pass of a ``RayBatches`` (Ray's iterator) per epoch, in the calling thread."""

    def __init__(self, config: IterConfig) -> None:
        super().__init__(config)
        self._ray = cast(RayBatches, config.dataset)
        # A CUDA device stage copies from page-locked memory: the batch is built there, from
        # torch's caching host allocator, so it needs no second copy to be pinned.
        self._alloc: Alloc | None = functools.partial(
            pinned_memory, config.pin_device) if config.pin else None
        self._batches: Iterator[Any] | None = None
        self._restart(config.sample_seed, first_iter=True)

    def _restart(self, sample_seed: int | None, first_iter: bool = False) -> None:
        if not first_iter:
            self._begin_epoch()
            self._num_yielded = 0
        self._position.take_dataset_states()  # nothing to load (rule (4))
        self.close_ray()
        self._batches = self._ray.batches(self._alloc)  # Ray's iterator starts at the first next

    def _next(self) -> Any:
        self._check_capture()
        self._begin_again_if_set_late()
        asked_at = time.perf_counter()
        k, self._drawn = self._drawn, self._drawn + 1
        if self._batches is None:  # closed
            raise StopIteration
        try:
            data = next(self._batches)
            fetched = time.perf_counter()
            collate = self._collate_fn
            if self._ray.raw and collate is not None:  # the user's gets Ray's batch (rule (3))
                data = collate(data)
        except StopIteration:
            self._tracker.host_exhausted()
            raise
        except Exception:  # as Ray raised it (rule (5))
            if self._direct:  # (else the device stage's Delivered counts it)
                self._tracker.fetch_failed()
            raise
        self._fetched_here(asked_at, fetched, time.perf_counter())
        return self._finish(data, asked_at, k, (0, {}))

    def _label(self, tl: _timeline.Timeline) -> None:
        tl.label(self._recorder, None, "gpufeed.DataLoader over Ray Data")

    def close_ray(self) -> None:
        """Close this pass of Ray's iterator now (rule (6)): Ray shuts its executor down."""
        batches, self._batches = self._batches, None
        close = getattr(batches, "close", None)
        if close is not None:
            close()

    def close(self) -> None:
        self.close_ray()
        self._closed = True
