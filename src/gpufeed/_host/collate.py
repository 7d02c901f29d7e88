"""Collating straight into a slot, and the small messages that describe what is there.

``collate_into`` has the semantics of ``torch.utils.data.default_collate`` (it is built on
torch's own ``collate`` with a tensor rule of ours), except that stacked tensors are written
into memory handed out by a :class:`SlotWriter`, so the batch exists once, in the slot.

``pack`` replaces each tensor or array of a collated batch (from any ``collate_fn``) by a
:class:`Leaf` naming where its bytes lie in the slot, copying it there first if it is not
already; ``unpack`` turns those leaves back into tensors or arrays viewing the slot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data._utils.collate import collate, default_collate_fn_map

from .._base.tree import tree_map
from .._memory.region import ALIGN, align, contiguous_at
from .._memory.spill import Spill

Alloc = Callable[[tuple[int, ...], torch.dtype], "torch.Tensor | None"]


class SlotWriter:
    """Bump allocator over one slot of the region (worker side)."""

    def __init__(self, region: torch.Tensor, *, shared_fallback: bool) -> None:
        self.region = region
        self.base = region.data_ptr()
        self.shared_fallback = shared_fallback
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        self.spill: Spill | None = None
        self.begin(0, 0)

    def begin(self, offset: int, size: int) -> None:
        """Start a batch in the slot at ``offset`` (``size`` 0: no slot). The previous batch's
        spill was taken by ``take_spill``, unless that batch failed: it is dropped here."""
        self.start = self.cur = offset
        self.end = offset + size
        if self.spill is not None:
            self.spill.release()
            self.spill = None

    def take_spill(self) -> Spill | None:
        """The batch's spill file, if it needed one (the caller seals, sends, releases it)."""
        spill, self.spill = self.spill, None
        return spill

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        numel = 1
        for d in shape:
            numel *= d
        isz = dtype.itemsize
        nbytes = numel * isz
        if self.cur + nbytes > self.end or self.end == self.start:  # full, or no slot at all
            return None
        typed = self._typed.get(dtype)
        if typed is None:  # the region's size is a multiple of every itemsize
            typed = self._typed[dtype] = self.region.view(dtype)
        t = contiguous_at(typed, shape, self.cur // isz)
        self.cur += align(nbytes)
        return t

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

    def spill_offset(self, ptr: int) -> int | None:
        """Byte offset of ``ptr`` in this batch's spill file, or None if it is not there."""
        spill = self.spill
        if spill is None or not spill.owns_ptr(ptr):
            return None
        return ptr - spill.base


def _stack_rule(writer: SlotWriter | None) -> Callable[..., torch.Tensor]:
    def stack(batch: Any, *, collate_fn_map: Any = None) -> torch.Tensor:
        elem = batch[0]
        if writer is None or not ringable(elem):  # torch's own rule, and its memory
            return collate(batch, collate_fn_map=default_collate_fn_map)
        shape = elem.shape
        for t in batch:
            if t.shape != shape:  # let torch raise its own message
                return torch.stack(batch, 0)
        out_shape = (len(batch), *shape)
        out = writer.alloc(out_shape, elem.dtype)
        if out is None:
            out = writer.fallback(out_shape, elem.dtype)
        return torch.stack(batch, 0, out=out)

    return stack


def collate_into(batch: list[Any], writer: SlotWriter | None) -> Any:
    """``default_collate(batch)`` with stacked tensors written through ``writer``."""
    rules = dict(default_collate_fn_map)
    rules[torch.Tensor] = _stack_rule(writer)
    return collate(batch, collate_fn_map=rules)


def ringable(t: torch.Tensor) -> bool:
    """Whether the ring (or a spill file) can hold ``t`` as raw bytes viewed back as a tensor:
    a plain strided CPU tensor. Nested, sparse and quantized tensors, tensor subclasses (their
    type and attributes) and tensors on other devices go torch's own way."""
    return (
        type(t) is torch.Tensor and t.device.type == "cpu" and t.layout == torch.strided
        and not t.is_nested and not t.is_quantized
    )


class Leaf:
    """Where one tensor (or numpy array) of a batch lies: in its slot, or in its spill file."""

    __slots__ = ("dtype", "is_numpy", "offset", "shape", "spill", "stride")

    def __init__(
        self, offset: int, dtype: torch.dtype, shape: tuple[int, ...], stride: tuple[int, ...],
        is_numpy: bool, spill: bool = False,
    ) -> None:
        self.offset, self.dtype, self.shape, self.stride = offset, dtype, shape, stride
        self.is_numpy, self.spill = is_numpy, spill

    def __reduce__(self) -> tuple[Any, ...]:
        return (Leaf, (self.offset, self.dtype, self.shape, self.stride, self.is_numpy,
                       self.spill))


class Packed(NamedTuple):
    """A batch described for the trip to the main process (see :func:`pack`)."""

    batch: Any  # the batch, its ringable leaves replaced by Leaf
    used: int  # bytes of the slot the leaves span
    need: int  # bytes the whole batch would take in a slot (the ring learns slot sizes)
    unsupported: bool  # some tensor leaf is not ringable: it travels torch's own way


def pack(batch: Any, writer: SlotWriter | None) -> Packed:
    """Describe ``batch`` by offsets in its slot and, for process workers, its spill file.

    Leaves that do not fit the slot are copied into the spill file (process workers) or stay
    ordinary tensors (threads); never truncated. Leaves that are not ``ringable`` stay as they
    are (torch's pickling carries them, as the stock loader's).
    """
    used = 0
    need = 0
    unsupported = False

    def leaf(x: Any) -> Any:
        nonlocal used, need, unsupported
        is_numpy = False
        if isinstance(x, torch.Tensor):
            if not ringable(x):
                unsupported = True
                return x
            t = x
        elif isinstance(x, np.ndarray):
            if (
                x.dtype.kind not in "biufc"  # strings, objects, datetimes: pickled as they are
                or not x.dtype.isnative
                or not (x.flags.c_contiguous or x.flags.f_contiguous)
            ):
                return x
            t = torch.from_numpy(x)
            is_numpy = True
        else:
            return x
        esize = t.element_size()
        nbytes = t.numel() * esize
        need += align(nbytes)
        if writer is None:
            return x
        ptr = t.data_ptr()
        if not writer.owns_ptr(ptr):
            spilled = writer.spill_offset(ptr)  # collated into the spill file already?
            if spilled is None:  # copy it into the slot, else into the batch's spill file
                dst = writer.alloc(tuple(t.shape), t.dtype)
                if dst is None:
                    if not writer.shared_fallback:
                        return x
                    dst = writer.fallback(tuple(t.shape), t.dtype)
                t = dst.copy_(t)
                ptr = t.data_ptr()
                spilled = writer.spill_offset(ptr)
            if spilled is not None:
                return Leaf(spilled // esize, t.dtype, tuple(t.shape), t.stride(), is_numpy,
                            spill=True)
        rel = ptr - writer.base - writer.start
        span = nbytes if t.is_contiguous() else _span(t)
        if rel + span > used:
            used = rel + span
        return Leaf(rel // esize, t.dtype, tuple(t.shape), t.stride(), is_numpy)

    packed = tree_map(leaf, batch)
    return Packed(packed, used, need, unsupported)


def _empty_leaf(x: Any) -> Any:
    if type(x) is not Leaf:
        return x
    t = torch.empty(x.shape, dtype=x.dtype)
    return t.numpy() if x.is_numpy else t


def _span(t: torch.Tensor) -> int:
    """Bytes from a tensor's first element to just past its last."""
    if t.numel() == 0:
        return 0
    last = sum((d - 1) * s for d, s in zip(t.shape, t.stride(), strict=True))
    return (last + 1) * t.element_size()


def unpack(packed: Any, base: np.ndarray | None, spill: torch.Tensor | None = None) -> Any:
    """Rebuild a packed batch as views of ``base`` (the slot's bytes; None: no leaf lies
    there but empty ones) and ``spill`` (its spill file's bytes, if any)."""
    if base is None and spill is None:
        return tree_map(_empty_leaf, packed)
    typed: dict[tuple[bool, torch.dtype], torch.Tensor] = {}

    def leaf(x: Any) -> Any:
        if type(x) is not Leaf:
            return x
        if 0 in x.shape:
            return _empty_leaf(x)
        key = (x.spill, x.dtype)
        flat = typed.get(key)
        if flat is None:  # frombuffer per dtype: much cheaper than a uint8 .view(dtype)
            flat = typed[key] = (
                spill.view(x.dtype) if spill is not None and x.spill
                else torch.frombuffer(base, dtype=x.dtype)
            )
        t = flat.as_strided(x.shape, x.stride, x.offset)
        return t.numpy() if x.is_numpy else t

    return tree_map(leaf, packed)


__all__ = ["ALIGN", "Leaf", "Packed", "SlotWriter", "collate_into", "pack", "ringable", "unpack"]
