"""Streams, events and copies for the device stage: the backend interface of ``to_device``.

``DeviceIterator`` (``_device/prefetch.py``) never calls ``torch.cuda`` itself; it asks a backend:

    SyncBackend   blocking copies, no streams, events complete at once ("cpu": a pass-through)
    CudaBackend   torch.cuda streams and events, ``non_blocking`` copies
    (tests)       a simulated CUDA backend (``tests/support/sim_cuda.py``)
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import torch

from .._base import cuda as _cuda
from .._memory import pinning as _pinning


class Event(Protocol):
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class _Done:
    """An event that has always completed (the synchronous backend's)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


DONE = _Done()


class SyncBackend:
    """The backend interface, implemented synchronously (see the module's table); for "cpu"
    ``copy`` returns the tensor itself. ``CudaBackend`` and test fakes override every method."""

    needs_pinned = False  # True when copies overlap only from pinned host memory
    gpu_clock = False  # True when timed_event / elapsed_ms give the stream's own times

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def new_stream(self) -> Any:  # the side stream, made once per iterator
        return None

    def current_stream(self) -> Any:  # the consumer's stream, asked at each handover
        return None

    def guard(self) -> AbstractContextManager[Any]:
        """Make the target the current device for the calls inside (no context elsewhere)."""
        return nullcontext()

    def capturing(self) -> bool:
        """Whether the consumer's stream is capturing a CUDA graph now."""
        return False

    def use_stream(self, stream: Any) -> AbstractContextManager[Any]:
        return nullcontext()

    def record_event(self, stream: Any) -> Event:
        return DONE

    def wait_event(self, stream: Any, event: Event) -> None:
        return None

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device)

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        return None

    def on_device(self, t: torch.Tensor) -> bool:
        """Whether ``t`` already lives on the target device (the copy returns it as is)."""
        return t.device == self.device

    def is_pinned(self, t: torch.Tensor) -> bool:
        return False


class CudaBackend(SyncBackend):
    """``torch.cuda`` streams and events, ``non_blocking`` copies.

    Semantics relied on (torch 2.x, CUDA runtime): ``Stream.wait_event`` makes the stream
    wait on the GPU, the CPU does not block; ``Event.query`` never blocks; a copy issued
    inside ``torch.cuda.stream(s)`` is enqueued on ``s`` and its result is allocated from
    ``s``'s pool of the caching allocator; ``Tensor.record_stream(c)`` keeps that memory from
    being reused until the work queued on ``c`` when the tensor is freed has completed.
    """

    needs_pinned = True
    gpu_clock = True

    def timed_event(self, stream: Any) -> torch.cuda.Event:
        """An event with timing on ``stream`` (the device stage's trace, ``_device/timing.py``)."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return float(start.elapsed_time(end))

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=self.device)

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)  # the target's, whatever device is current

    def guard(self) -> AbstractContextManager[Any]:
        return _cuda.device_guard(self.device.index)

    def capturing(self) -> bool:
        return _cuda.capturing(self.device.index)

    def use_stream(self, stream: Any) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def record_event(self, stream: Any) -> Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True)

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        if t.device.type == "cuda":
            t.record_stream(stream)

    def is_pinned(self, t: torch.Tensor) -> bool:
        # The bytes the DMA reads, not the storage's first byte (Tensor.is_pinned's view):
        # a slot of the ring is a slice of one region whose storage starts elsewhere.
        return _pinning.is_pinned(t)


def backend_for(device: torch.device) -> SyncBackend:
    return CudaBackend(device) if device.type == "cuda" else SyncBackend(device)


def parse_device(device: Any, *, injected: bool = False, resolve: bool = True) -> torch.device:
    """``device`` as a ``torch.device`` (CUDA: with its index), or an error that names the value
    and the fix. ``injected``: a custom backend is given, so CUDA need not be available.
    ``resolve=False`` leaves a bare "cuda" without index, for a loader to resolve when
    iteration starts (users call ``torch.cuda.set_device(local_rank)`` after building it)."""
    if isinstance(device, bool) or not isinstance(device, str | int | torch.device):
        raise TypeError(
            f"device must be a str, int or torch.device, got {type(device).__name__} "
            f"({device!r}); use e.g. device='cuda' or device='cpu'"
        )
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(
            f"device={device!r} is not a valid torch device; use e.g. 'cuda', 'cuda:0' or 'cpu'"
        ) from None
    if dev.type != "cuda" or injected:
        return dev
    if not _pinning.cuda_usable():
        raise RuntimeError(
            f"device={device!r} but CUDA is not available (torch {torch.__version__}); install a "
            "CUDA build of torch and check the driver, or use device='cpu'"
        )
    count = _cuda.device_count()
    if dev.index is None and not resolve:
        return dev
    index = _cuda.current_device() if dev.index is None else dev.index
    if not 0 <= index < count:
        raise ValueError(f"device={device!r} but only {count} CUDA device(s) are visible")
    return torch.device("cuda", index)
