"""Iterators shared by both paths, and the one without workers (``num_workers=0``).

``BaseIter`` holds what every iterator does per batch: sampler and epoch bookkeeping, pinning,
counting, the length warning of iterable datasets, stage timings. ``SingleIter`` fetches in the
calling thread; ``WorkerIter`` (``_host/worker_iter.py``) fetches through a worker pool and the
ring.
"""

from __future__ import annotations

import time
import warnings
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import IterableDataset

from .._base import cuda as _cuda
from .._memory import pinning as _pinning
from .._memory.pinning import pin_batch, pin_device_index
from .._order.resume import capture_state
from .._order.shards import ShardInfo, set_shard_info
from .fetch import IterFetcher, MapFetcher

if TYPE_CHECKING:
    from .._loader import DataLoader


class BaseIter:
    """What both iterators share: sampler, seed, pinning, length, counting."""

    def __init__(self, loader: DataLoader) -> None:
        # Weak: a persistent loader keeps its iterator (``_iterator``), and a strong reference
        # back would make a cycle that only the garbage collector frees, keeping the workers
        # alive after ``del it, loader`` (NOTE [ Shutdown ] in _host/pool.py).
        self._loader_ref = weakref.ref(loader)
        self._dataset = loader.dataset
        self._is_iterable = isinstance(loader.dataset, IterableDataset)
        self._auto_collation = loader._auto_collation
        self._index_sampler = loader._index_sampler
        self._collate_fn = loader.collate_fn
        self._drop_last = loader.drop_last
        if loader.pin_memory and not (torch.accelerator.is_available() or _pinning.cuda_usable()):
            warnings.warn(
                "'pin_memory' argument is set as true but no accelerator is found, "
                "then device pinned memory won't be used.",
                stacklevel=3,
            )
        # A CUDA device stage needs page-locked batches to copy asynchronously: pin then too.
        on_cuda = loader.device is not None and loader.device.type == "cuda"
        self._pin = (loader.pin_memory or on_cuda) and _pinning.cuda_usable()
        # The device pinning, registration and release fences run under (resolved now).
        self._pin_device = (
            pin_device_index(loader.device, loader.pin_memory_device) if self._pin else None
        )
        self._sample_seed = loader.seed if loader.deterministic else None
        self._begin_epoch()
        self._base_seed = int(
            torch.empty((), dtype=torch.int64).random_(generator=loader.generator).item()
        )
        self._num_yielded = 0
        self._len_called = loader._IterableDataset_len_called
        self._rec = loader._recorder
        self._returned_at = 0.0  # when the last batch was handed over (for "step")

    @property
    def _loader(self) -> DataLoader:
        loader = self._loader_ref()
        if loader is None:  # only epoch starts need it, and the loader starts them
            raise RuntimeError("the gpufeed DataLoader of this iterator was deleted")
        return loader

    def __iter__(self) -> BaseIter:
        return self

    def __len__(self) -> int:
        return len(self._index_sampler)

    def _begin_epoch(self) -> None:
        """Start the epoch's index plan and delivery count (NOTE [ Delivery tracking ] in
        ``_order/resume.py``); resumes where ``loader.load_state_dict`` said."""
        loader = self._loader
        self._tracker = loader._progress.begin_epoch(loader, direct=loader.device is None)
        self._sampler_iter = self._tracker.indices

    def _next_indices(self) -> Any:
        idx = next(self._sampler_iter)
        if self._is_iterable and self._auto_collation:
            return len(idx)  # iterable datasets take a count, not indices
        return idx

    def _finish(
        self, data: Any, asked_at: float, k: int, worker_state: tuple[int, Any] | None = None
    ) -> Any:
        """Hand batch ``k`` of this epoch (the iterator's count) to the user."""
        now = time.perf_counter()
        rec = self._rec
        if self._returned_at:
            rec.add("step", busy_s=asked_at - self._returned_at)
        rec.add("wait", blocked_s=now - asked_at)
        rec.count("batches")
        self._num_yielded += 1
        if (
            self._is_iterable
            and self._len_called is not None
            and self._num_yielded > self._len_called
        ):
            warnings.warn(
                f"Length of IterableDataset {self._dataset} was reported to be "
                f"{self._len_called} (when accessing len(dataloader)), but "
                f"{self._num_yielded} samples have been fetched.",
                stacklevel=3,
            )
        if self._pin:
            with _cuda.device_guard(self._pin_device):
                data = pin_batch(data)
        self._tracker.produced_nth(k, worker_state)
        self._returned_at = time.perf_counter()
        return data

    def _check_capture(self) -> None:
        """A batch cannot be fetched inside CUDA graph capture: pinning and the ring's
        release fences are CUDA calls that capture forbids or would record into the graph."""
        if self._pin and _cuda.capturing(self._pin_device):
            raise RuntimeError(
                "next() on a gpufeed DataLoader was called while the current CUDA stream is "
                "capturing a graph; fetch the batch before torch.cuda.graph(...) and copy it "
                "into the graph's static input tensors (static_x.copy_(batch)) inside or "
                "before replay, never iterate the loader during capture"
            )

    def close(self) -> None:
        """Stop workers and release memory; idempotent."""

    def __enter__(self) -> BaseIter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SingleIter(BaseIter):
    """``num_workers=0``: fetch in the calling thread (batched gather where possible)."""

    def __init__(self, loader: DataLoader) -> None:
        super().__init__(loader)
        self._fetcher: MapFetcher | IterFetcher
        if self._is_iterable:
            self._fetcher = IterFetcher(
                self._dataset, auto_collation=self._auto_collation,
                collate_fn=self._collate_fn, drop_last=self._drop_last,
            )
        else:
            self._fetcher = MapFetcher(
                self._dataset, auto_collation=self._auto_collation, collate_fn=self._collate_fn,
                seed=self._sample_seed,
            )
        set_shard_info(ShardInfo(loader.rank, loader.world_size, 0, 1))
        self._load_dataset_state()

    def _load_dataset_state(self) -> None:
        resumed = self._loader._progress.take_dataset_states()
        if resumed is not None and isinstance(self._fetcher, IterFetcher):
            self._fetcher.reset(resumed.states[0])

    def __next__(self) -> Any:
        self._check_capture()
        asked_at = time.perf_counter()
        try:
            indices = self._next_indices()
            self._fetcher.epoch = self._tracker.epoch
            data = self._fetcher.fetch(indices, None)
        except StopIteration:
            self._tracker.host_exhausted()
            raise
        fetched = time.perf_counter()
        self._rec.add("fetch", busy_s=fetched - asked_at - self._fetcher.collate_s)
        self._rec.add("collate", busy_s=self._fetcher.collate_s)
        state = (0, capture_state(self._dataset)) if self._is_iterable else None
        return self._finish(data, fetched, self._num_yielded, state)

    def _reset(self, loader: DataLoader, first_iter: bool = False) -> None:
        self._begin_epoch()
        self._load_dataset_state()
        self._num_yielded = 0
