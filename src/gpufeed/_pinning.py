"""Page-locked ("pinned") host memory: register existing memory, pin fallback batches.

Two ways to get memory the GPU can read by DMA, and where gpufeed uses each:

* ``register(t)`` page-locks memory that already exists (``cudaHostRegister`` on the
  bytes of ``t``). The loader calls it once per slot of its shared ring, when the slot is
  carved, so every batch a worker writes into a slot is pinned with no per-batch copy;
  ``unregister(handle)`` undoes it when the slot is retired or the ring closes.
  Portable flag: the pages are pinned for every CUDA context.
* ``pin_batch(batch)`` copies an ordinary batch (one that fell back to ordinary
  allocation) into pinned memory the ordinary way, ``Tensor.pin_memory()``, leaf by leaf.

Without CUDA (CPU-only build, or no device) both are no-ops: ``register`` returns None and
``pin_batch`` returns the batch unchanged. ``is_pinned(t)`` never raises.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any

import torch

from ._tree import tree_map

__all__ = [
    "PinnedRegion", "cuda_usable", "is_pinned", "pin_batch", "register", "registered_bytes",
    "unregister",
]

logger = logging.getLogger(__name__)

_PORTABLE = 1  # cudaHostRegisterPortable
_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered
_lock = threading.Lock()
_refcounts: dict[tuple[int, int], int] = {}  # (ptr, nbytes) -> live handles we own


class PinnedRegion:
    """Handle returned by :func:`register`; pass it to :func:`unregister`.

    ``ptr`` and ``nbytes`` describe the page-locked storage. ``owned`` is False when the
    memory was already pinned by someone else (then unregistering leaves it pinned).
    ``active`` turns False after the first :func:`unregister`.
    """

    __slots__ = ("active", "nbytes", "owned", "ptr")

    def __init__(self, ptr: int, nbytes: int, *, owned: bool) -> None:
        self.ptr = ptr
        self.nbytes = nbytes
        self.owned = owned
        self.active = True

    def __repr__(self) -> str:
        state = "active" if self.active else "released"
        return f"PinnedRegion(ptr={self.ptr:#x}, nbytes={self.nbytes}, owned={self.owned}, {state})"


def cuda_usable() -> bool:
    """True when this torch build has CUDA and at least one device is visible."""
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # broken driver install: behave as CPU-only
        return False


def is_pinned(t: torch.Tensor) -> bool:
    """Whether ``t`` lives in page-locked host memory. False (never an error) without CUDA."""
    if t.device.type != "cpu" or not cuda_usable():
        return False
    try:
        return bool(t.is_pinned())
    except RuntimeError:
        return False


def register(t: torch.Tensor) -> PinnedRegion | None:
    """Page-lock the bytes of contiguous CPU tensor ``t`` with ``cudaHostRegister``.

    Returns a :class:`PinnedRegion` handle, or None when there is nothing to do (no CUDA,
    empty storage). Idempotent per region: registering the same storage again returns a
    new handle on the same registration (reference counted), and memory that is already
    pinned (e.g. from ``pin_memory()``) gets a handle that does not own it.

    Cost: registering faults in and locks every page up front, in time proportional to the
    size (once per ring, never per batch). The pages count against the locked-memory limit
    (``ulimit -l``) and cannot be swapped out until unregistered.

    Raises:
        TypeError: ``t`` is not a tensor.
        ValueError: ``t`` is not on the CPU.
        RuntimeError: the CUDA runtime refused (message names the CUDA error and the fix).
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"register() expects a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"register() expects a CPU tensor, got one on {t.device}")
    if not t.is_contiguous():
        raise ValueError("register() expects a contiguous tensor (a byte range of memory)")
    # Exactly t's bytes, not its whole storage: the ring registers one page-aligned slot at a
    # time inside a sparse region that may reserve far more address space than it touches.
    ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
    if nbytes == 0 or not cuda_usable():
        return None
    key = (ptr, nbytes)
    with _lock:
        if key in _refcounts:
            _refcounts[key] += 1
            return PinnedRegion(ptr, nbytes, owned=True)
        if is_pinned(t):  # pinned elsewhere: share it, never unregister it
            return PinnedRegion(ptr, nbytes, owned=False)
        cudart = torch.cuda.cudart()
        code = int(cudart.cudaHostRegister(ptr, nbytes, _PORTABLE))
        if code != 0:
            _drain_last_error(cudart)
            hint = (
                "Part of this memory is already page-locked (an overlapping region was "
                "registered): register the whole region once, before any part of it."
                if code == _ALREADY_REGISTERED
                else "Check the locked-memory limit (`ulimit -l`, RLIMIT_MEMLOCK) and free "
                "host memory, or pass pin_memory=False to go without pinned memory."
            )
            raise RuntimeError(
                f"cudaHostRegister of {nbytes} bytes at {ptr:#x} failed: "
                f"{_error_name(cudart, code)} (cudaError {code}). {hint}"
            )
        _refcounts[key] = 1
        return PinnedRegion(ptr, nbytes, owned=True)


def unregister(h: PinnedRegion | None) -> None:
    """Undo :func:`register`. Safe on None and safe to call twice on one handle.

    The storage must stay alive until this returns, and no copy from it may still be in
    flight (wait on the copy's event first): unregistering pages under a running DMA is
    undefined behaviour in CUDA.
    """
    if h is None or not h.active:
        return
    h.active = False
    if not h.owned:
        return
    key = (h.ptr, h.nbytes)
    with _lock:
        left = _refcounts.get(key, 0) - 1
        if left > 0:
            _refcounts[key] = left
            return
        _refcounts.pop(key, None)
        cudart = torch.cuda.cudart()
        code = int(cudart.cudaHostUnregister(h.ptr))
        if code != 0:
            _drain_last_error(cudart)
            raise RuntimeError(
                f"cudaHostUnregister at {h.ptr:#x} failed: {_error_name(cudart, code)} "
                f"(cudaError {code}). The memory may have been freed before unregister(); "
                "keep the tensor alive until unregister() returns."
            )


def registered_bytes() -> int:
    """Bytes currently page-locked through :func:`register` in this process."""
    with _lock:
        return sum(nbytes for (_, nbytes) in _refcounts)


def pin_batch(batch: Any) -> Any:
    """Return ``batch`` with every CPU tensor leaf in pinned memory (``pin_memory()``).

    For batches that fell back to ordinary allocation: costs one host copy per leaf from
    torch's caching pinned allocator. Already pinned leaves are kept as they are. Without
    CUDA the batch is returned unchanged.
    """
    if not cuda_usable():
        return batch

    def pin(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.device.type == "cpu" and not is_pinned(x):
            return x.pin_memory()
        return x

    return tree_map(pin, batch)


def _error_name(cudart: Any, code: int) -> str:
    try:
        return str(cudart.cudaGetErrorString(cudart.cudaError(code)))
    except Exception:
        return "unknown CUDA error"


def _drain_last_error(cudart: Any) -> None:
    """Consume the error a failed runtime call left behind (best effort).

    A failed ``cudaHostRegister`` leaves a pending per-thread error; torch's next kernel
    launch check (``cudaGetLastError``) would then raise it against an unrelated op.
    torch's own binding exposes ``cudaGetLastError`` only in some versions, so fall back to
    every libcudart mapped into this process (wheels bundle it as ``libcudart-<hash>``).
    """
    getter = getattr(cudart, "cudaGetLastError", None)
    if getter is not None:
        getter()
        return
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(None, 5)[-1].strip() for line in maps if "libcudart" in line}
    except OSError:
        return
    for path in paths:
        path = path.removesuffix(" (deleted)")
        try:
            ctypes.CDLL(path).cudaGetLastError()
        except (OSError, AttributeError):
            logger.debug("could not clear the CUDA error through %s", path)
