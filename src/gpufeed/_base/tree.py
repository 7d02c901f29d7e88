"""Walking nested batches: tuples, lists, dicts, namedtuples and dataclasses.

A batch is a tree whose containers are rebuilt with their own type and whose leaves
(tensors, arrays, numbers, strings, anything else) are handed to a function.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, MutableMapping, MutableSequence, Sequence
from typing import Any

import numpy as np
import torch

_ATOMS = (str, bytes, bytearray, memoryview, range)


# How tree_map treats each type, decided once per type (the checks below cost ~1 us per leaf
# through the abstract-base-class machinery; a batch walk is on every batch's path).
_LEAF, _LIST, _TUPLE, _DICT, _NAMEDTUPLE, _MUTMAP, _MAP, _MUTSEQ, _SEQ, _DATACLASS = range(10)
_kinds: dict[type, int] = {list: _LIST, tuple: _TUPLE, dict: _DICT}


def _kind(t: type) -> int:
    if issubclass(t, _ATOMS):
        return _LEAF
    if issubclass(t, tuple) and hasattr(t, "_fields"):
        return _NAMEDTUPLE
    if issubclass(t, Mapping):
        return _MUTMAP if issubclass(t, MutableMapping) else _MAP
    # torch.Tensor and numpy arrays are leaves even though they are sequences.
    if issubclass(t, Sequence) and not (hasattr(t, "__array_interface__")
                                        or hasattr(t, "data_ptr")):
        return _MUTSEQ if issubclass(t, MutableSequence) else _SEQ
    if dataclasses.is_dataclass(t):
        return _DATACLASS
    return _LEAF


def tree_map(fn: Callable[[Any], Any], obj: Any) -> Any:
    """Return ``obj`` with every leaf replaced by ``fn(leaf)``; containers keep their type."""
    t = type(obj)
    kind = _kinds.get(t)
    if kind is None:
        kind = _kinds[t] = _kind(t)
    if kind == _LEAF:
        return fn(obj)
    if kind == _LIST:
        return [tree_map(fn, x) for x in obj]
    if kind == _TUPLE:
        return tuple(tree_map(fn, x) for x in obj)
    if kind == _DICT:
        return {k: tree_map(fn, v) for k, v in obj.items()}
    if kind == _NAMEDTUPLE:
        return t(*(tree_map(fn, x) for x in obj))
    if kind == _MUTMAP:
        clone = copy.copy(obj)
        for k, v in obj.items():
            clone[k] = tree_map(fn, v)
        return clone
    if kind == _MAP:  # rebuilt from a dict, as the default collate rebuilds it
        items = {k: tree_map(fn, v) for k, v in obj.items()}
        try:
            return t(items)
        except TypeError:  # its __init__ takes no dict: a plain one, as stock
            return items
    if kind == _MUTSEQ:
        seq = copy.copy(obj)
        for i, v in enumerate(obj):
            seq[i] = tree_map(fn, v)
        return seq
    if kind == _SEQ:  # rebuilt from a list, as the default collate rebuilds it; each leaf
        values = [tree_map(fn, x) for x in obj]  # mapped once, whatever t accepts
        try:
            return t(values)
        except TypeError:
            return values
    # A dataclass instance: copied, then its fields set, as unpickling rebuilds it (stock's
    # workers pickle it): neither __init__ nor __post_init__ runs again, init=False fields and
    # a frozen one's fields are kept.
    clone = copy.copy(obj)
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name, _UNSET)  # an init=False field nothing set yet: none
        if value is not _UNSET:
            object.__setattr__(clone, f.name, tree_map(fn, value))
    return clone


_UNSET: Any = object()


def tree_leaves(obj: Any) -> list[Any]:
    """The leaves of ``obj`` in the order :func:`tree_map` visits them."""
    out: list[Any] = []

    def visit(x: Any) -> Any:
        out.append(x)
        return x

    tree_map(visit, obj)
    return out


def batch_len(batch: Any) -> int | None:
    """How many samples a collated batch holds: the first dimension of its first tensor or
    array with one, or the length of its first list of strings or bytes (how the default
    collate batches strings), depth first; None when there is neither."""
    cls = type(batch)
    if cls is tuple or cls is list:  # (features, labels), first: one call, not 4 isinstance
        first = batch[0] if batch else None
        if type(first) is torch.Tensor and first.dim():
            return int(first.size(0))
    if isinstance(batch, torch.Tensor):  # size(0), not shape: nested tensors have no shape
        return int(batch.size(0)) if batch.dim() else None
    if isinstance(batch, np.ndarray):
        return int(batch.shape[0]) if batch.ndim else None
    if isinstance(batch, _ATOMS):
        return None
    if isinstance(batch, Mapping):
        items: Any = batch.values()
    elif isinstance(batch, list | tuple):
        if batch and all(isinstance(x, _ATOMS) for x in batch):
            return len(batch)
        items = batch
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        items = (getattr(batch, f.name) for f in dataclasses.fields(batch))
    else:
        return None
    for item in items:
        n = batch_len(item)
        if n is not None:
            return n
    return None


def byte_extent(t: torch.Tensor) -> int:
    """Bytes a view ``t`` spans in its storage, from its first element to just past its last
    (0 when it has none)."""
    if t.numel() == 0:
        return 0
    last = sum((d - 1) * s for d, s in zip(t.shape, t.stride(), strict=True))
    return (last + 1) * t.element_size()
