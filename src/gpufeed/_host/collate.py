"""Collating straight into a slot, and the small messages that describe what is there.

``collate_into`` is ``default_collate`` (torch's own ``collate`` with a tensor rule of ours)
with stacked tensors written into a ``SlotWriter``'s memory (``_host/writer.py``): the batch
exists once, in the slot. ``pack`` describes each tensor or array of a collated batch by where
its bytes lie in the slot (copying it there first if needed); ``unpack`` views them back.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data._utils.collate import collate, default_collate_fn_map

from .._base.tree import byte_extent, tree_map
from .._memory.region import ALIGN, align, contiguous_strides
from .writer import SlotWriter, dtype_name, dtype_names


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


def collate_rules(writer: SlotWriter | None) -> dict[Any, Callable[..., Any]]:
    """``default_collate``'s rules by type, with stacked tensors written through ``writer``."""
    rules = dict(default_collate_fn_map)
    rules[torch.Tensor] = _stack_rule(writer)
    return rules


def collate_into(batch: list[Any], writer: SlotWriter | None) -> Any:
    return collate(batch, collate_fn_map=collate_rules(writer))


def ringable(t: torch.Tensor) -> bool:
    """Whether the ring (or a spill file) can hold ``t`` as raw bytes: a plain strided CPU
    tensor. Nested, sparse, quantized, subclassed (type and attributes) and other devices'
    tensors, and those that require grad (a flag the bytes lack), go torch's own way."""
    # is_cpu, not device.type, which builds a device object: eight times slower.
    return (
        type(t) is torch.Tensor and t.is_cpu and t.layout == torch.strided
        and not t.is_nested and not t.is_quantized and not t.requires_grad
    )


class LeafRef:
    """Where leaf ``index`` of a packed batch stood in its tree (see :func:`pack`).

    One instance per index and process, pickled by name (``LEAF_<index>``, this module's
    ``__getattr__``): a message of many batches pickles each once, and the main process places
    leaves by index, whatever order a container iterates in there.
    """

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"LEAF_{self.index}"

    __reduce__ = __repr__


_refs: list[LeafRef] = []
_flat: dict[int, tuple[LeafRef, ...]] = {}  # (LEAF_0, ..., LEAF_{n-1}): a flat batch


def leaf_ref(index: int) -> LeafRef:
    while len(_refs) <= index:
        ref = LeafRef(len(_refs))
        _refs.append(ref)
        globals()[repr(ref)] = ref  # found by the unpickler without calling __getattr__
    return _refs[index]


def __getattr__(name: str) -> LeafRef:  # unpickling LEAF_<index>
    if name.startswith("LEAF_") and name[5:].isdigit():
        return leaf_ref(int(name[5:]))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# One leaf on the wire, a plain tuple (cheap to pickle): (offset in elements, dtype name,
# shape, stride in elements or None when contiguous, a numpy array?, in the spill file?).
Leaf = tuple[int, str, tuple[int, ...], tuple[int, ...] | None, bool, bool]
_dtypes: dict[str, torch.dtype] = {}


def _dtype(name: str) -> torch.dtype:
    """A miss of ``unpack``'s lookup in ``_dtypes``: find the dtype and keep it."""
    dtype = getattr(torch, name)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"gpufeed internal error: {name!r} names no torch dtype")
    _dtypes[name] = dtype
    return dtype


class Packed(NamedTuple):
    """A batch described for the trip to the main process (see :func:`pack`)."""

    batch: Any  # the batch, its ringable leaves replaced by LeafRef
    leaves: list[Leaf]  # where each leaf's bytes lie, by LeafRef index
    used: int  # bytes of the slot the leaves span
    need: int  # bytes the whole batch would take in a slot (the ring learns slot sizes)
    unsupported: bool  # some tensor leaf is not ringable: it travels torch's own way


def pack(batch: Any, writer: SlotWriter | None) -> Packed:
    """Describe ``batch`` by offsets in its slot and, for process workers, its spill file.

    Leaves that do not fit the slot go to the spill file (process workers) or stay ordinary
    tensors (threads); never truncated. Leaves that are not ``ringable`` stay as they are
    (torch's pickling carries them, as the stock loader's). The others become a
    :class:`LeafRef` to a plain :data:`Leaf` tuple: neither costs the pickler a Python call.
    """
    used = 0
    need = 0
    unsupported = False
    leaves: list[Leaf] = []
    names, refs = dtype_names, _refs
    carved, start, end = (writer.carved, writer.start, writer.end) if writer else ({}, 0, 0)

    def leaf(x: Any) -> Any:
        nonlocal used, need, unsupported
        is_numpy = False
        kept = carved.get(id(x))
        if kept is not None and kept[0] is x and start <= kept[1] < end:
            # a view the writer carved in this slot (NOTE [ Carved views ]): all is known
            _, off, nbytes, step, esize, name, shape = kept
            rel = off - start
            need += step
            if rel + nbytes > used:
                used = rel + nbytes
            leaves.append((rel // esize, name, shape, None, False, False))
            k = len(leaves) - 1
            return refs[k] if k < len(refs) else leaf_ref(k)
        if (type(x) is torch.Tensor and writer is not None and x.is_cpu
                and x.layout == torch.strided and not x.is_nested and not x.is_quantized
                and writer.start + writer.base <= x.data_ptr() < writer.end + writer.base
                and x.is_contiguous()):
            # the common case, in line: a ringable leaf collated into the slot
            esize = x.element_size()
            nbytes = x.numel() * esize
            need += (nbytes + ALIGN - 1) // ALIGN * ALIGN
            rel = x.data_ptr() - writer.base - writer.start
            if rel + nbytes > used:
                used = rel + nbytes
            leaves.append((rel // esize, names.get(x.dtype) or dtype_name(x.dtype),
                           tuple(x.shape), None, False, False))
            k = len(leaves) - 1
            return refs[k] if k < len(refs) else leaf_ref(k)
        if isinstance(x, torch.Tensor):
            if not ringable(x):
                unsupported = True
                return x
            t = x
        elif type(x) is np.ndarray:  # subclasses (masked arrays, matrices) are pickled
            # Strings, objects, datetimes (kinds other than "biufc") are pickled as they are.
            if (x.dtype.kind not in "biufc" or not x.dtype.isnative
                    or not (x.flags.c_contiguous or x.flags.f_contiguous)):
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
        spilled = None
        if not writer.owns_ptr(ptr):
            spilled = writer.spill_offset(ptr)  # collated into the spill file already?
            if spilled is None and writer.in_region(ptr):
                # Another slot's: kept past its batch (NOTE [ Batches built in the slot ]).
                raise ValueError(
                    "a tensor of this batch lies in the loader's ring but outside the batch's "
                    "own slot: memory from gpufeed.sources.batch_empty() kept past the batch it "
                    "was made for (a buffer cached and refilled for the next batch). Call "
                    "batch_empty() for each batch instead: its memory belongs to that batch and "
                    "is recycled once the batch is dropped"
                )
            if spilled is None:  # copy it into the slot, else into the batch's spill file
                dst = writer.alloc(tuple(t.shape), t.dtype)
                if dst is None:
                    if not writer.shared_fallback:
                        return x
                    dst = writer.fallback(tuple(t.shape), t.dtype)
                t = dst.copy_(t)
                ptr = t.data_ptr()
                spilled = writer.spill_offset(ptr)
        contiguous = t.is_contiguous()
        stride = None if contiguous else t.stride()
        if spilled is None:
            offset = ptr - writer.base - writer.start
            span = nbytes if contiguous else byte_extent(t)
            if offset + span > used:
                used = offset + span
        else:
            offset = spilled
        leaves.append((offset // esize, dtype_name(t.dtype), tuple(t.shape), stride, is_numpy,
                       spilled is not None))
        return leaf_ref(len(leaves) - 1)

    cls = type(batch)
    if (cls is tuple or cls is list) and set(map(type, batch)) <= _PLAIN:  # no walk needed
        packed = cls(map(leaf, batch))
    else:
        packed = tree_map(leaf, batch)
    return tuple.__new__(Packed, (packed, leaves, used, need, unsupported))


_PLAIN = {torch.Tensor}  # leaves tree_map hands to its function as they are


def unpack(packed: tuple[Any, list[Leaf]], base: np.ndarray | None,
           spill: torch.Tensor | None = None) -> Any:
    """Rebuild ``(tree, leaves)`` of :func:`pack` as views of ``base`` (the slot's bytes; None:
    only empty leaves) and ``spill`` (its spill file's bytes, if any)."""
    tree, leaves = packed
    if not leaves:
        return tree
    spilled = spill.numpy() if spill is not None else None  # the spill file's bytes
    views = []
    dtypes, frombuffer, prod = _dtypes, torch.frombuffer, math.prod
    for offset, name, shape, stride, is_numpy, in_spill in leaves:
        dtype = dtypes.get(name) or _dtype(name)
        if 0 in shape:
            t = torch.empty(shape, dtype=dtype)
        else:
            # A storage of its own bytes only, as a collated tensor has: a label kept from a
            # batch is not saved (torch.save) or shared with the whole slot.
            buf = spilled if in_spill else base
            if stride is None:
                t = frombuffer(buf, dtype=dtype, count=prod(shape),
                               offset=offset * dtype.itemsize)
                if len(shape) != 1:  # as_strided: quicker than view
                    t = t.as_strided(shape, contiguous_strides(shape))
            else:
                t = frombuffer(buf, dtype=dtype, offset=offset * dtype.itemsize,
                               count=1 + sum((d - 1) * st for d, st in zip(shape, stride,
                                                                           strict=True)))
                t = t.as_strided(shape, stride)
        views.append(t.numpy() if is_numpy else t)
    cls = type(tree)
    n = len(views)
    if (cls is tuple or cls is list) and len(tree) == n and all(
            map(operator.is_, tree, _flat.get(n) or _flat_refs(n))):
        return tuple(views) if cls is tuple else views  # a flat batch: (x, y), [x, y]
    return tree_map(lambda x: views[x.index] if type(x) is LeafRef else x, tree)


def _flat_refs(n: int) -> tuple[LeafRef, ...]:
    """A miss of ``unpack``'s lookup in ``_flat``: make and keep the ``n`` refs."""
    refs = _flat[n] = tuple(leaf_ref(i) for i in range(n))
    return refs


