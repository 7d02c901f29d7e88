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
from typing import Any

import numpy as np
import torch
from torch.utils.data._utils.collate import collate, default_collate_fn_map

from ._ring import ALIGN, align
from ._tree import tree_map

Alloc = Callable[[tuple[int, ...], torch.dtype], "torch.Tensor | None"]


class SlotWriter:
    """Bump allocator over one slot of the region (worker side)."""

    def __init__(self, region: torch.Tensor, *, shared_fallback: bool) -> None:
        self.region = region
        self.base = region.data_ptr()
        self.shared_fallback = shared_fallback
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        self.begin(0, 0)

    def begin(self, offset: int, size: int) -> None:
        self.start = self.cur = offset
        self.end = offset + size

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
        stride = []
        acc = 1
        for d in reversed(shape):
            stride.append(acc)
            acc *= d
        t = typed.as_strided(shape, stride[::-1], self.cur // isz)
        self.cur += align(nbytes)
        return t

    def fallback(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Memory for a tensor that does not fit: shared memory when it must cross processes."""
        if not self.shared_fallback:
            return torch.empty(shape, dtype=dtype)
        numel = 1
        for d in shape:
            numel *= d
        storage = torch.UntypedStorage._new_shared(max(numel * dtype.itemsize, 1))
        strides = torch.empty(shape, device="meta").stride()
        return torch.empty(0, dtype=dtype).set_(storage, 0, shape, strides)

    def owns_ptr(self, ptr: int) -> bool:
        return self.start + self.base <= ptr < self.end + self.base


def _stack_rule(writer: SlotWriter | None) -> Callable[..., torch.Tensor]:
    def stack(batch: Any, *, collate_fn_map: Any = None) -> torch.Tensor:
        elem = batch[0]
        shape = elem.shape
        if elem.is_nested or elem.layout != torch.strided or writer is None:
            return collate(batch, collate_fn_map=default_collate_fn_map)
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


class Leaf:
    """Where one tensor (or numpy array) of a batch lies in its slot."""

    __slots__ = ("dtype", "is_numpy", "offset", "shape", "stride")

    def __init__(
        self, offset: int, dtype: torch.dtype, shape: tuple[int, ...], stride: tuple[int, ...],
        is_numpy: bool,
    ) -> None:
        self.offset, self.dtype, self.shape, self.stride = offset, dtype, shape, stride
        self.is_numpy = is_numpy

    def __reduce__(self) -> tuple[Any, ...]:
        return (Leaf, (self.offset, self.dtype, self.shape, self.stride, self.is_numpy))


def pack(batch: Any, writer: SlotWriter | None) -> tuple[Any, int, int]:
    """Describe ``batch`` by slot offsets; returns (packed, bytes used, bytes needed).

    ``needed`` is what the whole batch would take in a slot; the main process learns slot
    sizes from it. Leaves that do not fit stay ordinary tensors (never truncated).
    """
    used = 0
    need = 0

    def leaf(x: Any) -> Any:
        nonlocal used, need
        is_numpy = False
        if type(x) is torch.Tensor or isinstance(x, torch.Tensor):
            if x.device.type != "cpu" or x.layout != torch.strided:
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
            dst = writer.alloc(tuple(t.shape), t.dtype)
            if dst is None:
                return x
            dst.copy_(t)
            t = dst
            ptr = t.data_ptr()
        rel = ptr - writer.base - writer.start
        span = nbytes if t.is_contiguous() else _span(t)
        if rel + span > used:
            used = rel + span
        return Leaf(rel // esize, t.dtype, tuple(t.shape), t.stride(), is_numpy)

    packed = tree_map(leaf, batch)
    return packed, used, need


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


def unpack(packed: Any, base: np.ndarray | None) -> Any:
    """Rebuild a packed batch as views of ``base`` (the slot's bytes)."""
    if base is None:  # nothing of the batch lies in a slot but empty tensors, if any
        return tree_map(_empty_leaf, packed)
    typed: dict[torch.dtype, torch.Tensor] = {}

    def leaf(x: Any) -> Any:
        if type(x) is not Leaf:
            return x
        if 0 in x.shape:
            return _empty_leaf(x)
        flat = typed.get(x.dtype)
        if flat is None:  # frombuffer per dtype: much cheaper than a uint8 .view(dtype)
            flat = typed[x.dtype] = torch.frombuffer(base, dtype=x.dtype)
        t = flat.as_strided(x.shape, x.stride, x.offset)
        return t.numpy() if x.is_numpy else t

    return tree_map(leaf, packed)


__all__ = ["ALIGN", "Leaf", "SlotWriter", "collate_into", "pack", "unpack"]
