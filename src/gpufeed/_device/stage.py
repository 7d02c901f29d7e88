"""Device stage: host-to-device prefetch on a side CUDA stream, for any iterable of batches:
what ``gpufeed.DataLoader(device=...)`` returns, and as good over a stock loader. Its modules,
one concept each, are listed in docs/how-it-works/module-map.md; its protocol is NOTE
[ Device stage: streams, events and slots ] in ``prefetch.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from .prefetch import DeviceIterator
from .streams import SyncBackend


def to_device(
    iterable: Iterable[Any],
    device: str | int | torch.device,
    *,
    depth: int = 2,
    transform: Callable[[Any], Any] | None = None,
    recorder: Any | None = None,
    backend: SyncBackend | None = None,
) -> DeviceIterator:
    """Iterate over ``iterable``'s batches moved to ``device``, prefetched ``depth`` ahead.

    Batches may be tensors or nests of tuples, lists, dicts, namedtuples and dataclasses;
    non-tensor leaves pass through. For a CUDA device the copies run on a side stream and
    overlap the training step; for "cpu" this is a pass-through (plus ``transform``).

    Args:
        iterable: any iterable of batches, e.g. a ``torch.utils.data.DataLoader``. For
            overlapping copies its tensors must be in pinned memory (``pin_memory=True``).
        device: target, e.g. "cuda", "cuda:1", "cpu" or a ``torch.device``.
        depth: batches copied ahead of the one being used (>= 1). Each costs one batch of
            device memory (after ``transform``) and one held host batch; 2 hides a copy
            as long as a step; raise it only for bursty sources. It also bounds how many
            steps the CPU may run ahead of the GPU (NOTE [ Device stage: streams, events
            and slots ] rule (8)): device memory used is at most 2 * depth + 1 batches, + 1
            while a ``for`` loop still holds the previous batch as ``next()`` runs.
        transform: callable ``batch -> batch`` run on the device, on the side stream, right
            after the copy (e.g. ``gpufeed.Normalize``): ship uint8, compute in float there.
            Its outputs must be tensors in the batch's containers (they get
            ``record_stream``); tensors hidden in other objects are not protected.
        recorder: optional stats recorder (``add``/``occupancy``/``count``), fed the
            "transfer" stage and the "pageable_batches" and "consumer_waits" counters.
        backend: streams/events/copies provider; the default suits the device. For tests
            and other accelerators.

    Returns:
        A :class:`DeviceIterator`: ``close()``, context manager, ``len()`` when the source
        has one, ``stats()`` with device bytes held now and at peak.
    """
    return DeviceIterator(
        iterable, device, depth=depth, transform=transform, recorder=recorder, backend=backend
    )
