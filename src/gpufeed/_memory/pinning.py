"""Page-locked ("pinned") host memory: register existing memory, pin fallback batches.

* ``register(t)`` page-locks memory that already exists (``cudaHostRegister``, portable: for
  every CUDA context). The loader registers each slot of its ring once, when it is carved, so
  a batch written into a slot needs no per-batch copy; ``unregister(handle)`` undoes it.
* ``pin_batch(batch)`` copies a batch that fell back to ordinary allocation into pinned memory
  the ordinary way, ``Tensor.pin_memory()``, leaf by leaf.

Without CUDA both are no-ops (``register`` returns None, ``pin_batch`` the batch unchanged), and
``is_pinned(t)`` never raises.

NOTE [ Registered memory lifetime ]
-----------------------------------
    register(t, device=d, fences=F) ──► under device d: cudaHostRegister(ptr, n)
                                    ──► handle keeps ``t`` (so its mapping) and F alive
    unregister(h)           ──► wait for every tracked Fences (device stages' copies)
                                ──► under device d: cudaHostUnregister ──► drop ``t``
    unregister(h, settled=False): first an event on the current streams of every device
                                with a context into F, and a wait for F

(1) Pinned means "the bytes at this address are page-locked". ``Tensor.is_pinned()`` asks
    about the first byte of the tensor's *storage*, and a slice ``region[off:off+n]`` keeps
    the region's storage: it would answer for offset 0. ``is_pinned`` here probes the tensor's
    own first and last byte (CUDA reports registered memory as host memory too).
(2) Never unmapped while registered: the handle holds the registered tensor until
    ``cudaHostUnregister`` returns, whatever order its owner drops things in. A handle
    collected while active unregisters itself.
(3) Never unregistered under a pending copy. The ring unregisters only free slots, past their
    fences (``settled``: NOTE [ Slot lifetime ] (d), (e) in ``_memory/ring.py``). What may
    still read a free slot is a device stage's copy whose host batch a collection dropped
    early: the stages' ``Fences`` are held here while tracked (``track_copies``), and every
    ``unregister`` waits for them. A handle collected while active (its ring collected
    without ``close``) is not settled (the diagram's last line). Nothing here is weak, so
    garbage collection may tear a ring, its handles and a device stage down in any order.
(4) Per process: a forked child forgets the bookkeeping, and handles do nothing outside the
    process that registered them (the child has no CUDA context to call).
(5) Device guard. Every call that touches CUDA for a loader's device (register, unregister,
    the capture check, ``pin_batch``) runs under ``torch.cuda.device(d)``: under torchrun
    rank 3 creates no context on GPU 0. Release events need none (torch guards each stream's
    device, and only devices with a context get one). ``d`` is None for callers that name no
    device, and for a pinned ring without ``device=`` until its first registration (asking
    earlier would initialise CUDA before the workers fork): then the current device is used.
(6) Failure. ``register`` raises RuntimeError naming the CUDA error and the fix; the ring
    turns that into one warning and goes on unregistered (``_memory/release.py``).
(7) Interrupted. ``unregister`` waits before it changes anything: a Ctrl-C or error in the
    wait leaves the memory registered, counted and mapped, and the handle active, and calling
    it again finishes (marked released first, the memory would stay registered for good, and
    a later ring mapped at the same address would fail with error 712). A handle whose
    collection could not unregister passes what it holds to a new one in ``_stranded``, which
    every reap of closed rings retries (``retry_stranded``); a Ctrl-C there is raised again
    in the main thread (NOTE [ Ctrl-C and slot releases ]).

``cuda_usable``, ``_pinned_ptr``, ``pin``, ``pinned_empty`` and ``torch.cuda.cudart()`` ask CUDA
directly; the simulated backend of the tests (tests/support/sim_cuda.py) replaces exactly those
and the seams of ``_base/cuda.py``, so the guards placed around them are tested.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import threading
from typing import Any

import torch

from .._base import cuda as _cuda
from .._base.cuda import Fences
from .._base.interrupts import interrupt_main_later
from .._base.tree import byte_extent, tree_map

logger = logging.getLogger(__name__)

_PORTABLE = 1  # cudaHostRegisterPortable
_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered
# Reentrant: a handle collected while a register() holds the lock unregisters itself.
_lock = threading.RLock()
_refcounts: dict[tuple[int, int], int] = {}  # (ptr, nbytes) -> live handles we own
_tracked: set[Fences] = set()  # NOTE [ Registered memory lifetime ] rule (3): strong on purpose
_stranded: list[PinnedRegion] = []  # collected while active, their unregister interrupted


def _forget_after_fork() -> None:  # NOTE [ Registered memory lifetime ] rule (4)
    global _lock, _refcounts, _tracked, _stranded
    _lock = threading.RLock()  # another thread may have held it at the fork
    _refcounts = {}
    _tracked = set()
    _stranded = []


def retry_stranded() -> None:
    """Unregister the handles whose collection could not (rule 7); never raises."""
    for h in list(_stranded):
        try:
            unregister(h)
        except Exception as e:
            logger.debug("stranded registration not undone yet: %s", e)
            continue
        if h in _stranded:
            _stranded.remove(h)


os.register_at_fork(after_in_child=_forget_after_fork)


@dataclasses.dataclass(eq=False, repr=False, slots=True)
class PinnedRegion:
    """Handle returned by :func:`register`; pass it to :func:`unregister`.

    ``owned`` is False when the memory was already pinned by someone else (unregistering then
    leaves it pinned; such a handle keeps nothing). ``keep``: the registered tensor, held
    while active (rule (2)). ``active`` turns False at the first :func:`unregister`.
    """

    ptr: int
    nbytes: int
    owned: bool
    keep: torch.Tensor | None = None
    device: int | None = None
    fences: Fences | None = None
    active: bool = True
    pid: int = dataclasses.field(default_factory=os.getpid)

    def __del__(self) -> None:
        if getattr(self, "active", False) and self.owned:
            try:
                unregister(self)
            except BaseException as e:  # never unmapped while registered: tried again later
                if self.active and self.pid == os.getpid() and _stranded is not None:
                    _stranded.append(self._copy())  # (None: the interpreter is exiting)
                if isinstance(e, KeyboardInterrupt):  # not swallowed by the finalizer
                    interrupt_main_later()

    def _copy(self) -> PinnedRegion:
        """A handle on the same registration, holding what this one held."""
        other = dataclasses.replace(self)
        self.active, self.keep = False, None
        return other

    def __repr__(self) -> str:
        state = "active" if self.active else "released"
        return f"PinnedRegion(ptr={self.ptr:#x}, nbytes={self.nbytes}, owned={self.owned}, {state})"


def cuda_usable() -> bool:
    """True when this torch build has CUDA and at least one device is visible."""
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # broken driver install: behave as CPU-only
        return False


def pin(t: torch.Tensor) -> torch.Tensor:
    """A page-locked copy of ``t`` from torch's caching host allocator."""
    return t.pin_memory()


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor from the allocator ``pin`` copies into: a batch built in it
    needs no second copy to be pinned. Call it under the loader's device guard (rule 5)."""
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def is_pinned(t: torch.Tensor) -> bool:
    """Whether ``t``'s own bytes are page-locked (rule (1)); False, never an error, without
    CUDA or for an empty tensor."""
    if t.device.type != "cpu" or t.numel() == 0 or not cuda_usable():
        return False
    first = t.data_ptr()
    last = first + byte_extent(t) - 1
    return _pinned_ptr(first) and (last == first or _pinned_ptr(last))


def _pinned_ptr(ptr: int) -> bool:
    """``is_pinned()`` of a one-byte tensor whose storage starts exactly at ``ptr``."""
    try:
        probe = torch.frombuffer((ctypes.c_uint8 * 1).from_address(ptr), dtype=torch.uint8)
        return bool(probe.is_pinned())
    except (RuntimeError, ValueError):
        return False


def register(
    t: torch.Tensor, *, device: int | None = None, fences: Fences | None = None
) -> PinnedRegion | None:
    """Page-lock the bytes of contiguous CPU tensor ``t`` with ``cudaHostRegister``, under
    ``device`` (rule (5)); ``fences``: events to pass before it is unregistered (rule (3)).

    Returns a :class:`PinnedRegion`, or None without CUDA or for empty storage. Registering
    the same bytes again gives a new handle on the same registration (reference counted);
    memory already pinned (``pin_memory()``) gets a handle that does not own it.

    Cost: every page is faulted in and locked up front, in time proportional to the size
    (once per slot, never per batch); the pages count against ``ulimit -l`` and cannot be
    swapped out until unregistered. Raises TypeError or ValueError for a tensor it cannot
    register, RuntimeError naming the CUDA error and the fix when CUDA refuses (rule (6)).
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
            return PinnedRegion(ptr, nbytes, owned=True, keep=t, device=device, fences=fences)
        # Pinned elsewhere (pin_memory(), or a registration that covers this range): share
        # it, never unregister it. The probe is at ptr itself, not at t's storage (rule 1).
        if _pinned_ptr(ptr):
            return PinnedRegion(ptr, nbytes, owned=False)
        with _cuda.device_guard(device):
            cudart = torch.cuda.cudart()
            code = int(cudart.cudaHostRegister(ptr, nbytes, _PORTABLE))
            if code != 0:
                _cuda.drain_last_error(cudart)
        if code != 0:
            hint = (
                "Part of this memory is already page-locked (an overlapping region was "
                "registered): register the whole region once, before any part of it."
                if code == _ALREADY_REGISTERED
                else "Check the locked-memory limit (`ulimit -l`, RLIMIT_MEMLOCK) and free "
                "host memory, or pass pin_memory=False to go without pinned memory."
            )
            raise RuntimeError(
                f"cudaHostRegister of {nbytes} bytes at {ptr:#x} failed: "
                f"{_cuda.error_name(cudart, code)} (cudaError {code}). {hint}"
            )
        _refcounts[key] = 1
        return PinnedRegion(ptr, nbytes, owned=True, keep=t, device=device, fences=fences)


def unregister(h: PinnedRegion | None, *, settled: bool = False) -> None:
    """Undo :func:`register`; safe on None and twice on one handle.

    Waits first for pending copies (rule (3)), since unregistering pages under a running DMA
    is undefined behaviour in CUDA; ``settled``: the caller knows no release of this memory
    is pending (a free ring slot). Interrupted, it can be called again (rule (7)). In a forked
    child it only marks the handle released (rule (4)).
    """
    if h is None or not h.active:
        return
    if not h.owned or h.pid != os.getpid():
        h.active, h.keep = False, None
        return
    _wait_for_copies(h, settled)
    with _lock:
        if not h.active:  # finished meanwhile (by a collection inside the wait, say)
            return
        key = (h.ptr, h.nbytes)
        left = _refcounts.get(key, 0) - 1
        if left > 0:  # another handle on the same registration still needs it
            _refcounts[key] = left
            h.active, h.keep = False, None
            return
        with _cuda.device_guard(h.device):
            cudart = torch.cuda.cudart()
            code = int(cudart.cudaHostUnregister(h.ptr))
            h.active = False
            _refcounts.pop(key, None)
            keep, h.keep = h.keep, None
            del keep  # only now may the memory be unmapped
            if code != 0:
                _cuda.drain_last_error(cudart)
        if code != 0:
            raise RuntimeError(
                f"cudaHostUnregister at {h.ptr:#x} failed: {_cuda.error_name(cudart, code)} "
                f"(cudaError {code}). Was this range unregistered by other code (e.g. "
                "cudart().cudaHostUnregister called directly)? Unregister only through its "
                "handle."
            )


def track_copies(fences: Fences) -> None:
    """Make :func:`unregister` wait for ``fences`` first (held strongly until untracked)."""
    with _lock:
        _tracked.add(fences)


def untrack_copies(fences: Fences) -> None:
    with _lock:
        _tracked.discard(fences)


def _wait_for_copies(h: PinnedRegion, settled: bool) -> None:
    if not settled and h.fences is not None:
        if _cuda.cuda_initialized() and h.device is not None:  # copies from memory still held
            h.fences.add(_cuda.release_event(h.device))
        h.fences.wait()
    for fences in list(_tracked):
        fences.wait()


def pin_device_index(device: torch.device | None, pin_memory_device: str = "") -> int | None:
    """The device a loader's pinned ring serves (rule (5)): its ``device=``, else a CUDA
    ``pin_memory_device``, else the current device; None while CUDA is not initialised."""
    if device is not None and device.type == "cuda" and device.index is not None:
        return device.index
    if device is None and pin_memory_device:
        pmd = torch.device(pin_memory_device)
        if pmd.type == "cuda" and pmd.index is not None:
            return pmd.index
    return _cuda.current_device() if _cuda.cuda_initialized() else None


def registered_bytes() -> int:
    """Bytes currently page-locked through :func:`register` in this process."""
    with _lock:
        return sum(nbytes for (_, nbytes) in _refcounts)


def pin_batch(
    batch: Any, registered: tuple[int, int] | None = None, *, device: int | None = None
) -> Any:
    """``batch`` with every CPU tensor leaf in pinned memory: one host copy per leaf not
    pinned yet. ``registered``: an address range ``[start, end)`` known to be page-locked (the
    ring slot the batch was written into), whose leaves need no two pointer probes each. Other
    leaves are checked and pinned under ``device`` (rule (5)).
    """
    if not cuda_usable():
        return batch
    lo, hi = registered if registered is not None else (0, 0)

    def pin_leaf(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.device.type != "cpu":
            return x
        if hi and x.numel() and lo <= x.data_ptr() and x.data_ptr() + byte_extent(x) <= hi:
            return x  # in the registered slot
        with _cuda.device_guard(device):
            return x if is_pinned(x) else pin(x)

    return tree_map(pin_leaf, batch)
