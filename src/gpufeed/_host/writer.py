"""The worker's side of a slot: a bump allocator over it, and the views it carves.

A worker writes each batch into the slot its task names (``_memory/ring.py``): ``SlotWriter``
hands out C-contiguous tensors at the slot's next free bytes (collation, the vectorised gather,
batch sources, ``gpufeed.sources.batch_empty``), and memory of the batch's spill file
(``_memory/spill.py``) for what does not fit. ``pack`` (``_host/collate.py``) then describes
where each leaf lies.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from .._memory.region import ALIGN, contiguous_at
from .._memory.spill import Spill

VIEW_CACHE = 1024  # carved views a SlotWriter keeps (NOTE [ Carved views ]), a few hundred KB
# A kept view: (view, byte offset in the region, bytes, aligned bytes, itemsize, dtype name,
# shape): all ``pack`` needs to describe it without touching the tensor
Carved = tuple[torch.Tensor, int, int, int, int, str, tuple[int, ...]]


class SlotWriter:
    def __init__(self, region: torch.Tensor, *, shared_fallback: bool) -> None:
        self.region = region
        self.base = region.data_ptr()
        self.limit = self.base + region.numel() * region.element_size()
        self.shared_fallback = shared_fallback
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        # (offset, shape, dtype) -> Carved, and id(view) -> Carved: NOTE [ Carved views ]
        self._views: dict[tuple[Any, ...], Carved] = {}
        self.carved: dict[int, Carved] = {}
        self.spill: Spill | None = None
        self.begin(0, 0)

    def begin(self, offset: int, size: int, sid: int = -1) -> None:
        """Start a batch in slot ``sid`` at ``offset`` (``size`` 0: no slot), dropping the spill
        of a previous batch that failed (``take_spill`` took the others')."""
        self.start = self.cur = offset
        self.end = offset + size
        self.sid = sid
        self.late: Callable[[], tuple[int, int, int] | None] | None = None
        self.waited_s = 0.0
        if self.spill is not None:
            self.spill.release()
            self.spill = None

    def begin_late(self, late: Callable[[], tuple[int, int, int] | None]) -> None:
        """Start a batch whose slot ``late()`` names, (id, offset, size) or None, at its first
        request for slot memory, if any (NOTE [ Slots bound when a task starts ]);
        ``waited_s`` says how long it waited."""
        self.begin(0, 0)
        self.late = late

    def _settle(self) -> None:
        late, self.late = self.late, None
        t0 = time.perf_counter()
        slot = late()  # type: ignore[misc]
        self.waited_s = time.perf_counter() - t0
        if slot is not None:
            self.sid, offset, size = slot
            self.start = self.cur = offset
            self.end = offset + size

    def take_spill(self) -> Spill | None:
        """The batch's spill file, if it needed one (the caller seals, sends, releases it)."""
        spill, self.spill = self.spill, None
        return spill

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A C-contiguous tensor of ``shape`` at the slot's next free bytes, or None when it
        does not fit (or there is no slot).

        NOTE [ Carved views ]: slots are recycled at the same offsets and batches repeat their
        shapes, so the view carved at (offset, shape, dtype) is kept (``as_strided`` costs
        1.5-3 us a leaf) and handed out again. Only gpufeed's own code gets these views
        (collation, the vectorised gather, ``pack``), and it only writes into them and reads
        where they lie: their metadata is never changed in place, and they never leave the
        worker (``pack`` describes them from what was recorded here, without touching the
        tensor, whose metadata may have left the CPU's caches). Batch sources get a view of
        their own (:meth:`alloc_fresh`). The region never moves in a worker, and each worker,
        thread or process, has its own writer.
        """
        if self.late is not None:
            self._settle()
        key = (self.cur, shape, dtype)
        hit = self._views.get(key)
        if hit is not None:
            t, _, nbytes, step = hit[:4]
            if self.cur + nbytes > self.end or self.end == self.start:
                return None
            self.cur += step
            return t
        off = self.cur
        fresh = self.alloc_fresh(shape, dtype)
        if fresh is not None:
            views = self._views
            if len(views) >= VIEW_CACHE:  # rings of many slots or leaves: start over
                views.clear()
                self.carved.clear()
            nbytes = fresh.numel() * dtype.itemsize
            views[key] = self.carved[id(fresh)] = (
                fresh, off, nbytes, (nbytes + ALIGN - 1) // ALIGN * ALIGN, dtype.itemsize,
                dtype_names.get(dtype) or dtype_name(dtype), tuple(fresh.shape))
        return fresh

    def alloc_fresh(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """As :meth:`alloc`, but a new view each call (for code that may keep or alter it)."""
        if self.late is not None:
            self._settle()
        numel = 1
        for d in shape:
            numel *= d
        isz = dtype.itemsize
        nbytes = numel * isz
        if self.cur + nbytes > self.end or self.end == self.start:  # full, or no slot at all
            return None
        t = contiguous_at(self.typed(dtype), shape, self.cur // isz)
        self.cur += (nbytes + ALIGN - 1) // ALIGN * ALIGN  # align()
        return t

    def typed(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole region as one 1-D tensor of ``dtype``, made once per dtype (the region's
        size is a multiple of every item size)."""
        typed = self._typed.get(dtype)
        if typed is None:
            typed = self._typed[dtype] = self.region.view(dtype)
        return typed

    def alloc_any(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Memory for a leaf: in the slot (``alloc``), else ``fallback``."""
        out = self.alloc(shape, dtype)
        return out if out is not None else self.fallback(shape, dtype)

    def alloc_any_fresh(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """As :meth:`alloc_any`, a new view each call: what datasets' batch sources get."""
        out = self.alloc_fresh(shape, dtype)
        return out if out is not None else self.fallback(shape, dtype)

    def fallback(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Memory for a tensor that does not fit the slot: the batch's spill file when it must
        cross processes (NOTE [ Spill ] in _memory/spill.py), else ordinary memory."""
        if not self.shared_fallback:
            return torch.empty(shape, dtype=dtype)
        if self.spill is None:
            self.spill = Spill()
        return self.spill.alloc(shape, dtype)

    def owns_ptr(self, ptr: int) -> bool:
        return self.start + self.base <= ptr < self.end + self.base

    def in_region(self, ptr: int) -> bool:
        """``ptr`` lies in the ring's region (this batch's slot or any other)."""
        return self.base <= ptr < self.limit

    def spill_offset(self, ptr: int) -> int | None:
        """Byte offset of ``ptr`` in this batch's spill file, or None if it is not there."""
        spill = self.spill
        if spill is None or not spill.owns_ptr(ptr):
            return None
        return ptr - spill.base


dtype_names: dict[torch.dtype, str] = {}  # how a leaf's dtype is named on the wire


def dtype_name(dtype: torch.dtype) -> str:
    name = dtype_names.get(dtype)
    if name is None:
        name = dtype_names[dtype] = str(dtype).removeprefix("torch.")
    return name


